"""Expert parallelism on the CPU: a tiny Qwen3-MoE at EP=2 in a real 2-process job (gloo) takes the
step one rank takes at EP=1 on the same micro-batches; so does TP=2.

At EP=2 the two ranks are also data-parallel (megatron-core carves expert parallelism out of data
parallelism): each packs its own micro-batches, routes its own tokens, and megatron-core's
all-to-all dispatcher (`all_to_all_single` with uneven splits, which gloo has) sends them to the
rank holding their experts and back. Rank 1 holds an empty micro-batch: it must still run a
forward for its peer's all-to-all (moe_step.py's phantom), or the job hangs. What must come out
the same as one rank's: log-probs, the summed loss, every gradient (dense ones summed over the two
ranks, each expert's on the rank that holds it), the gradient norm, the routing metrics and the
weights after the update, with the router losses on (their scale is the minibatch's token count
over both ranks; the unit tier checks their gradient against a reference). The job's dist checkpoint exports, in one process, to the same weights.

At TP=2 (no sequence parallelism) both ranks route all tokens and each holds half of every expert:
megatron-core's dispatcher gathers both ranks' (identical) tokens for each expert shard and
reduce-scatters the partial outputs, and its router losses, written for sequence parallelism,
count each rank's share as 1/TP, which moe.py compensates: the router's gradient, the loss, the
gradient norm and the weights after the update must be the single rank's.
"""
from __future__ import annotations

from pathlib import Path

import megatron_case as mc
import megatron_moe_case as mm
import pytest
import torch
from rank_processes import rank_errors, reap, start_ranks

pytestmark = pytest.mark.timeout(300)

AUX = 0.05   # load-balancing and z-loss coefficients of the second job (large, so they show)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> Path:
    return mm.make_moe_dir(tmp_path_factory.mktemp("qwen3moe"))


def _job(moe_dir: Path, out: Path, aux: float, layout: str = "ep2") -> list[dict]:
    procs, logs = start_ranks(["-m", "moe_parallel_worker", str(moe_dir), str(out), str(aux), layout], out, layout)
    try:
        errors = rank_errors(procs, logs, timeout_s=240)
    finally:
        reap(procs)   # dist_checkpointing's writer processes, if any outlived their rank
    assert not errors, "\n----\n".join(errors)
    return [torch.load(out / f"ep2.rank{r}.pt", weights_only=False) for r in range(2)]


def _single_rank(moe_dir: Path, aux: float) -> dict:
    """The EP=1 step on both ranks' micro-batches, in this process."""
    everything = mm.ep2_micro_batches()
    mbs = [mb for rank in everything for mb in rank]
    gen = mc.in_process_backend(moe_dir, cfg=mm.moe_trainer_cfg(ep=1, aux=aux, z=aux))
    be = next(gen)
    try:
        logp = [be.forward_logprobs(mb, 1.0).logp for mb in mbs]
        r = be.train_step(mbs, mc.make_loss_fn(mc.n_valid(mbs)), 1.0)
        return {"logp": logp, "loss": r.stats["loss"], "grad_norm": r.grad_norm, "metrics": be.step_metrics(),
                "grads": {n: p.grad.clone() for n, p in be._module().named_parameters() if p.grad is not None},
                "hf_step1": be.hf_state()}
    finally:
        next(gen, None)


