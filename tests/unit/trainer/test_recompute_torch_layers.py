"""The torch backend's side of activation recompute by memory: its decoder layers keep, per token,
exactly the bytes the shared estimate counts (launcher/simulate/memory.py, `_layer_activation_bytes`:
what `tandem plan` and `trainer.recompute: auto` predict with), and with auto and a device too
small for the pack (TANDEM_DEVICE_MEMORY_BYTES) the backend really recomputes them: its layers are
checkpointed, keep their float32 input only, and the step's gradients and updated weights are the
numbers of no recompute.

What autograd keeps is counted with saved-tensor hooks, storage by storage (a view is its
storage), for the second decoder layer's forward (storages first made there: the rotary tables
the first layer already saved are not its own), at two pack sizes: the difference per token is
the per-token term, the rest what the layer keeps whatever the pack (autocast's bf16 weight
copies)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tandem.launcher.simulate.hardware import load_model_shape
from tandem.launcher.simulate.memory import _layer_activation_bytes, trainer_parts
from tandem.trainer import recompute
from tandem.trainer.config import TrainerConfig
from tandem.trainer.microbatch import pack
from tandem.trainer.torch_backend import TorchBackend


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """Every size distinct (h 96, 6 heads of 16, 2 KV heads, ffn 160), so a wrong term shows."""
    from tandem.rollout.tiny_model import init_tiny
    return init_tiny(tmp_path_factory.mktemp("m"), layers=2, hidden=96, heads=6, kv_heads=2, intermediate=160,
                     max_position=256, seed=0)


@pytest.fixture(autouse=True)
def no_stand_in(monkeypatch):
    monkeypatch.delenv(recompute.ENV, raising=False)


def cfg(**kw) -> TrainerConfig:
    c = TrainerConfig(temperature=1.0, max_staleness=0, logprob_chunk=0, **kw)
    c.optim.lr = 1e-2
    return c


def seqs(n: int, length: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    return [rng.integers(7, 200, length) for _ in range(n)]


def layer_saved_bytes(be: TorchBackend, mb) -> int:
    """Bytes of the storages autograd saves, first, inside the second decoder layer's forward."""
    params = {p.untyped_storage().data_ptr() for p in be.model.parameters()}
    seen: set[int] = set()
    inside, counted = [False], [0]

    def pack_hook(t):
        key = t.untyped_storage().data_ptr()
        if key not in params and key not in seen:
            seen.add(key)
            counted[0] += t.untyped_storage().nbytes() if inside[0] else 0
        return t

    layer = be.model.model.layers[1]
    hooks = [layer.register_forward_pre_hook(lambda *_: inside.__setitem__(0, True)),
             layer.register_forward_hook(lambda *_: inside.__setitem__(0, False))]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack_hook, lambda t: t):
            be._forward(mb, 1.0, with_entropy=False)
    finally:
        for h in hooks:
            h.remove()
    return counted[0]


@pytest.mark.parametrize("dtype, compute, replica", [(torch.float32, "float32", 4),
                                                     (torch.float32, "bfloat16", 4),
                                                     (torch.bfloat16, "float32", 2)],
                         ids=["float32", "bf16-autocast", "bf16-parameters"])
def test_a_decoder_layer_keeps_what_the_estimate_counts(model_dir, dtype, compute, replica):
    """float32; trainer.compute_dtype: bfloat16 (a run's GPU setting: float32 replica, autocast);
    bf16 parameters without autocast (benchmarks/results/gpu_speed.json's torch rows)."""
    be = TorchBackend(cfg(recompute=False, compute_dtype=compute), model_dir, 0, dtype=dtype)
    small, large = (layer_saved_bytes(be, pack(seqs(4, n))) for n in (8, 16))
    per_token = (large - small) / 32
    shape = load_model_shape("", str(model_dir))
    s = 2 if dtype == torch.bfloat16 or compute == "bfloat16" else 4
    assert per_token == _layer_activation_bytes(shape, 1, s, torch_layer=True, replica=replica)
    # autocast's bf16 copies of the layer's weight matrices (q, k, v, o; gate, up, down)
    h, kv, ffn = 96, 2 * 16, 160
    copies = 2 * (2 * h * h + 2 * h * kv + 3 * h * ffn) if compute == "bfloat16" else 0
    assert small - 32 * per_token == copies
    if replica == 4:   # a configuration a run has (the backend's replica is float32): the plan's figure
        parts = trainer_parts(cfg(compute_dtype=compute, max_tokens_per_mb=32), shape, 1, recompute=False)
        assert parts["activations"] == shape.layers * (32 * per_token + copies)


def test_auto_with_a_small_device_checkpoints_every_layer_and_changes_no_number(model_dir, monkeypatch):
    mb = pack(seqs(6, 12, seed=5))

    def loss_fn(_, out):
        loss = -out.logp.sum() / mb.n_tokens
        return loss, {"loss": loss.detach()}

    runs = {}
    for name, setting, cap in (("off", False, None), ("auto-cpu", "auto", None), ("auto-small", "auto", "1e6")):
        if cap:
            monkeypatch.setenv(recompute.ENV, cap)
        be = TorchBackend(cfg(recompute=setting), model_dir, 0)
        monkeypatch.delenv(recompute.ENV, raising=False)
        kept = layer_saved_bytes(be, mb)
        res = be.train_step([mb], loss_fn, 1.0)
        runs[name] = (be, kept, res.grad_norm, {n: p.detach().clone() for n, p in be.model.named_parameters()})
    (off, kept_off, gn_off, w_off), (cpu, kept_cpu, _, _), (small, kept_small, gn_small, w_small) = runs.values()
    # the CPU has no finite memory: auto stays off; a 1 MB device cannot hold the pack: on
    assert not cpu.recompute_choice.on and not cpu.model.is_activation_checkpointing and kept_cpu == kept_off
    assert small.recompute_choice.on and small.cfg.recompute is True and small.model.is_activation_checkpointing
    assert small.recompute_choice.without > small.recompute_choice.usable
    # a checkpointed layer keeps its float32 input only: the 4h bytes per token the estimate counts
    assert kept_small == mb.n_tokens * 4 * 96 < kept_off / 10
    assert gn_small == gn_off
    for n, w in w_off.items():
        assert torch.equal(w, w_small[n]), n
