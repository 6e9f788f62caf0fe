"""Cluster simulator: its own speed (events/s, a 5x5 sweep on the paper's 16-node shape) and its
predictions for the AReaL paper's published comparisons, made from datasheet numbers only.

The predictions are NOT fitted to the paper: the inputs are the H800 datasheet, the models'
config.json shapes, the batch shape the paper states, and the simulator's default assumptions
(efficiencies, output-length distribution) that were fixed before any comparison was run.
"""
from __future__ import annotations

if not __package__:  # `python benchmarks/NAME.py`: see benchmarks/script_path.py
    import script_path  # noqa: F401

import time

from benchmarks.common import cli, keep_tables, print_table, read_results, write_results
from tandem.launcher.config import load_config
from tandem.launcher.simulate.elastic import predict, replay
from tandem.launcher.simulate.engine import Simulation
from tandem.launcher.simulate.scenario import build, lengths_for, simulate, sweep, with_overrides

# The paper's math setting: 512 prompts x 16 answers per step, 32K-token answers, 3:1 split on
# H800 nodes, SGLang servers with TP 1, four PPO minibatches, disk weight updates.
PAPER = ["experiment.name=areal-shape", "experiment.model=none", "launcher.backend=slurm",
         "launcher.gpus_per_node=8", "launcher.gen_train_ratio=3:1", "gen.backend=sglang",
         "gen.tp_size=1", "gen.max_running_requests=512", "gen.mem_fraction_static=0.85",
         "rollout.n_samples=16", "rollout.max_new_tokens=32768", "trainer.groups_per_step=512",
         "trainer.ppo_n_minibatches=4", "rollout.max_prompt_tokens=512", "trainer.max_tokens_per_mb=33280",
         "controller.max_concurrent_groups=100000", "rollout.concurrency=100000",
         # AReaL's trainer goes on while the servers load new weights.
         "trainer.wait_for_ack=false", "simulate.hardware=H800"]
SHAPES = {
    "1.5B x 16 nodes": ["launcher.nodes=16", "simulate.model_size=R1-Distill-Qwen-1.5B"],
    "7B x 24 nodes": ["launcher.nodes=24", "simulate.model_size=R1-Distill-Qwen-7B",
                      "trainer.tensor_parallel=2"],
}
PUBLISHED = {"1.5B x 16 nodes": 41.0 / 14.8, "7B x 24 nodes": 2.27}
PUBLISHED_INTERRUPTIBLE_GAIN = {"1.5B x 16 nodes": 0.12, "7B x 24 nodes": 0.17}


# --quick: an eighth of the batch and 3 measured steps, only to check the benchmark runs.
QUICK = ["trainer.groups_per_step=64", "simulate.steps=3"]
_quick: list[str] = []


def calibrated_error() -> dict:
    """The check against real runs is made by benchmarks/async_vs_sync.py (it owns the runs)."""
    found = read_results("async_vs_sync")   # this run's, else the committed one
    if found is None:
        return {"calibrated_error_async_over_sync": None,
                "calibrated_error_reason": "run `python -m benchmarks async_vs_sync` first"}
    r, _ = found
    # async_vs_sync.json's names (older results used the names on the left)
    names = {"calibrated_error_async_over_sync": "sim_error_speedup_eta4_over_eta0",
             "calibrated_from_eta0_error_async_over_sync": "sim_from_eta0_error_speedup_eta4_over_eta0",
             "sim_speedup_eta4_over_eta0": "sim_speedup_eta4_over_eta0",
             "speedup_eta4_over_eta0": "speedup_eta4_over_eta0"}
    return {**{k: r.get(new, r.get(k)) for k, new in names.items()},
            "calibrated_error_measured_on": r.get("date")}


def paper_cfg(*extra: str):
    # Ratios must be quoted as strings: YAML 1.1 reads an unquoted 3:1 as the number 181.
    ov = [o if not o.startswith("launcher.gen_train_ratio=") else
          "launcher.gen_train_ratio='" + o.split("=", 1)[1] + "'" for o in [*PAPER, *extra, *_quick]]
    return load_config(None, ov)


def events_per_s(cfg) -> tuple[float, int, float]:
    sc = build(cfg)
    lengths = lengths_for(cfg, cfg.controller.max_staleness)
    t0 = time.perf_counter()
    r = Simulation(sc.setup, sc.costs, lengths).run()
    dt = time.perf_counter() - t0
    return r.events / dt, r.events, dt