def _global_expert_name(name: str, ep_rank: int, per_rank: int = mm.EXPERTS // 2) -> str:
    from tandem.trainer.megatron import convert_moe
    e = convert_moe.expert_index(name)
    return name if e is None else name.replace(f"local_experts.{e}.", f"local_experts.{ep_rank * per_rank + e}.")


def test_ep2_step_equals_the_ep1_step(moe_dir, tmp_path, aux=AUX):
    ranks = _job(moe_dir, tmp_path, aux)
    one = _single_rank(moe_dir, aux)
    assert [r["ep_size"] for r in ranks] == [2, 2] and [r["ep_rank"] for r in ranks] == [0, 1]
    assert all(r["roundtrip_exact"] for r in ranks)
    # log-probs: rank 0's two packs, rank 1's pack and its empty one
    got = ranks[0]["logp_initial"] + ranks[1]["logp_initial"]
    assert [len(g) for g in got] == [len(w) for w in one["logp"]] and len(got[-1]) == 0
    torch.testing.assert_close(torch.cat(got), torch.cat(one["logp"]), atol=2e-5, rtol=1e-5)
    assert ranks[0]["loss"] + ranks[1]["loss"] == pytest.approx(one["loss"], rel=1e-5, abs=1e-7)
    for r in ranks:
        assert r["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-5)
        for name, g in r["grads"].items():
            torch.testing.assert_close(g, one["grads"][_global_expert_name(name, r["ep_rank"])],
                                       atol=1e-6, rtol=1e-5, msg=name)
        assert len(r["grads"]) == len(one["grads"]) - 2 * 2 * 2   # 2 layers x 2 experts x (fc1, fc2) elsewhere
        assert r["metrics"] == pytest.approx(one["metrics"], rel=1e-9)
        # After the AdamW update: an element whose gradient is near zero moves by up to lr times a
        # ratio of two tiny numbers, so the gradients' float32 differences (1e-9 here) can show as
        # 1e-5 there; the TP=2 test compares its step-1 log-probs to 1e-4 for the same reason.
        assert sorted(r["hf_step1"]) == sorted(one["hf_step1"])
        for k, v in one["hf_step1"].items():
            torch.testing.assert_close(r["hf_step1"][k], v, atol=1e-4, rtol=1e-4, msg=k)
    assert one["metrics"]["moe_dropped_fraction"] == 0.0 and one["metrics"]["moe_load_max"] > 1.0
    # the checkpoint of the EP=2 job, resharded into one process, as tandem export reads it
    from tandem.trainer.megatron.export import hf_state_from_dist

    state = hf_state_from_dist(tmp_path / "dist", moe_dir)
    assert sorted(state) == sorted(ranks[0]["hf_step1"])
    for k, v in ranks[0]["hf_step1"].items():
        assert torch.equal(state[k], v), k


def test_tp2_step_equals_the_single_rank_step(moe_dir, tmp_path):
    from tandem.trainer.megatron import convert

    ranks = _job(moe_dir, tmp_path, AUX, "tp2")
    one = _single_rank(moe_dir, AUX)
    assert [r["tp_size"] for r in ranks] == [2, 2] and all(r["roundtrip_exact"] for r in ranks)
    torch.testing.assert_close(torch.cat(ranks[0]["logp_initial"]), torch.cat(one["logp"]), atol=2e-5, rtol=1e-5)
    assert ranks[0]["loss"] == pytest.approx(one["loss"], rel=1e-5, abs=1e-7) and ranks[1]["loss"] == 0.0   # counted once
    for r in ranks:
        assert r["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-5)
        replicated = {n: g for n, g in r["grads"].items() if convert.tp_layout(n)[0] is None}
        assert {f"decoder.layers.{i}.mlp.router.weight" for i in range(2)} <= replicated.keys()
        for name, g in replicated.items():
            torch.testing.assert_close(g, one["grads"][name], atol=1e-6, rtol=1e-5, msg=name)
        assert r["metrics"] == pytest.approx(one["metrics"], rel=1e-9)
        for k, v in one["hf_step1"].items():   # (the AdamW tolerance of the EP test)
            torch.testing.assert_close(r["hf_step1"][k], v, atol=1e-4, rtol=1e-4, msg=k)


def test_pp2_step_equals_the_single_rank_step(moe_dir, tmp_path):
    """PP=2: each stage holds one MoE layer (its router and experts); the micro-batches pass
    between the stages by send/recv. Exact HF round trip, the single rank's log-probs, loss,
    gradient norm and routing metrics (each layer's counted on its stage, gathered over the
    world), and the same updated model."""
    ranks = _job(moe_dir, tmp_path, AUX, "pp2")
    one = _single_rank(moe_dir, AUX)
    assert [r["pp_size"] for r in ranks] == [2, 2] and all(r["roundtrip_exact"] for r in ranks)
    torch.testing.assert_close(torch.cat(ranks[0]["logp_initial"]), torch.cat(one["logp"]), atol=2e-5, rtol=1e-5)
    assert ranks[1]["loss"] == pytest.approx(one["loss"], rel=1e-5, abs=1e-7)   # the last stage's
    for r in ranks:
        assert r["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-5)
        assert r["metrics"] == pytest.approx(one["metrics"], rel=1e-9)
        for k, v in one["hf_step1"].items():
            torch.testing.assert_close(r["hf_step1"][k], v, atol=1e-4, rtol=1e-4, msg=k)
