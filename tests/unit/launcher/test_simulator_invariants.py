"""The simulator's invariants: hand-computed synchronous steps, capacity bounds, scaling, tails.

The simulator models GPUs that do not exist here; these tests check its arithmetic and its
physics-level promises, not any real cluster's speed.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from tandem.launcher.config import ConfigError, load_config
from tandem.launcher.simulate.costs import Costs
from tandem.launcher.simulate.engine import SimSetup, Simulation, SimulationError
from tandem.launcher.simulate.hardware import load_model_shape
from tandem.launcher.simulate.scenario import build, simulate


def _cfg(*overrides):
    base = ["experiment.name=t", "experiment.model=m", "launcher.backend=slurm", "gen.backend=sglang",
            "simulate.model_size=R1-Distill-Qwen-1.5B", "simulate.hardware=H800",
            "launcher.nodes=1", "trainer.groups_per_step=16", "rollout.n_samples=4",
            "rollout.max_new_tokens=4096", "controller.max_concurrent_groups=100000", "rollout.concurrency=100000",
            "simulate.output_median=1024", "simulate.steps=4", "simulate.warmup_steps=2",
            # a micro-batch holds the longest sample of every case below (the config check's rule;
            # the simulator reads the budget only for a pipeline bubble)
            "rollout.max_prompt_tokens=512", "trainer.max_tokens_per_mb=8704"]
    return load_config(None, base + list(overrides))


def _toy_costs(**kw) -> Costs:
    args = dict(decode_fixed=[0.0] + [0.01] * 8, decode_per_ctx=0.0, kv_capacity=math.inf,
                max_running=8, train_fixed=1.0, train_per_token=0.001, train_per_sq=0.0,
                prefill_per_token=0.0001, prefill_per_sq=0.0, publish_s=0.5, load_s=0.25)
    args.update(kw)
    return Costs(**args)


def test_eta0_reproduces_hand_computed_step_times():
    # One server, one group of 2 samples (10 and 20 new tokens, 10-token prompts), 0.01 s/step.
    # Per step: one shared prefill of the prompt 0.003 + 10 x 1e-4 = 0.004; decode 20 steps = 0.2
    # (batch 2, then 1); train 1 + 0.001 x (20 + 30) = 1.05; publish 0.5; load 0.25 (the first
    # step has no load).
    setup = SimSetup(num_servers=1, groups_per_step=1, n_samples=2, eta=0, max_concurrent_groups=10,
                     steps=3, warmup_steps=0, prompt_tokens=10, max_new_tokens=100)
    r = Simulation(setup, _toy_costs(prefill_per_request=0.003), np.array([10, 20] * 10)).run()
    assert r.step_times[1] == pytest.approx(0.004 + 0.2 + 1.05)
    assert np.diff(r.step_times[1:]) == pytest.approx([2.004, 2.004])
    assert r.staleness == {0: 3}
    # A refused rollout worker polls again: half its retry interval passes before admission.
    setup.admit_delay_s = 0.1
    r = Simulation(setup, _toy_costs(prefill_per_request=0.003), np.array([10, 20] * 10)).run()
    assert np.diff(r.step_times[1:]) == pytest.approx([2.104, 2.104])


def _async_toy(wait_for_ack: bool, setup_kw: dict | None = None, result: list | None = None, **costs) -> list[float]:
    """Generation is instant next to training: the step time is the trainer's critical path."""
    setup = SimSetup(num_servers=1, groups_per_step=1, n_samples=1, eta=4, max_concurrent_groups=10,
                     steps=6, warmup_steps=0, prompt_tokens=10, max_new_tokens=100,
                     wait_for_ack=wait_for_ack, checkpoint_every=costs.pop("checkpoint_every", 0), **(setup_kw or {}))
    args = dict(decode_fixed=[0.0] + [1e-6] * 8, prefill_per_token=0.0, train_fixed=1.0, train_per_token=0.0)
    r = Simulation(setup, _toy_costs(**(args | costs)), np.array([5] * 100)).run()
    if result is not None:
        result.append(r)
    return list(np.diff(r.step_times[2:]))


def test_trainer_waits_for_the_servers_load_only_with_wait_for_ack():
    # train 1 + publish 0.5 + load 0.25 when it waits for the ack; train 1 + publish 0.5 when the
    # load overlaps the next step (the load ends before the next publish needs it).
    assert _async_toy(True) == pytest.approx([1.75] * 4)
    assert _async_toy(False) == pytest.approx([1.5] * 4)
    # A load longer than a step holds the next publish back: train 1, then wait for the load of
    # 2.0 that started after the previous publish, then publish 0.5 = 2.5 per step.
    assert _async_toy(False, load_s=2.0) == pytest.approx([2.5] * 4)