def paper_comparison(quick: bool) -> tuple[list[list], list[list]]:
    """(the async/sync rows, the interruptible-generation rows) for each shape."""
    rows, drain_rows = [], []
    # Longer windows than the default (6 measured steps) for the published comparison.
    steps = [] if quick else ["simulate.steps=18", "simulate.warmup_steps=6"]
    for name, shape in SHAPES.items():
        res = {}
        for label, ov in (("sync", ["controller.max_staleness=0"]),
                          ("sync colocated", ["controller.max_staleness=0", "simulate.colocated=true"]),
                          ("async", ["controller.max_staleness=4"]),
                          # Coalesced versions (trainer/announcements.py): the trainer publishes
                          # during a drain and the servers skip to the newest version.
                          ("async non-interruptible", ["controller.max_staleness=4",
                                                       "controller.interruptible=false"]),
                          # keep_weights 1 leaves nothing to overlap: one version at a time, the
                          # trainer's next publish waiting for every drain (the old baseline).
                          ("one at a time", ["controller.max_staleness=4", "controller.interruptible=false",
                                             "trainer.keep_weights=1"])):
            _, r = simulate(paper_cfg(*shape, *ov, *steps))
            res[label] = r
        sph = {k: r.steps_per_hour for k, r in res.items()}
        rows.append([name, PUBLISHED[name], sph["async"] / sph["sync"], sph["async"] / sph["sync colocated"],
                     sph["async"] / sph["async non-interruptible"] - 1, sph["sync"], sph["async"]])
        coalesced = res["async non-interruptible"]
        drain_rows.append([name, PUBLISHED_INTERRUPTIBLE_GAIN[name], sph["async"] / sph["async non-interruptible"] - 1,
                           sph["async"] / sph["one at a time"] - 1, res["async"].mean_batch, coalesced.mean_batch,
                           coalesced.drain_fraction, coalesced.syncs_per_step, coalesced.train_utilization,
                           res["one at a time"].train_utilization])
    return rows, drain_rows


def drain_sensitivity(quick: bool) -> list[list]:
    """What the drains cost as the longest answer shrinks: the 1.5B gain from interruption
    (against coalesced non-interruptible generation) at 32K, 16K and 8K new tokens at most."""
    steps = [] if quick else ["simulate.steps=18", "simulate.warmup_steps=6"]
    rows = []
    for limit in (32768, 16384, 8192):
        res = {}
        for label, ov in (("interruptible", []), ("coalesced", ["controller.interruptible=false"])):
            _, res[label] = simulate(paper_cfg(*SHAPES["1.5B x 16 nodes"], "controller.max_staleness=4",
                                               f"rollout.max_new_tokens={limit}", *ov, *steps))
        rows.append([limit, res["interruptible"].steps_per_hour / res["coalesced"].steps_per_hour - 1,
                     res["coalesced"].drain_fraction])
    return rows


# rollout.new_tokens_per_chunk for the chunked baselines. AReaL's default (1e10) is off; the
# paper does not say which chunk its ablation used, so a range: 1/32, 1/8 and 1/4 of the 32K limit.
CHUNKS = (1024, 4096, 8192)


def chunked_comparison(quick: bool) -> list[list]:
    """The gain from interruption against coalesced non-interruptible generation with chunks
    (a drain waits for at most one chunk per running request), per shape and chunk size; and at
    4,096 without the radix cache's prefix (every chunk prefilled in full), to show what the
    cached-prefix assumption is worth."""
    steps = [] if quick else ["simulate.steps=18", "simulate.warmup_steps=6"]
    rows = []
    for name, shape in SHAPES.items():
        base = [*shape, "controller.max_staleness=4", *steps]
        _, inter = simulate(paper_cfg(*base))
        runs = {}
        for chunk, cached in [(0, True), *[(c, True) for c in CHUNKS], (4096, False)]:
            _, runs[chunk, cached] = simulate(paper_cfg(
                *base, "controller.interruptible=false", f"rollout.new_tokens_per_chunk={chunk}",
                f"simulate.chunk_prefix_cached={str(cached).lower()}"))
        gain = {key: inter.steps_per_hour / r.steps_per_hour - 1 for key, r in runs.items()}
        r4k = runs[4096, True]
        cfg = paper_cfg(*base)   # samples in the measured window, as the runs count resumes
        samples = cfg.simulate.steps * cfg.trainer.groups_per_step * cfg.rollout.n_samples
        rows.append([name, PUBLISHED_INTERRUPTIBLE_GAIN[name], gain[0, True],
                     *[gain[c, True] for c in CHUNKS], gain[4096, False],
                     r4k.drain_fraction, r4k.mean_batch, r4k.chunk_resumes / samples])
    return rows


