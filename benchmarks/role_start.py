"""What forking the model roles from a preloading server saves a local run: the same short run
with `launcher.fork_roles=true` (the default) and `false` (each role a fresh interpreter),
alternating, same seed, the tiny model (untrained: the run's work is small, so start-up and
exits are most of it, as in the test suite's runs).

Per run: wall time of `tandem run`, and the CPU seconds of it and every process it waited for,
directly or through the fork server (getrusage of the waited children). Per role: role_cpu.json
(a forked role's time starts at the fork, so the server's imports are in the run's total only).
Medians over the rounds, and the ratio forked/fresh.
"""
from __future__ import annotations

if not __package__:  # `python benchmarks/NAME.py`: see benchmarks/script_path.py
    import script_path  # noqa: F401

import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import cli, print_table, write_results

CONFIG = """\
experiment: {{name: {name}, model: {model}, exp_dir: {exp_dir}, seed: 1}}
controller: {{max_staleness: 2}}
gen: {{num_servers: 1, threads: 1}}
rollout: {{dataset: "synthetic:math", n_samples: 2, max_new_tokens: 48, concurrency: 4}}
reward: {{task: math, num_workers: 1}}
trainer: {{groups_per_step: 2, total_steps: {steps}, checkpoint_every: 1, max_tokens_per_mb: 4096}}
"""
ROLES = ("gen-0", "trainer-0", "rollout-0", "controller-0", "reward-0")


def one_run(workdir: Path, model: Path, name: str, forked: bool, steps: int) -> dict:
    """One `tandem run` to its end: wall, CPU of everything it waited for, and role_cpu.json."""
    exp_dir = workdir / name
    cfg = workdir / f"{name}.yaml"
    cfg.write_text(CONFIG.format(name=name, model=model, exp_dir=exp_dir, steps=steps))
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "tandem.launcher.cli", "run", str(cfg),
                           f"launcher.fork_roles={str(forked).lower()}"], capture_output=True, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise RuntimeError(f"{name} exited {proc.returncode}:\n{proc.stdout[-3000:]}")
    roles = json.loads((exp_dir / "role_cpu.json").read_text())["cpu_seconds"]
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"wall_s": wall, "cpu_s": cpu, **{r: roles.get(r, 0.0) for r in ROLES}}


def main(quick: bool = False) -> dict:
    from tandem.rollout.tiny_model import init_tiny
    rounds, steps = (1, 2) if quick else (5, 2)
    runs: dict[str, list[dict]] = {"fresh": [], "forked": []}
    with tempfile.TemporaryDirectory(prefix="tandem-role-start-") as tmp:
        workdir = Path(tmp)
        model = init_tiny(workdir / "tiny-model", seed=0)
        for i in range(rounds):
            for kind in (("fresh", "forked") if i % 2 == 0 else ("forked", "fresh")):
                r = one_run(workdir, model, f"{kind}-{i}", kind == "forked", steps)
                runs[kind].append(r)
                print(f"round {i + 1}/{rounds} {kind}: {r['wall_s']:.1f} s wall, {r['cpu_s']:.1f} CPU-s", flush=True)
    med = {kind: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for kind, rs in runs.items()}
    keys = ["wall_s", "cpu_s", *ROLES]
    rows = [[k, med["fresh"][k], med["forked"][k], med["forked"][k] / med["fresh"][k] if med["fresh"][k] else None]
            for k in keys]
    print_table(f"A {steps}-step local run of the tiny model, fresh roles vs forked (median of {rounds}, "
                "alternating; role rows: CPU-s from role_cpu.json)", ["", "fresh", "forked", "forked/fresh"], rows)
    headline = {"rounds": rounds, "steps": steps,
                "wall_s_fresh": round(med["fresh"]["wall_s"], 2), "wall_s_forked": round(med["forked"]["wall_s"], 2),
                "cpu_s_fresh": round(med["fresh"]["cpu_s"], 2), "cpu_s_forked": round(med["forked"]["cpu_s"], 2),
                "wall_ratio": round(med["forked"]["wall_s"] / med["fresh"]["wall_s"], 3),
                "cpu_ratio": round(med["forked"]["cpu_s"] / med["fresh"]["cpu_s"], 3)}
    if not quick:
        write_results("role_start", headline)
    return headline


if __name__ == "__main__":
    cli(main)