def test_coalesced_versions_let_the_trainer_publish_during_a_long_load():
    """Non-interruptible generation with coalesced versions (trainer/announcements.py): a load of
    2.0 s no longer holds the next publish (train 1 + publish 0.5 = 1.5 per step, against 2.5 one
    version at a time), the syncs skip versions, and keep_weights 1 leaves nothing to overlap."""
    coalesce = {"interruptible": False, "coalesce_versions": True}
    runs: list = []
    assert _async_toy(False, {**coalesce, "keep_weights": 3}, runs, load_s=2.0) == pytest.approx([1.5] * 4)
    assert _async_toy(False, {**coalesce, "keep_weights": 1}, runs, load_s=2.0) == pytest.approx([2.5] * 4)
    assert runs[0].syncs_per_step < runs[1].syncs_per_step     # versions skipped
    # keep_weights 2: before publishing v the sync of v - 1 must have begun (v - 2 may be pruned)
    between = _async_toy(False, {**coalesce, "keep_weights": 2}, runs, load_s=2.0)
    assert all(1.5 - 1e-9 <= dt <= 2.5 + 1e-9 for dt in between) and sum(between) < 2.5 * 4


def test_checkpoints_cost_the_trainer_every_nth_step():
    # checkpoint_every=2: versions 2 and 4 add 0.3 s after their publish, so steps 3 and 5
    # (the first and third intervals measured) end 0.3 s later.
    assert _async_toy(False, checkpoint_every=2, checkpoint_s=0.3) == pytest.approx([1.8, 1.5, 1.8, 1.5])


def test_interrupted_requests_pay_a_prefill_call_each():
    # eta 1, one server, 4 single-sample groups of 1000 tokens at 0.01 s/step: every publish
    # interrupts the running requests, each re-prefilling prompt + partial output as its own call.
    setup = SimSetup(num_servers=1, groups_per_step=1, n_samples=1, eta=1, max_concurrent_groups=10,
                     steps=4, warmup_steps=0, prompt_tokens=10, max_new_tokens=1000)
    base = dict(train_fixed=0.1, train_per_token=0.0, prefill_per_token=0.0)
    quick = Simulation(setup, _toy_costs(**base), np.array([1000] * 20)).run()
    slow = Simulation(setup, _toy_costs(**base, prefill_per_request=0.5), np.array([1000] * 20)).run()
    assert slow.interrupts == quick.interrupts > 0
    # Every interrupted request and every fresh group pays 0.5 s more, on the critical path.
    assert slow.step_times[-1] - quick.step_times[-1] >= 0.5 * slow.interrupts


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
    # + the mean wait of a rollout worker polling for admission after the new version.
    assert np.diff(r.step_times[1:]) == pytest.approx([c.prefill_s(p) + decode + train + c.publish_s
                                                       + c.load_s + sc.setup.admit_delay_s] * 2, rel=1e-9)
    assert sc.setup.admit_delay_s == cfg.controller.retry_after_s / 2
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
    ["controller.max_staleness=8", "controller.interruptible=false", "gen.max_running_requests=16"],
])
def test_throughput_never_exceeds_either_pools_capacity(overrides):
    sc, r = simulate(_cfg(*overrides))
    k = sc.shrink  # the slice's capacities, scaled like its rates
    gen_cap = k * sc.setup.num_servers * sc.costs.gen_capacity_tokens_s(sc.setup.prompt_tokens)
    assert 0 < r.gen_tokens_per_s <= gen_cap
    assert 0 < r.trained_tokens_per_s <= k * sc.costs.train_capacity_tokens_s()
    assert 0 < r.gen_utilization <= 1 and 0 < r.train_utilization <= 1


@pytest.mark.parametrize("eta", [0, 4])
def test_a_shrunk_cluster_predicts_what_the_whole_one_does(eta):
    # 4 nodes at 3:1 = 24 servers, 256 groups x 8 = 2,048 samples per step: a quarter of it,
    # asked for, against the whole.
    common = ["launcher.nodes=4", "trainer.groups_per_step=256", "rollout.n_samples=8",
              f"controller.max_staleness={eta}", "simulate.steps=4"]
    whole_sc, whole = simulate(_cfg(*common, "simulate.shrink=1"))
    part_sc, part = simulate(_cfg(*common, "simulate.shrink=4"))
    assert (whole_sc.shrink, part_sc.shrink, part_sc.setup.num_servers) == (1, 4, 6)
    assert part.steps_per_hour == pytest.approx(whole.steps_per_hour, rel=0.05)
    assert part.trajectories_per_s == pytest.approx(whole.trajectories_per_s, rel=0.05)
    assert part.gen_utilization == pytest.approx(whole.gen_utilization, abs=0.05)
    with pytest.raises(ConfigError, match="simulate.shrink=3 must divide"):
        simulate(_cfg(*common, "simulate.shrink=3"))
    # auto: the largest k leaving >= 4 servers and >= 1,024 samples per step
    assert simulate(_cfg(*common))[0].shrink == 2
    assert simulate(_cfg(*common, "trainer.groups_per_step=128"))[0].shrink == 1