SCALING_STEM = "Strong scaling, 1.5B, fixed 512 x 16 batch"
SCALING_TITLE = SCALING_STEM + ", eta=4"
# (label, overrides): disk sync (every server reads every version from the shared filesystem),
# broadcast (a weight path whose cost does not grow with the servers), and disk sync passed down
# a chain of generation nodes (gen.weight_relay: one filesystem read per version).
SCALING_PATHS = (("disk", ["trainer.weight_sync=disk"]), ("broadcast", ["trainer.weight_sync=broadcast"]),
                 ("relay", ["trainer.weight_sync=disk", "gen.weight_relay=true"]))


def strong_scaling(quick: bool) -> list[list]:
    """Per node count: steps/h and efficiency (against the smallest count) for each weight path
    of SCALING_PATHS, then the mean running batch per server (broadcast, relay): what is left of
    the decode batch when a fixed batch is spread over more servers; then each path's seconds a
    server is paused loading one version."""
    rows, base = [], {}
    for nodes in ((4, 16) if quick else (4, 8, 16, 32, 64)):
        rates, batches, loads = [nodes], {}, {}
        for label, ov in SCALING_PATHS:
            sc, r = simulate(paper_cfg(f"launcher.nodes={nodes}", "simulate.model_size=R1-Distill-Qwen-1.5B",
                                       "controller.max_staleness=4", *ov))
            base.setdefault(label, (nodes, r.steps_per_hour))
            rates += [r.steps_per_hour, r.steps_per_hour / base[label][1] / (nodes / base[label][0])]
            batches[label], loads[label] = r.mean_batch, sc.costs.load_s
        rows.append(rates + [batches["broadcast"], batches["relay"], *[loads[label] for label, _ in SCALING_PATHS]])
    print_table(SCALING_TITLE,
                ["nodes", *[f"{m}, {label}" for label, _ in SCALING_PATHS
                            for m in ("steps/h", "efficiency vs smallest")],
                 "mean running batch per server, broadcast", "mean running batch per server, relay",
                 *[f"weight load per server s, {label}" for label, _ in SCALING_PATHS]], rows)
    return rows


# What bounds the largest cluster at a fixed batch: the staleness gate admits at most eta + 1
# steps' groups beyond those trained, and a group holds its place until its longest answer ends,
# so at eta 4 too few answers run to fill 64 nodes' servers. The same two node counts at a larger
# eta, with the relay (the weight path whose cost does not grow with the servers).
SCALING_ETAS = (4, 8, 16)
SCALING_ETA_TITLE = SCALING_STEM + ", by eta, weight relay"


def scaling_by_staleness(quick: bool) -> list[list]:
    """Per eta: efficiency of the largest node count against the smallest (the relay), its mean
    running batch per server, the trainer's busy share and the mean staleness it trained at."""
    small, large = (4, 16) if quick else (4, 64)
    rows = []
    for eta in SCALING_ETAS:
        res = {nodes: simulate(paper_cfg(f"launcher.nodes={nodes}", "simulate.model_size=R1-Distill-Qwen-1.5B",
                                         f"controller.max_staleness={eta}", *dict(SCALING_PATHS)["relay"]))[1]
               for nodes in (small, large)}
        r = res[large]
        trained = sum(r.staleness.values())
        rows.append([eta, r.steps_per_hour / res[small].steps_per_hour / (large / small), r.mean_batch,
                     r.train_utilization, sum(k * n for k, n in r.staleness.items()) / trained])
    print_table(SCALING_ETA_TITLE, ["eta", f"efficiency, {large} vs {small} nodes", "mean running batch per server",
                                    "trainer busy", "mean staleness trained"], rows)
    return rows


