"""Megatron-core backend across processes: TP=2 parity and round trips, pipeline and data
parallel, dist-checkpoint resharding, and a job SIGKILLed mid-step and resumed.

Real megatron-core 0.16.1 on CPU (gloo); every case is a real 2-process torch.distributed job.
"""
from __future__ import annotations

import signal
import time
from pathlib import Path

import megatron_case as mc
import pytest
import torch
from rank_processes import reap, start_ranks, tails

from tandem.trainer.backend import PackedBatch

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return mc.make_model_dir(tmp_path_factory.mktemp("qwen2-tied"))


@pytest.fixture(scope="module")
def backend(model_dir):
    yield from mc.in_process_backend(model_dir)


@pytest.fixture
def fresh(backend):
    """The backend, restored to its initial weights and optimizer after the test."""
    state = backend.state_dict()
    yield backend
    backend.load_state_dict(state)


def _hf_model(path: Path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _seq(mb: PackedBatch, s: int) -> PackedBatch:
    a, b = mb.cu_seqlens[s].item(), mb.cu_seqlens[s + 1].item()
    return PackedBatch(mb.input_ids[a:b], torch.arange(b - a), torch.tensor([0, b - a], dtype=torch.int32))


# ---- the 2-process TP=2 job -------------------------------------------------------------------
def _launch(mode: str, model_dir: Path, out: Path) -> tuple[list, list[Path]]:
    return start_ranks(["-m", "megatron_mp_worker", mode, str(model_dir), str(out)], out, mode)


@pytest.fixture(scope="module")
def tp2_job(model_dir, tmp_path_factory):
    """Run `train` (killed with SIGKILL inside step 3), then `resume`; return the outputs."""
    out = tmp_path_factory.mktemp("tp2")
    procs, logs = _launch("train", model_dir, out)
    try:
        deadline = time.monotonic() + 180
        while not all((out / f"in_step3.rank{r}").exists() for r in range(2)):
            if any(p.poll() is not None for p in procs):
                pytest.fail("TP=2 train job exited early:\n" + tails(logs))
            if time.monotonic() > deadline:
                pytest.fail("TP=2 train job did not reach step 3:\n" + tails(logs))
            time.sleep(0.2)
    finally:
        reap(procs)
    assert all(p.returncode == -signal.SIGKILL for p in procs)
    procs, logs = _launch("resume", model_dir, out)
    try:
        for p in procs:
            p.wait(timeout=180)
    finally:
        reap(procs)
    assert all(p.returncode == 0 for p in procs), tails(logs)
    return {"dir": out, "train": torch.load(out / "train.pt", weights_only=False),
            "resume": torch.load(out / "resume.pt", weights_only=False)}


def test_tp2_round_trip_is_exact(tp2_job):
    train = tp2_job["train"]
    assert train["tp_size"] == 2 and train["dp_size"] == 1
    assert train["roundtrip_keys_equal"] and train["roundtrip_exact"]


def test_tp2_gives_the_same_loss_as_tp1(fresh, tp2_job):
    train = tp2_job["train"]
    mbs = mc.micro_batches()
    torch.testing.assert_close(mc.logps(fresh, mbs), train["logp_initial"], atol=2e-5, rtol=1e-5)
    r = fresh.train_step(mbs, mc.make_loss_fn(mc.n_valid(mbs)), 1.0)
    assert r.stats["valid"] == train["step1"]["stats"]["valid"]
    assert r.stats["loss"] == pytest.approx(train["step1"]["stats"]["loss"], rel=1e-5, abs=1e-6)
    assert r.grad_norm == pytest.approx(train["step1"]["grad_norm"], rel=1e-5)
    assert r.lr == train["step1"]["lr"]
    torch.testing.assert_close(mc.logps(fresh, mbs), train["logp_step1"], atol=1e-4, rtol=1e-4)


def test_tp2_export_loads_in_transformers(tp2_job):
    """The HF directory written by the TP=2 job (shards gathered by collectives) is the model."""
    hf = _hf_model(tp2_job["dir"] / "hf_step1")
    train = tp2_job["train"]
    mb = mc.micro_batches()[0]
    from tandem.trainer.logprobs import token_logprobs
    refs = []
    for s in range(mb.n_seqs):
        one = _seq(mb, s)
        with torch.no_grad():
            logits = hf(input_ids=one.input_ids[None]).logits[0]
        refs.append(token_logprobs(logits, one.input_ids, one.cu_seqlens, 1.0, False).logp)
    torch.testing.assert_close(torch.cat(refs), train["logp_step1"][: mb.n_tokens], atol=2e-5, rtol=1e-5)


def test_resume_after_sigkill_is_identical(tp2_job):
    train, resume = tp2_job["train"], tp2_job["resume"]
    assert resume["step2"] == train["step2"]  # grad norm, lr and loss stats, bit for bit
    assert torch.equal(resume["logp_step2"], train["logp_step2"])
    assert sorted(resume["params_step2"]) == sorted(train["params_step2"])
    for k, v in train["params_step2"].items():
        assert torch.equal(resume["params_step2"][k], v), k


def test_dist_checkpoint_reshards_tp2_into_tp1(fresh, tp2_job):
    """The TP=2 checkpoint (after step 1) loads into this TP=1 model: same weights, same next step."""
    fresh.load_checkpoint(tp2_job["dir"] / "ckpt")
    train = tp2_job["train"]
    mbs = mc.micro_batches()
    torch.testing.assert_close(mc.logps(fresh, mbs), train["logp_step1"], atol=2e-5, rtol=1e-5)
    assert fresh.updates == 1
    r = fresh.train_step(mbs, mc.make_loss_fn(mc.n_valid(mbs)), 1.0)
    assert r.grad_norm == pytest.approx(train["step2"]["grad_norm"], rel=1e-4)
    assert r.lr == train["step2"]["lr"]


def test_data_parallel_sums_to_the_single_rank_step(fresh, tp2_job):
    """TP=1 x DP=2 (one micro-batch per rank) takes the same step as one rank with both."""
    dp = tp2_job["resume"]["dp"]
    assert (dp["tp_size"], dp["dp_size"]) == (1, 2)
    mbs = mc.micro_batches()
    r = fresh.train_step(mbs, mc.make_loss_fn(mc.n_valid(mbs)), 1.0)
    assert dp["valid"] == r.stats["valid"]
    assert dp["loss"] == pytest.approx(r.stats["loss"], rel=1e-5, abs=1e-6)
    assert dp["grad_norm"] == pytest.approx(r.grad_norm, rel=1e-5)
    torch.testing.assert_close(dp["logp"], mc.logps(fresh, mbs), atol=1e-4, rtol=1e-4)


def test_pipeline_parallel_matches(tp2_job):
    """PP=2 (real send/recv between two processes, tied embedding split over the stages):
    exact HF round trip, same log-probs, same loss and gradient norm, same updated model."""
    pp, train = tp2_job["resume"]["pp"], tp2_job["train"]
    assert pp["pp_size"] == 2 and pp["first_stage"]
    assert pp["roundtrip_exact"]
    torch.testing.assert_close(pp["logp_initial"], train["logp_initial"], atol=2e-5, rtol=1e-5)
    assert pp["valid"] == train["step1"]["stats"]["valid"]
    assert pp["loss"] == pytest.approx(train["step1"]["stats"]["loss"], rel=1e-5, abs=1e-6)
    assert pp["grad_norm"] == pytest.approx(train["step1"]["grad_norm"], rel=1e-5)
    torch.testing.assert_close(pp["logp_step1"], train["logp_step1"], atol=1e-4, rtol=1e-4)
