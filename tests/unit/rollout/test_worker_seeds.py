"""Sample seeds under SGLang's deterministic inference (no processes: the worker's generate
wrapper alone, around a recording function)."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

from tandem.rollout.worker import RolloutWorker


def _worker(deterministic: bool, seed: int = 1) -> RolloutWorker:
    w = RolloutWorker.__new__(RolloutWorker)
    w.cfg = SimpleNamespace(gen=SimpleNamespace(deterministic_inference=deterministic),
                            experiment=SimpleNamespace(seed=seed))
    return w


def _seeds(worker: RolloutWorker, keys: list[str]) -> list:
    sent = []

    async def generate(prompt_ids, params, sticky_key):
        sent.append(params.get("sampling_seed"))
        return sticky_key

    wrapped = worker._seeded(generate)
    for k in keys:
        assert asyncio.run(wrapped([1, 2], {"temperature": 1.0}, k)) == k
    return sent


def test_deterministic_inference_gives_every_sample_of_a_group_its_own_seed():
    """SGLang seeds every unseeded request with 42 under --enable-deterministic-inference: the
    n samples of a group would all be the same sequence, and GRPO would learn nothing."""
    keys = [f"g7/{i}" for i in range(8)]
    seeds = _seeds(_worker(True), keys)
    assert None not in seeds and len(set(seeds)) == len(keys)
    assert _seeds(_worker(True), keys) == seeds                # reproducible
    assert _seeds(_worker(True, seed=2), keys) != seeds        # and tied to the experiment seed


def test_without_deterministic_inference_no_seed_is_sent():
    assert _seeds(_worker(False), ["g1/0", "g1/1"]) == [None, None]