def scaling_headline(rows: list[list], by_eta: list[list]) -> dict:
    last = rows[-1]
    by_eta_keys = {f"strong_scaling_eta{row[0]}_{name}": round(row[i], 3)
                   for row in by_eta for i, name in ((1, "efficiency_largest_relay"), (2, "mean_batch_largest"),
                                                     (3, "train_busy_largest"), (4, "mean_staleness_largest"))}
    return {"strong_scaling_efficiency_largest": round(last[2], 2),
            "strong_scaling_efficiency_largest_broadcast": round(last[4], 3),
            "strong_scaling_efficiency_largest_relay": round(last[6], 3),
            "strong_scaling_mean_batch_largest": round(last[7], 1),
            "strong_scaling_mean_batch_largest_relay": round(last[8], 1),
            **{f"strong_scaling_load_s_largest_{label}": round(last[9 + i], 4)
               for i, (label, _) in enumerate(SCALING_PATHS)},
            **by_eta_keys}


# Output lengths that grow during the run (simulate.length_growth), for the elastic split (issue
# 38). An assumption, not a measurement: DeepSeek-R1-Zero's mean answer grew steadily during its
# RL, ending several times longer than it started (the DeepSeek-R1 paper, Figure 3), and a
# distilled model that already answers at length has less room to grow. Two workloads, fixed
# before either was run: the paper-shape lengths (median 4,096) growing 3x to a median of 12,288,
# and answers that start short (median 1,024) growing 8x to 8,192, closer to R1-Zero's curve.
ELASTIC_WORKLOADS = {
    "median 4,096 growing 3x": ["simulate.length_growth=3"],
    "median 1,024 growing 8x": ["simulate.output_median=1024", "simulate.length_growth=8"],
}
# The run's length (an input: the paper's step counts are not part of ours); decisions every
# launcher.elastic_every_steps (5) steps at launcher.elastic_min_gain (15%), the defaults.
ELASTIC_TOTAL_STEPS = 400
ELASTIC_TITLE = "Elastic split, 1.5B, 16 nodes, eta=4"
ELASTIC_LOW_GAIN = 0.05


def elastic_split(quick: bool) -> list[list]:
    """Per workload: the split fastest at the start, the one fastest in hindsight, and what the
    elastic run (launcher/simulate/elastic.py) gains over each, at the paper's 1.5B shape."""
    steps = [] if quick else ["simulate.steps=18", "simulate.warmup_steps=6"]
    rows = []
    for name, ov in ELASTIC_WORKLOADS.items():
        cfg = paper_cfg(*SHAPES["1.5B x 16 nodes"], "controller.max_staleness=4",
                        f"trainer.total_steps={ELASTIC_TOTAL_STEPS}", *ov, *steps)
        p = predict(cfg, jobs=2)
        # The same phases replayed with a lower threshold (no new simulation): how much of the
        # gap to hindsight the 15% threshold leaves.
        low = replay(p.splits, p.speeds, p.total_steps, p.every_steps, ELASTIC_LOW_GAIN, p.move_s)
        rows.append([name, p.start.label, p.hindsight.label, len(p.moves), p.steps_per_hour("start"),
                     p.steps_per_hour("hindsight"), p.steps_per_hour("elastic"), p.gain_over("start"),
                     p.gain_over("hindsight"), p.move_s, p.phases, len(low.moves), low.gain_over("start"),
                     low.gain_over("hindsight")])
    low = f", min gain {100 * ELASTIC_LOW_GAIN:.0f}%"
    print_table(ELASTIC_TITLE, ["workload", "fastest split at the start", "fastest fixed split in hindsight",
                                "elastic moves", "steps/h, fixed at the start", "steps/h, fixed in hindsight",
                                "steps/h, elastic", "elastic gain over the start's split",
                                "elastic gain over hindsight", "move s", "phases", f"elastic moves{low}",
                                f"elastic gain over the start's split{low}", f"elastic gain over hindsight{low}"],
                rows)
    return rows


