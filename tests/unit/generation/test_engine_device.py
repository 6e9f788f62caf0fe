"""The GPU rule, checked on the CPU: every tensor the engine feeds the model is on the model's device.

On a CPU-only machine every tensor is on the CPU whether or not the code names a device, so a
`torch.tensor(...)` that forgets `device=` passes every CPU test and fails at the first step of
a GPU run. These tests make the model's device differ from where an unplaced tensor lands:
- the engine serves a stand-in model whose parameters are on the "meta" device; its forward
  checks the ids, mask, positions and every KV row it is given (and writes meta KV rows like a
  real layer), and the sampler is replaced (meta logits hold no values to sample from);
- `sample_rows` runs on real CPU logits with meta as the default device, so a tensor made
  without a device lands on meta and the step fails or draws other tokens.
Either fails if a device argument in engine.py, kv_rows.py or sampling.py is removed.
"""
from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch
from transformers import Qwen2Config

from tandem.rollout.server import engine as engine_mod
from tandem.rollout.server.engine import Engine, Request
from tandem.rollout.server.main import DeviceError, resolve_device
from tandem.rollout.server.sampling import SamplingParams, sample_rows

META = torch.device("meta")


class MetaModel(torch.nn.Module):
    """A two-layer decoder's interface on the meta device: checks where its inputs are, writes
    meta keys/values into the cache it is given, returns meta logits."""

    def __init__(self):
        super().__init__()
        self.config = Qwen2Config(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
        self.weight = torch.nn.Parameter(torch.empty(4, device=META))
        self.calls: list[str] = []
        self.violations: list[str] = []

    def _check(self, what: str, t) -> None:
        if isinstance(t, torch.Tensor) and t.device != META:
            self.violations.append(f"{what} on {t.device}")

    def forward(self, input_ids, past_key_values=None, use_cache=True, attention_mask=None, position_ids=None):
        for what, t in (("input_ids", input_ids), ("attention_mask", attention_mask), ("position_ids", position_ids)):
            self._check(what, t)
        self.calls.append("decode" if attention_mask is not None else "prefill")
        cfg = self.config
        rows, steps = input_ids.shape
        head_dim = cfg.hidden_size // cfg.num_attention_heads
        for i in range(cfg.num_hidden_layers):
            new = torch.zeros(rows, cfg.num_key_value_heads, steps, head_dim, device=META)
            keys, values = past_key_values.update(new, new.clone(), i)
            self._check(f"layer {i} keys", keys)
            self._check(f"layer {i} values", values)
        if self.violations:
            raise AssertionError("; ".join(self.violations))
        return SimpleNamespace(logits=torch.zeros(rows, steps, cfg.vocab_size, device=META))


class Tokenizer:
    eos_token_id = 2

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + i % 26) for i in ids)


def test_engine_steps_feed_the_model_only_tensors_on_its_device(monkeypatch):
    sampled: list[torch.device] = []

    def fake_sample(logits, params, generators):
        sampled.append(logits.device)
        return [7] * len(params), [-1.0] * len(params)

    monkeypatch.setattr(engine_mod, "sample_rows", fake_sample)
    model = MetaModel()
    engine = Engine(model, Tokenizer(), model_path="meta", max_running=8)
    done: list[dict] = []
    all_done = threading.Event()

    def on_done(resp):
        done.append(resp)
        if len(done) == 3:
            all_done.set()

    try:
        assert engine.device == META
        # Prompts of different lengths, one pair sharing a prompt (one prefill): rows join,
        # decode together left-padded, and leave at different steps (rows move into holes).
        reqs = [Request(prompt_ids=p, params=SamplingParams(max_new_tokens=n, ignore_eos=True), on_done=on_done)
                for p, n in (([1, 5, 9], 4), ([1, 5, 9], 6), ([1, 4, 4, 4, 4, 4, 8], 3))]
        engine.submit(reqs).result(timeout=10)
        finished = all_done.wait(timeout=20)
    finally:
        engine.stop()
    assert model.violations == []
    assert finished, f"requests did not finish: {done}"
    assert [r["meta_info"]["finish_reason"]["type"] for r in done] == ["length"] * 3, done
    assert "decode" in model.calls and set(sampled) == {META}
    for r in done:   # what goes back to HTTP clients is python, not tensors
        assert all(type(t) is int for t in r["output_ids"])


def test_sampling_makes_its_tensors_on_the_logits_device():
    """Same tokens and log-probs bit for bit with meta as the default device: nothing in
    sample_rows lands where the logits are not (every path: plain, top-k, top-p, greedy)."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 50, generator=gen)
    params = [SamplingParams(), SamplingParams(temperature=0.7), SamplingParams(top_k=5),
              SamplingParams(top_p=0.8), SamplingParams(temperature=0)]

    def run():
        return sample_rows(logits, params, [torch.Generator().manual_seed(i) for i in range(len(params))])

    want = run()
    with torch.device("meta"):
        got = run()
    assert got == want


def test_resolve_device():
    assert resolve_device("cpu", cuda_available=True) == torch.device("cpu")
    assert resolve_device("auto", cuda_available=False) == torch.device("cpu")
    with pytest.raises(DeviceError, match=r"gen\.device=cuda but torch sees no CUDA device"):
        resolve_device("cuda", cuda_available=False)
    with pytest.raises(DeviceError, match=r"gen\.device must be"):
        resolve_device("tpu", cuda_available=False)


def test_config_checks_the_device_value():
    from tandem.rollout.config import GenConfig
    assert GenConfig().device == "auto" and not GenConfig().problems()
    assert [f for f, _ in GenConfig(device="gpu").problems()] == ["device"]


def test_a_failed_prefill_answers_the_requests_it_had_taken(monkeypatch):
    """A prefill that raises (a CUDA out-of-memory, say) fails what it was admitting with an abort
    reply instead of leaving it in neither the waiting nor the running list, unanswered; the
    engine keeps serving the next request."""
    monkeypatch.setattr(engine_mod, "sample_rows", lambda logits, params, gens: ([7] * len(params), [-1.0] * len(params)))
    model = MetaModel()
    boom = {"left": 1}
    forward = model.forward

    def failing_forward(*args, **kwargs):
        if boom["left"]:
            boom["left"] -= 1
            raise RuntimeError("CUDA out of memory (stand-in)")
        return forward(*args, **kwargs)
    model.forward = failing_forward
    engine = Engine(model, Tokenizer(), model_path="meta", max_running=8)
    done: list[dict] = []
    got = threading.Semaphore(0)

    def on_done(resp):
        done.append(resp)
        got.release()

    try:
        same = [Request(prompt_ids=[1, 5, 9], params=SamplingParams(max_new_tokens=3, ignore_eos=True), on_done=on_done)
                for _ in range(2)]          # a group sharing one prefill: both taken at once
        engine.submit(same).result(timeout=10)
        assert got.acquire(timeout=10) and got.acquire(timeout=10), f"unanswered after a failed prefill: {done}"
        assert [r["meta_info"]["finish_reason"]["type"] for r in done] == ["abort", "abort"], done
        assert "CUDA out of memory" in done[0]["meta_info"]["finish_reason"]["message"]
        engine.submit([Request(prompt_ids=[3, 4], params=SamplingParams(max_new_tokens=2, ignore_eos=True),
                               on_done=on_done)]).result(timeout=10)
        assert got.acquire(timeout=10) and done[-1]["meta_info"]["finish_reason"]["type"] == "length", done
    finally:
        engine.stop()
