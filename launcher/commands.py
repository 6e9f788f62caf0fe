"""`tandem plan` and `tandem simulate`: the commands users run before spending GPU hours.

Both read an experiment file plus dotlist overrides like `tandem config show`; the work is in
launcher.plan and launcher.simulate, so this module only parses arguments and prints.
"""
from __future__ import annotations

import json
import sys

from tandem.launcher.config import ConfigError, load_config

DEFAULT_SUGGEST_RATIOS = ["1:1", "2:1", "3:1", "5:1", "7:1"]


def _parse_sweep(items: list[str]) -> tuple[list[str] | None, list[int] | None]:
    ratios = etas = None
    for item in items:
        key, _, val = item.partition("=")
        values = [v.strip() for v in val.split(",") if v.strip()]
        if not values:
            raise ConfigError(f"--sweep {item!r}: expected key=v1,v2,...")
        if key == "ratio":
            ratios = values
        elif key == "eta":
            try:
                etas = [int(v) for v in values]
            except ValueError:
                raise ConfigError(f"--sweep {item!r}: eta values must be integers") from None
            if any(e < 0 for e in etas):
                raise ConfigError(f"--sweep {item!r}: eta values must be >= 0")
        else:
            raise ConfigError(f"--sweep {item!r}: unknown key {key!r} (use ratio=... and/or eta=...; "
                              f"put config overrides before --sweep)")
    return ratios, etas


def _memory(cfg, plan) -> None:
    """Print the per-GPU memory estimate of `plan`; refuse (ConfigError) a role that does not fit."""
    from rich.console import Console

    from tandem.launcher.plan import PlanError
    from tandem.launcher.simulate.memory import estimate, refusal
    from tandem.launcher.simulate.memory import render as render_memory

    if not plan.uses_gpus:
        return
    est = estimate(cfg, plan.train_dp)
    render_memory(est, Console())
    problem = refusal(est)
    if problem:
        raise PlanError(f"does not fit the GPUs (simulate.hardware={cfg.simulate.hardware}):\n{problem}")


def _plan(args) -> int:
    from tandem.launcher.plan import plan_for, render

    cfg = load_config(args.file, args.overrides)
    if not args.suggest:
        plan = plan_for(cfg)
        render(plan)
        _memory(cfg, plan)
        return 0
    from tandem.launcher.simulate.engine import SimulationError
    from tandem.launcher.simulate.report import print_sweep
    from tandem.launcher.simulate.scenario import sweep, with_overrides

    ratios = args.ratios.split(",") if args.ratios else DEFAULT_SUGGEST_RATIOS
    eta = cfg.controller.max_staleness
    try:
        sw = sweep(cfg, ratios, [eta], jobs=args.jobs)
    except SimulationError as e:
        print(f"tandem: simulation error: {e}", file=sys.stderr)
        return 2
    print_sweep(sw, eta)
    best = sw.best(eta)
    if best is None:
        print("tandem: no ratio could be simulated for this cluster (see above)", file=sys.stderr)
        return 2
    best_cfg = with_overrides(cfg, ratio=best.ratio)
    best_plan = plan_for(best_cfg)
    render(best_plan)
    _memory(best_cfg, best_plan)
    if best.ratio != cfg.launcher.gen_train_ratio:
        print(f'suggestion: set launcher.gen_train_ratio: "{best.ratio}" (configured: '
              f'"{cfg.launcher.gen_train_ratio}")')
    return 0


def _result_json(r) -> dict:
    return {"steps_per_hour": r.steps_per_hour, "trajectories_per_s": r.trajectories_per_s,
            "gen_tokens_per_s": r.gen_tokens_per_s, "trained_tokens_per_s": r.trained_tokens_per_s,
            "gen_utilization": r.gen_utilization, "train_utilization": r.train_utilization,
            "staleness": {str(k): v for k, v in sorted(r.staleness.items())}}


def _elastic_json(pred) -> dict:
    runs = {"start": pred.start.ratio, "hindsight": pred.hindsight.ratio, "elastic": None}
    return {"total_steps": pred.total_steps, "move_s": pred.move_s, "length_growth": pred.growth,
            **{run: {"split": split, "seconds": pred.seconds[run], "steps_per_hour": pred.steps_per_hour(run),
                     **({"elastic_gain": pred.gain_over(run)} if split else {})} for run, split in runs.items()},
            "moves": [{"step": step, "from": a, "to": b} for step, a, b in pred.moves],
            "phases": pred.speeds}