def elastic_headline(rows: list[list]) -> dict:
    out = {"elastic_total_steps": ELASTIC_TOTAL_STEPS}
    for key, row in zip(("median4096_x3", "median1024_x8"), rows, strict=True):
        out |= {f"elastic_{key}_moves": row[3], f"elastic_{key}_start_steps_per_hour": round(row[4], 2),
                f"elastic_{key}_hindsight_steps_per_hour": round(row[5], 2),
                f"elastic_{key}_steps_per_hour": round(row[6], 2),
                f"elastic_{key}_gain_over_start": round(row[7], 3),
                f"elastic_{key}_gain_over_hindsight": round(row[8], 3),
                f"elastic_{key}_min_gain_5pct_moves": row[11],
                f"elastic_{key}_min_gain_5pct_gain_over_start": round(row[12], 3),
                f"elastic_{key}_min_gain_5pct_gain_over_hindsight": round(row[13], 3),
                f"elastic_{key}_move_s": round(row[9], 1)}
    return out


# --only PART: (the start of its tables' titles, the prefix of its headline keys, a run giving its headline).
PARTS = {"elastic": (ELASTIC_TITLE, "elastic_", lambda quick: elastic_headline(elastic_split(quick))),
         "strong_scaling": (SCALING_STEM, "strong_scaling_",
                            lambda quick: scaling_headline(strong_scaling(quick), scaling_by_staleness(quick)))}


def record_only(part: str, quick: bool) -> dict:
    """`--only elastic` (or `strong_scaling`): re-record one part of simulator.json, keeping the
    rest as recorded (its timings came from a quiet moment; a full run on a busy machine would
    change them)."""
    title, prefix, run = PARTS[part]
    new = run(quick)
    if quick:
        return new
    found = read_results("simulator")   # the committed record (this run's, if it made one)
    if found is None:
        raise SystemExit("--only needs a full record to add to: run `python -m benchmarks.simulator --record` first")
    old = found[0]
    keep_tables([t for t in old.pop("tables", []) if not t.get("title", "").startswith(title)])
    old.pop("machine", None)
    date = old.pop("date", None)
    headline = {k: v for k, v in old.items() if not k.startswith(prefix)} | new
    headline["date_before_" + part] = old.get("date_before_" + part, date)
    write_results("simulator", headline)
    return headline


