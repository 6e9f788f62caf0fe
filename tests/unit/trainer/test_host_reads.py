"""The packed forward and backward pass read nothing back from the device, and a whole training
step reads its statistics once (issue 37).

On a GPU, each host read of a device tensor (`.tolist()`, `.item()`, a tensor in an `if`, a
boolean index) waits for every queued kernel: the host stops running ahead, and the GPU idles
while it launches the next ones. Stop 55 found megatron-core 0.16.1's THD rotary embedding reading
a pack's bounds twice for q and twice for k in every layer when they were on the device (96 waits
per forward at 0.5B), and the per-sequence attention splits reading them once per layer in both
backends. The bounds now stay on the host where nothing on the device reads them
(`bounds_device` in both backends). Past the forward, the loss's statistics were read one by one
(about 25 per micro-batch, boolean indexing among them); now they stay 0-d device tensors until
`stats_on_host` reads them all once per step.

The CPU stand-in for "reading the device waits": the model and its inputs on the meta device,
whose tensors hold no values, so any host read raises. The bounds come from the packer on the
host, as in a run. Checked to fail: with the bounds on the device (`bounds_device` = the model's),
both backends raise from inside the model (the last test keeps that check).
"""
from __future__ import annotations

import contextlib

import megatron_case as mc
import pytest
import torch

import tandem.trainer.megatron.backend as megatron_backend
import tandem.trainer.torch_backend as torch_backend
from tandem.trainer import objective_step
from tandem.trainer.backend import add_stats, stats_on_host
from tandem.trainer.config import TrainerConfig
from tandem.trainer.torch_backend import VARLEN_ATTENTION, TorchBackend

META = torch.device("meta")


def _torch_on_meta(model_dir, **cfg) -> TorchBackend:
    be = TorchBackend(TrainerConfig(packed_forward=True, **cfg), model_dir, seed=0)
    assert be.model.config._attn_implementation == VARLEN_ATTENTION   # the path without flash-attn
    be.model.to(META)
    be.device = META
    return be


def _forward_backward(forward) -> torch.Tensor:
    out = forward()
    assert out.logp.device == META and out.entropy is not None
    (out.logp.sum() + out.entropy.sum()).backward()
    return out.logp


@pytest.mark.parametrize("recompute", [False, True])
def test_the_torch_backends_packed_step_reads_nothing_from_the_device(small_model_dir, recompute):
    be = _torch_on_meta(small_model_dir, recompute=recompute, logprob_chunk=5)
    mb = mc.micro_batches()[0]
    logp = _forward_backward(lambda: be._forward_in_dtype(mb, 1.0, True))
    assert logp.shape == (mb.n_tokens,)
    assert all(p.grad is not None for p in be.model.parameters())


@contextlib.contextmanager
def _megatron_on_meta(tmp_path):
    gen = mc.in_process_backend(mc.make_model_dir(tmp_path / "qwen2"))
    be = next(gen)
    try:
        model = be._module()
        model.to(META)
        # megatron-core keeps the rotary frequencies in a plain attribute, not a buffer, made on
        # the current CUDA device (here the CPU): `.to()` does not move it
        model.rotary_pos_emb.inv_freq = model.rotary_pos_emb.inv_freq.to(META)
        be.device = META
        yield be
    finally:
        gen.close()


def test_the_megatron_backends_packed_step_reads_nothing_from_the_device(tmp_path):
    with _megatron_on_meta(tmp_path) as be:
        assert be.bounds_device == torch.device("cpu")   # the local spec, as on a GPU without TE
        mb = mc.micro_batches()[0]
        logp = _forward_backward(lambda: be._outputs(mb, be._stage_forward(mb), 1.0, True))
        assert logp.shape == (mb.n_tokens,)
        assert all(p.grad is not None for p in be._module().parameters())


def test_bounds_on_the_device_are_read_inside_the_model(small_model_dir, tmp_path):
    """The stand-in can fail: the same steps with the bounds where the model is raise at the
    first host read: in the torch backend's attention split, in megatron-core's rotary embedding."""
    be = _torch_on_meta(small_model_dir)
    be.bounds_device = META
    with pytest.raises(NotImplementedError, match="meta tensor") as torch_read:
        be._forward_in_dtype(mc.micro_batches()[0], 1.0, True)
    assert torch_read.traceback[-1].name == "packed_sequences"
    with _megatron_on_meta(tmp_path) as be:
        be.bounds_device = META
        with pytest.raises(NotImplementedError, match="meta tensor") as megatron_read:
            be._stage_forward(mc.micro_batches()[0])
    assert megatron_read.traceback[-1].name == "_apply_rotary_pos_emb_thd"


def _one_read(monkeypatch, module) -> list[list[str]]:
    """Replaces `module.stats_on_host`, the step's read of its statistics, with one that records
    the call and reports a non-finite policy loss: meta tensors have no values to read, and the
    step then ends as a non-finite loss ends it, before the gradient norm (read once per step by
    design, like the statistics)."""
    reads = []

    def on_host(stats):
        assert all(v.device == META for v in stats.values() if isinstance(v, torch.Tensor))
        reads.append(sorted(stats))
        return {**{k: 0.0 for k in stats}, "nonfinite_policy": 1.0}
    monkeypatch.setattr(module, "stats_on_host", on_host)
    return reads


def _assert_one_read_of_everything(reads, result) -> None:
    assert len(reads) == 1, reads
    assert {"loss", "clipped", "imp_weight_max", "kl_sum", "entropy_sum", "mismatch_tokens",
            "nonfinite_policy"} <= set(reads[0])
    assert result.nonfinite == {"policy": 1} and not result.applied


def test_a_whole_torch_training_step_reads_its_statistics_once(small_model_dir, monkeypatch):
    be = _torch_on_meta(small_model_dir)
    be._forward = be._forward_in_dtype   # without its autocast scope, which has no meta device type
    reads = _one_read(monkeypatch, torch_backend)
    mp = mc.ppo_minibatch()
    result = be.train_step(mp.micro_batches, objective_step.make_loss_fn(mc.PPO_SETTINGS, mp, 0, 1, 2), 1.0)
    _assert_one_read_of_everything(reads, result)


def test_a_whole_megatron_training_step_reads_its_statistics_once(tmp_path, monkeypatch):
    reads = _one_read(monkeypatch, megatron_backend)
    with _megatron_on_meta(tmp_path) as be:
        mp = mc.ppo_minibatch()
        result = be.train_step(mp.micro_batches, objective_step.make_loss_fn(mc.PPO_SETTINGS, mp, 0, 1, 2), 1.0)
    _assert_one_read_of_everything(reads, result)


def test_statistics_add_up_where_they_are_and_are_read_together():
    total: dict = {}
    add_stats(total, {"valid": torch.tensor(3), "imp_weight_max": torch.tensor(1.5), "kl_sum": 0.0})
    add_stats(total, {"valid": torch.tensor(4), "imp_weight_max": torch.tensor(2.5), "kl_sum": torch.tensor(0.25)})
    add_stats(total, {"imp_weight_max": 0.5, "loss": 1.0})
    add_stats(total, {"loss": 2.0})
    assert total["valid"].dtype == torch.float64 and total["loss"] == 3.0   # sums in float64, floats stay floats
    assert stats_on_host(total) == {"valid": 7.0, "imp_weight_max": 2.5, "kl_sum": 0.25, "loss": 3.0}