def test_doubling_all_gpus_roughly_doubles_throughput():
    # Saturated servers (a concurrency cap, and eta 8 keeps enough groups in flight for both
    # sizes), a broadcast weight sync and a trainer that does not wait for the servers' loads,
    # so neither the batch nor the weight sync binds.
    common = ["controller.max_staleness=8", "gen.max_running_requests=16",
              "simulate.output_lengths=fixed", "trainer.weight_sync=broadcast", "trainer.wait_for_ack=false",
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
    cfg.controller.interruptible = False
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
        simulate(_cfg("rollout.max_new_tokens=10000000", "trainer.max_tokens_per_mb=10000512"))


def test_chunks_bound_a_drain_to_one_chunk():
    """rollout.new_tokens_per_chunk with non-interruptible generation: a weight update waits for
    the current chunk of each running request, not its whole answer. One server, eta 1, single-
    sample groups of 100 and 1,000 tokens at 0.01 s per decode step: the first update (train
    1.11 + publish 0.5 after the short answer's 1.0 s) finds the long answer 261 steps in; whole,
    it holds the update until it ends (7.39 s later; later updates wait longer still); in chunks
    of 100 tokens the server loads at the next boundary, at most 100 steps = 1.0 s later, and the
    long answer goes on from there."""
    setup = SimSetup(num_servers=1, groups_per_step=1, n_samples=1, eta=1, max_concurrent_groups=10,
                     steps=4, warmup_steps=0, prompt_tokens=10, max_new_tokens=1000, interruptible=False)
    lengths = np.array([100, 1000] * 20)
    whole = Simulation(setup, _toy_costs(), lengths).run()
    setup.chunk_tokens = 100
    chunked = Simulation(setup, _toy_costs(), lengths).run()
    assert whole.longest_drain_s > 7.0 and whole.chunk_resumes == 0
    assert 0.0 < chunked.longest_drain_s <= 100 * 0.01 + 1e-9
    assert chunked.chunk_resumes > 0
    assert chunked.step_times[-1] < whole.step_times[-1]


@pytest.mark.parametrize("cached", [True, False])
def test_each_chunk_boundary_pays_one_resubmission(cached):
    """Each chunk after the first is one more request: with its prefix in the radix cache it
    costs a scheduling round (one forward pass, 0.01 s here) and a prefill call of its one
    uncached token (0.003 + 1e-4); without, a prefill of prompt + output so far. One 1,000-token
    answer in chunks of 300 (boundaries at 300, 600, 900: three resubmissions), eta 0:
    prompt prefill 0.003 + 10 x 1e-4, decode 1,000 x 0.01, train 1 + 0.001 x 1,010, plus
      cached:   3 x (0.01 + 0.003 + 1e-4)                   = 0.0393
      uncached: 3 x 0.003 + 1e-4 x (310 + 610 + 910)       = 0.192"""
    setup = SimSetup(num_servers=1, groups_per_step=1, n_samples=1, eta=0, max_concurrent_groups=10,
                     steps=1, warmup_steps=0, prompt_tokens=10, max_new_tokens=1000, chunk_tokens=300,
                     chunk_prefix_cached=cached)
    r = Simulation(setup, _toy_costs(prefill_per_request=0.003), np.array([1000] * 4)).run()
    resubmissions = 0.0393 if cached else 0.192
    assert r.chunk_resumes == 3
    assert r.step_times[1] == pytest.approx(0.004 + 10.0 + 2.01 + resubmissions)


def test_a_drain_waits_for_queued_requests_submitted_before_it():
    """Non-interruptible: a weight update waits for every request its server already holds,
    queued ones included (SGLang's update takes the model-update lock as a writer after every
    request holding it as a reader; the embedded server's `when_idle` waits for running and
    waiting requests alike). One server running 2 requests at a time, eta 3, four 4-sample groups
    of 100-token answers at 0.01 s a step (1 s each, two at a time): group 0 ends at 2 s, its
    step (train 1 + 0.001 x 440, publish 0.5) publishes at 3.94 s, when group 1's last two run
    and groups 2 and 3 (eight requests) wait behind them: the load waits until they end at 8 s,
    a drain of 4.06 s (counting only the running ones, it would be 0.06 s)."""
    setup = SimSetup(num_servers=1, groups_per_step=1, n_samples=4, eta=3, max_concurrent_groups=4,
                     steps=2, warmup_steps=0, prompt_tokens=10, max_new_tokens=100, interruptible=False)
    costs = _toy_costs(max_running=2, prefill_per_token=0.0)
    r = Simulation(setup, costs, np.full(200, 100)).run()
    assert r.longest_drain_s == pytest.approx(4.06, abs=1e-6)
