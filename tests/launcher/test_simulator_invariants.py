"""The simulator's invariants: hand-computed synchronous steps, capacity bounds, scaling, tails.

The simulator models GPUs that do not exist here; these tests check its arithmetic and its
physics-level promises, not any real cluster's speed.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from launcher.config import ConfigError, load_config
from launcher.simulate.costs import Costs
from launcher.simulate.engine import SimSetup, Simulation, SimulationError
from launcher.simulate.hardware import load_model_shape
from launcher.simulate.scenario import build, simulate


def _cfg(*overrides):
    base = ["experiment.name=t", "experiment.model=m", "launcher.backend=slurm", "gen.backend=sglang",
            "simulate.model_size=R1-Distill-Qwen-1.5B", "simulate.hardware=H800",
            "launcher.nodes=1", "trainer.groups_per_step=16", "rollout.n_samples=4",
            "rollout.max_new_tokens=4096", "controller.max_concurrent_groups=100000",
            "simulate.output_median=1024", "simulate.steps=4", "simulate.warmup_steps=2"]
    return load_config(None, base + list(overrides))


def _toy_costs(**kw) -> Costs:
    args = dict(decode_fixed=[0.0] + [0.01] * 8, decode_per_ctx=0.0, kv_capacity=math.inf,
                max_running=8, train_fixed=1.0, train_per_token=0.001, train_per_sq=0.0,
                prefill_per_token=0.0001, prefill_per_sq=0.0, publish_s=0.5, load_s=0.25)
    args.update(kw)
    return Costs(**args)


def test_eta0_reproduces_hand_computed_step_times():
    # One server, one group of 2 samples (10 and 20 new tokens, 10-token prompts), 0.01 s/step.
    # Per step: prefill 2 x 10 x 1e-4 = 0.002; decode 20 steps = 0.2 (batch 2, then 1);
    # train 1 + 0.001 x (20 + 30) = 1.05; publish 0.5; load 0.25 (the first step has no load).
    setup = SimSetup(num_servers=1, groups_per_step=1, n_samples=2, eta=0, max_concurrent_groups=10,
                     steps=3, warmup_steps=0, prompt_tokens=10, max_new_tokens=100)
    r = Simulation(setup, _toy_costs(), np.array([10, 20] * 10)).run()
    assert r.step_times[1] == pytest.approx(0.002 + 0.2 + 1.05)
    assert np.diff(r.step_times[1:]) == pytest.approx([2.002, 2.002])
    assert r.staleness == {0: 3}


def test_decode_cost_grows_with_context_as_summed_by_hand():
    # 5 steps over contexts 10..14 at 0.01 + 0.001 x context: 0.05 + 0.001 x 60 = 0.11 s.
    setup = SimSetup(num_servers=1, groups_per_step=1, n_samples=1, eta=0, max_concurrent_groups=1,
                     steps=1, warmup_steps=0, prompt_tokens=10, max_new_tokens=100)
    costs = _toy_costs(decode_per_ctx=0.001, prefill_per_token=0.0, train_fixed=0.0, train_per_token=0.0)
    r = Simulation(setup, costs, np.array([5] * 4)).run()
    assert r.step_times[1] == pytest.approx(0.11)


def test_eta0_physical_model_matches_its_formula():
    # 1 node at 1:1: 4 servers (TP 1), 4 groups x 1 sample, all 1000 tokens: each server decodes
    # one request; a step = prefill + 1000 decode steps + train + publish + load.
    cfg = _cfg("launcher.gen_train_ratio='1:1'", "trainer.groups_per_step=4", "rollout.n_samples=1",
               "controller.max_staleness=0", "simulate.output_lengths=fixed",
               "simulate.output_median=1000", "simulate.steps=2", "simulate.warmup_steps=1")
    sc, r = simulate(cfg)
    c, p, L = sc.costs, 512, 1000
    decode = L * (c.decode_fixed[1] + c.decode_per_ctx * p) + c.decode_per_ctx * L * (L - 1) / 2
    train = c.train_step_s(4 * (p + L), 4 * (p + L) ** 2)
    assert np.diff(r.step_times[1:]) == pytest.approx([c.prefill_s(p) + decode + train + c.publish_s
                                                       + c.load_s] * 2, rel=1e-9)
    # And the roofline itself: batch-1 decode of 1.78B BF16 params is a weight read at 70% of
    # 3.35 TB/s plus the 3 ms step overhead.
    shape = load_model_shape("R1-Distill-Qwen-1.5B")
    assert c.decode_fixed[1] == pytest.approx(2 * shape.params / (3.35e12 * 0.7) + 0.003)


@pytest.mark.parametrize("name, published_b", [("Qwen2.5-1.5B", 1.54), ("R1-Distill-Qwen-1.5B", 1.78),
                                               ("Qwen2.5-7B", 7.61), ("Qwen2.5-14B", 14.7),
                                               ("Qwen2.5-32B", 32.5)])
def test_model_shapes_give_the_published_parameter_counts(name, published_b):
    assert load_model_shape(name).params / 1e9 == pytest.approx(published_b, rel=0.01)


@pytest.mark.parametrize("overrides", [
    ["controller.max_staleness=0"],
    ["controller.max_staleness=4"],
    ["controller.max_staleness=2", "launcher.gen_train_ratio='1:1'", "simulate.output_sigma=1.5"],
    ["controller.max_staleness=8", "simulate.interruptible=false", "gen.max_running_requests=16"],
])
def test_throughput_never_exceeds_either_pools_capacity(overrides):
    sc, r = simulate(_cfg(*overrides))
    gen_cap = sc.setup.num_servers * sc.costs.gen_capacity_tokens_s(sc.setup.prompt_tokens)
    assert 0 < r.gen_tokens_per_s <= gen_cap
    assert 0 < r.trained_tokens_per_s <= sc.costs.train_capacity_tokens_s()
    assert 0 < r.gen_utilization <= 1 and 0 < r.train_utilization <= 1


def test_doubling_all_gpus_roughly_doubles_throughput():
    # Saturated servers (a concurrency cap, and eta 8 keeps enough groups in flight for both
    # sizes) and a broadcast weight sync, so neither the batch nor the filesystem binds.
    common = ["controller.max_staleness=8", "gen.max_running_requests=16",
              "simulate.output_lengths=fixed", "trainer.weight_sync=broadcast",
              "trainer.groups_per_step=32", "simulate.steps=5"]
    _, one = simulate(_cfg("launcher.nodes=2", *common))
    _, two = simulate(_cfg("launcher.nodes=4", *common))
    assert 1.75 < two.steps_per_hour / one.steps_per_hour < 2.25


def _async_over_sync(sigma: float) -> float:
    rates = []
    for eta in (0, 4):
        _, r = simulate(_cfg(f"controller.max_staleness={eta}", f"simulate.output_sigma={sigma}",
                             "rollout.max_new_tokens=8192", "simulate.output_median=512"))
        rates.append(r.steps_per_hour)
    return rates[1] / rates[0]


def test_longer_tails_widen_the_async_sync_gap():
    short, long = _async_over_sync(0.2), _async_over_sync(1.4)
    assert long > short > 1.0


def test_interruptible_generation_helps_async_with_long_tails():
    cfg = _cfg("controller.max_staleness=4", "simulate.output_sigma=1.4", "rollout.max_new_tokens=8192",
               "simulate.output_median=512")
    _, inter = simulate(cfg)
    cfg.simulate.interruptible = False
    _, drain = simulate(cfg)
    assert inter.steps_per_hour > drain.steps_per_hour
    assert inter.interrupts > 0 and drain.interrupts == 0


def test_colocated_needs_eta0_and_uses_every_gpu():
    with pytest.raises(ConfigError, match="colocated=true needs controller.max_staleness=0"):
        build(_cfg("simulate.colocated=true", "controller.max_staleness=2"))
    sc, r = simulate(_cfg("simulate.colocated=true", "controller.max_staleness=0"))
    assert sc.setup.num_servers == 8 and sc.layout.train_gpus == 8
    assert r.staleness.keys() == {0}


def test_model_too_big_for_a_server_is_a_clear_error():
    with pytest.raises(ConfigError, match="does not fit in a generation server"):
        build(_cfg("simulate.model_size=R1-Distill-Qwen-32B", "gen.mem_fraction_static=0.5"))
    with pytest.raises(SimulationError, match="does not fit one server's KV cache"):
        simulate(_cfg("rollout.max_new_tokens=10000000"))
