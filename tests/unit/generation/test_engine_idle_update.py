"""A weight update that waits for the engine to be idle (`controller.interruptible: false`) runs
the moment the last request ends.

The engine thread sleeps (up to half a second) when it has nothing to do; an update registered
while requests run used to wait for that sleep's timeout after they finished, so every drained
non-interruptible update cost up to half a second more than the drain (in the async_vs_sync
benchmark the trainer waited for it at about half the steps). The test counts the engine's sleeps taken
while such an update is ready to run; the sampler is replaced (it holds the first decode step
until the update is registered, then emits a fixed token) so the order is certain.
"""
from __future__ import annotations

import threading

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from tandem.rollout.server import engine as engine_mod
from tandem.rollout.server.engine import Engine, Request
from tandem.rollout.server.sampling import SamplingParams


class Tokenizer:
    eos_token_id = 2

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + i % 26) for i in ids)


def test_an_update_waiting_for_idle_runs_when_the_last_request_ends(monkeypatch):
    decoding, release = threading.Event(), threading.Event()

    def held_sampler(logits, params, generators):
        decoding.set()
        release.wait(timeout=10)
        return [7] * len(params), [-1.0] * len(params)

    monkeypatch.setattr(engine_mod, "sample_rows", held_sampler)
    watched: dict = {}
    sleeps_with_update_ready: list[float | None] = []

    class WatchedCondition(threading.Condition):
        def wait(self, timeout=None):
            engine = watched.get("engine")
            if (engine is not None and self is engine._wake and engine._pending_idle is not None
                    and not (engine.running or engine.waiting)):
                sleeps_with_update_ready.append(timeout)
            return super().wait(timeout)

    monkeypatch.setattr(engine_mod.threading, "Condition", WatchedCondition)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128))
    engine = Engine(model, Tokenizer(), model_path="tiny", max_running=4)
    watched["engine"] = engine
    order: list[str] = []
    try:
        request = Request(prompt_ids=[1, 5, 9], params=SamplingParams(max_new_tokens=3, ignore_eos=True),
                          on_done=lambda resp: order.append("request done"))
        engine.submit([request]).result(timeout=10)
        assert decoding.wait(timeout=10), "the request never reached a decode step"
        update = engine.when_idle(lambda: order.append("update"))   # registered while it decodes
        release.set()
        update.result(timeout=10)
    finally:
        release.set()
        engine.stop()
    assert order == ["request done", "update"]
    assert request.finish["type"] == "length" and len(request.output_ids) == 3
    assert sleeps_with_update_ready == [], "the engine slept while a ready update waited for it"