def _simulate(args) -> int:
    from tandem.launcher.simulate.engine import SimulationError
    from tandem.launcher.simulate.report import plot_sweep, print_result, print_sweep
    from tandem.launcher.simulate.scenario import simulate, sweep

    cfg = load_config(args.file, args.overrides)
    calibration = None
    if args.calibrate:
        from tandem.launcher.simulate.calibrate import calibrate
        from tandem.launcher.simulate.fit_check import adopt_run_workload, check_fit, explicit_simulate_keys
        from tandem.launcher.simulate.report import print_calibration
        calibration = calibrate(args.calibrate)
        print_calibration(calibration)
        fit = check_fit(calibration, args.calibrate)   # the fitted run, predicted: is the fit any good?
        print(fit.text())
        if fit.poor() and not args.accept_poor_fit:
            print(f"tandem simulate: the calibration misses its own run by {100 * fit.error:+.0f}% (over "
                  f"15%); its predictions would not hold (--accept-poor-fit to simulate anyway)", file=sys.stderr)
            return 2
        if fit.poor():
            print(f"warning: simulating with a calibration {100 * fit.error:+.0f}% off its own run")
        for note in adopt_run_workload(cfg, calibration, explicit_simulate_keys(args.file, args.overrides)):
            print(f"note: {note}")
    try:
        if args.elastic:
            if args.sweep is not None:
                print("tandem simulate: --elastic and --sweep are separate questions; ask one at a time",
                      file=sys.stderr)
                return 2
            from tandem.launcher.simulate.elastic import predict
            from tandem.launcher.simulate.report import print_elastic
            pred = predict(cfg, calibration, max_phases=args.phases, jobs=args.jobs)
            print_elastic(pred)
            out = _elastic_json(pred)
        elif args.sweep is None:
            sc, r = simulate(cfg, calibration)
            print_result(sc, r)
            out = _result_json(r)
        else:
            ratios, etas = _parse_sweep(args.sweep)
            ratios = ratios or [cfg.launcher.gen_train_ratio]
            etas = etas if etas is not None else [cfg.controller.max_staleness]
            sw = sweep(cfg, ratios, etas, calibration, jobs=args.jobs)
            print_sweep(sw, cfg.controller.max_staleness)
            if sw.best() is None:   # a table of '-' answers nothing: never a success
                print("tandem: no point of the sweep could be simulated (see above)", file=sys.stderr)
                return 2
            if args.plot:
                print(f"plot: {plot_sweep(sw, args.plot, title=cfg.experiment.name)}")
            out = {f"{c.ratio} eta={c.eta}": (_result_json(c.result) if c.result else {"error": c.error})
                   for c in sw.cells.values()}
    except SimulationError as e:
        print(f"tandem: simulation error: {e}", file=sys.stderr)
        return 2
    if args.plot and args.sweep is None:
        print("note: --plot needs --sweep; nothing drawn", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


def _default_jobs() -> int:
    import os
    return max(1, min(8, os.cpu_count() or 1))


def register(sub) -> None:
    p = sub.add_parser("plan", help="show how the cluster's GPUs are split between generation and training")
    p.add_argument("file", help="experiment YAML file")
    p.add_argument("overrides", nargs="*", help="dotlist overrides before any --option, e.g. "
                                                "launcher.nodes=16 (quote ratios: "
                                                "launcher.gen_train_ratio=\"'2:1'\")")
    p.add_argument("--suggest", action="store_true",
                   help="simulate several gen:train ratios and recommend the fastest")
    p.add_argument("--ratios", help=f"ratios for --suggest (default {','.join(DEFAULT_SUGGEST_RATIOS)})")
    p.add_argument("--jobs", type=int, default=_default_jobs(), help="processes for --suggest")
    p.set_defaults(func=_plan)
    s = sub.add_parser("simulate", help="predict throughput, utilisation and staleness on a cluster")
    s.add_argument("file", help="experiment YAML file")
    s.add_argument("overrides", nargs="*", help="dotlist overrides before any --option, e.g. "
                                                "simulate.output_sigma=1.2")
    s.add_argument("--sweep", nargs="+", metavar="KEY=V1,V2",
                   help="simulate every combination, e.g. --sweep ratio=1:1,3:1 eta=0,2,4")
    s.add_argument("--calibrate", metavar="EXP_DIR",
                   help="fit the cost model to EXP_DIR/metrics.jsonl instead of the datasheet model")
    s.add_argument("--accept-poor-fit", action="store_true",
                   help="with --calibrate: simulate even when the fit misses its own run by over 15%%")
    s.add_argument("--plot", metavar="OUT.png", help="with --sweep: draw throughput vs ratio and eta")
    s.add_argument("--json", metavar="OUT.json", help="also write the predictions as JSON")
    s.add_argument("--elastic", action="store_true",
                   help="predict what launcher.elastic (moving GPUs between generation and training as "
                        "the lengths grow, simulate.length_growth) gains over the best fixed split")
    s.add_argument("--phases", type=int, default=None,
                   help="with --elastic: at most this many phases of the run, each simulated on every split "
                        "(default: launcher/simulate/elastic.py's DEFAULT_MAX_PHASES)")
    s.add_argument("--jobs", type=int, default=_default_jobs(),
                   help="processes for --sweep and --elastic (default: CPUs, at most 8)")
    s.set_defaults(func=_simulate)