def main(quick: bool = False, only: str | None = None) -> dict:
    _quick[:] = QUICK if quick else []
    if only:
        return record_only(only, quick)
    cfg = paper_cfg(*SHAPES["1.5B x 16 nodes"], "controller.max_staleness=4")
    ev_s, events, dt = events_per_s(cfg)
    ratios, etas = ["1:1", "2:1", "3:1", "5:1", "7:1"], [0, 1, 2, 4, 8]
    if quick:
        ratios, etas = ratios[1:3], [0, 4]
    t0 = time.perf_counter()
    sw = sweep(cfg, ratios, etas)
    sweep_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    sweep(cfg, ratios, etas, jobs=2)
    sweep_2p_s = time.perf_counter() - t0
    # The same sweep over the whole cluster (no shrinking): how long, and how far apart.
    t0 = time.perf_counter()
    whole = sweep(with_overrides(cfg, shrink=1), ratios, etas)
    sweep_whole_s = time.perf_counter() - t0
    shrink_err = max(abs(c.result.steps_per_hour / whole.cells[key].result.steps_per_hour - 1)
                     for key, c in sw.cells.items() if c.result and whole.cells[key].result)
    best = sw.best()
    print_table("Simulator speed (1.5B, 16 nodes, 512 x 16 samples, 32K tokens)",
                ["measure", "value"],
                [["events / s", ev_s], ["events in one run", events], ["one run (s)", dt],
                 [f"{len(ratios)}x{len(etas)} sweep, 1 process (s)", sweep_s],
                 [f"{len(ratios)}x{len(etas)} sweep, 2 processes (s)", sweep_2p_s],
                 [f"{len(ratios)}x{len(etas)} sweep of the whole cluster, 1 process (s)", sweep_whole_s],
                 ["largest steps/h difference, shrunk vs whole", f"{100 * shrink_err:.1f}%"],
                 ["sweep's best", f"{best.ratio}, eta={best.eta}" if best else "-"]])
    print_table("Sweep: training steps/h by generation:training split and eta (1.5B, 16 nodes)",
                ["ratio", *[f"eta={e}" for e in etas]],
                [[r, *[sw.cells[(r, e)].result.steps_per_hour if sw.cells[(r, e)].result else None for e in etas]]
                 for r in ratios])
    paper, drains = paper_comparison(quick)
    print_table("Predictions beside the AReaL paper (async eta=4 vs synchronous)",
                ["shape", "paper async/sync", "sim async/sync (separate)", "sim async/sync (colocated)",
                 "sim gain from interruption", "sim sync steps/h", "sim async steps/h"], paper)
    print_table("Interruptible vs non-interruptible generation (eta=4; non-interruptible with coalesced versions, "
                "and one version at a time)",
                ["shape", "paper gain", "sim gain (coalesced)", "sim gain (one at a time)",
                 "mean batch, interruptible", "mean batch, non-interruptible", "server time draining",
                 "syncs per step (coalesced)", "trainer busy (coalesced)", "trainer busy (one at a time)"], drains)
    sensitivity = drain_sensitivity(quick)
    print_table("Gain from interruption vs the longest answer (1.5B, 16 nodes, eta=4, coalesced baseline)",
                ["max new tokens", "sim gain", "server time draining"], sensitivity)
    chunked = chunked_comparison(quick)
    print_table("Interruptible vs coalesced non-interruptible generation with chunks "
                "(eta=4; rollout.new_tokens_per_chunk)",
                ["shape", "paper gain", "sim gain, no chunks", *[f"sim gain, chunk {c}" for c in CHUNKS],
                 "sim gain, chunk 4096 without prefix cache", "server time draining, chunk 4096",
                 "mean batch, chunk 4096", "chunks resumed per sample, chunk 4096"], chunked)
    scaling = strong_scaling(quick), scaling_by_staleness(quick)
    elastic = elastic_split(quick)
    headline = {
        "events_per_s": round(ev_s),
        "sweep_s": round(sweep_s, 2),
        "sweep_2proc_s": round(sweep_2p_s, 2),
        "sweep_whole_cluster_s": round(sweep_whole_s, 2),
        "sweep_shrink_max_error": round(shrink_err, 4),
        "sweep_points": len(ratios) * len(etas),
        **calibrated_error(),
        "paper_1_5b_async_over_sync_pred": round(paper[0][2], 2),
        "paper_7b_async_over_sync_pred": round(paper[1][2], 2),
        "interruptible_gain_1_5b_pred": round(paper[0][4], 3),
        "interruptible_gain_7b_pred": round(paper[1][4], 3),
        "interruptible_gain_1_5b_one_at_a_time_pred": round(drains[0][3], 3),
        "interruptible_gain_7b_one_at_a_time_pred": round(drains[1][3], 3),
        "mean_batch_interruptible_1_5b": round(drains[0][4], 1),
        "mean_batch_noninterruptible_1_5b": round(drains[0][5], 1),
        "drain_fraction_noninterruptible_1_5b": round(drains[0][6], 3),
        "drain_fraction_noninterruptible_7b": round(drains[1][6], 3),
        "syncs_per_step_noninterruptible_1_5b": round(drains[0][7], 2),
        "train_busy_noninterruptible_1_5b": round(drains[0][8], 3),
        "train_busy_one_at_a_time_1_5b": round(drains[0][9], 3),
        "interruptible_gain_1_5b_16k_pred": round(sensitivity[1][1], 3),
        "interruptible_gain_1_5b_8k_pred": round(sensitivity[2][1], 3),
        **{f"interruptible_gain_{key}_chunk{c}_pred": round(row[3 + i], 3)
           for key, row in zip(("1_5b", "7b"), chunked, strict=True) for i, c in enumerate(CHUNKS)},
        "interruptible_gain_1_5b_chunk4096_uncached_pred": round(chunked[0][6], 3),
        "interruptible_gain_7b_chunk4096_uncached_pred": round(chunked[1][6], 3),
        "drain_fraction_chunk4096_1_5b": round(chunked[0][7], 3),
        "drain_fraction_chunk4096_7b": round(chunked[1][7], 3),
        "mean_batch_chunk4096_1_5b": round(chunked[0][8], 1),
        "chunk_resumes_per_sample_4096_1_5b": round(chunked[0][9], 2),
        **scaling_headline(*scaling),
        **elastic_headline(elastic),
    }
    if not quick:
        write_results("simulator", headline)
    return headline


def _args(p) -> list[str]:
    p.add_argument("--only", choices=sorted(PARTS),
                   help="run and (with --record) re-record only this part, keeping the rest of simulator.json")
    return ["only"]


if __name__ == "__main__":
    cli(main, _args)
