"""Faults during a run: each injected once mid-run, and what it cost.

One short `tandem run` of the tiny embedded experiment per fault (local backend, real
processes): SIGKILL of the generation server, the controller, the reward service, a rollout
worker, the trainer; bad input on every port; Ctrl-C of the launcher; SIGKILL of the launcher
(its roles stop by themselves: launcher/launcher_watch.py). A fault that ends the launch (the
trainer's death, Ctrl-C, the launcher's death) is followed by `--resume`, as a user would. For each the
table gives the recovery time — from the fault to the first trained step holding a group
delivered after it, i.e. generation, grading, delivery and training all flowing again — the
longest gap between steps, and the accounting of `launcher/audit.py` over the whole run: groups
lost, trained twice (and prompts trained twice), returned (pushed but never receipted, so generated
again), prompts skipped, stale drops. A last row checks that a non-finite setting is refused before anything starts.
`tests/integration/test_faults.py` asserts the same; this measures it (faults.json; see benchmarks/common.py for where).
"""
from __future__ import annotations

if not __package__:  # `python benchmarks/NAME.py`: see benchmarks/script_path.py
    import script_path  # noqa: F401

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from benchmarks.common import cli, print_table, write_results
from benchmarks.fault_injection import KINDS, inject

if TYPE_CHECKING:
    from tandem.launcher.audit import Audit

CONFIG = """\
experiment: {{name: {name}, model: {model}, exp_dir: {exp_dir}}}
controller: {{max_staleness: 2, lease_s: 10}}
gen: {{num_servers: 1, threads: 1, metrics_interval_s: 0.5}}
rollout: {{dataset: "synthetic:math", n_samples: 2, max_new_tokens: 48, concurrency: 4, heartbeat_s: 1.0{rollout}}}
reward: {{task: math, num_workers: 1}}
trainer: {{groups_per_step: 2, total_steps: {steps}, checkpoint_every: 2, max_tokens_per_mb: 4096}}
"""


def experiment_file(workdir: Path, model: Path, name: str, total_steps: int, rollout: str = "") -> Path:
    """`rollout`: more settings of the rollout section, e.g. `, agent: my_agent:solve`."""
    path = workdir / f"{name}.yaml"
    path.write_text(CONFIG.format(name=name, model=model, exp_dir=workdir / name, steps=total_steps, rollout=rollout))
    return path


def as_terminal_foreground() -> None:
    """preexec_fn of a launcher that is sent a terminal's Ctrl-C or hang-up: SIGINT and SIGHUP at
    their defaults, as in a foreground job. A shell starts background jobs (`make test &`,
    nohup) with SIGINT (and nohup SIGHUP) ignored, and an ignored signal stays ignored across
    exec — the launcher would never see them."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


def launch(cfg: Path, *extra: str, cwd: Path | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tandem.launcher.cli", "run", str(cfg), *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            preexec_fn=as_terminal_foreground, cwd=cwd)


def finish(proc: subprocess.Popen, timeout_s: float) -> tuple[int, str]:
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return -1, out
    return proc.returncode, out


def leftovers(exp_root: Path) -> list[str]:
    """Processes whose command line names this experiment (roles started for it), but this one."""
    found = []
    for pid in os.listdir("/proc"):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, ValueError):
            continue
        if pid.isdigit() and str(exp_root) in cmd and int(pid) != os.getpid():
            found.append(f"{pid}: {cmd[:160]}")
    return found


def roles_stopped(exp_root: Path, since: float) -> tuple[list[str], float]:
    """After the launcher's SIGKILL: what is still running once the roles had the time their
    launcher would have given them (launcher/launcher_watch.py), and seconds until none was."""
    from tandem.launcher.launcher_watch import SERVICES_STOP_AFTER_S
    from tandem.services.protocol import STOP_GRACE_S
    deadline = since + SERVICES_STOP_AFTER_S + STOP_GRACE_S + 10.0
    while (left := leftovers(exp_root)) and time.time() < deadline:
        time.sleep(0.2)
    return left, round(time.time() - since, 2)


def progress(exp_root: Path) -> tuple[list[dict], dict[str, float]]:
    """The trainer's step records so far, and when each group was delivered."""
    from tandem.services.protocol import ExpDir, read_metrics
    records = read_metrics(ExpDir(exp_root))
    steps = [r for r in records if r.get("role") == "trainer" and r.get("event") == "step"]
    delivered = {r["group_id"]: r["time"] for r in records if r.get("role") == "rollout" and r.get("event") == "group"}
    return steps, delivered


def recovered_at(exp_root: Path, since: float) -> float | None:
    """When the first step trained a group delivered after `since` (None: not yet)."""
    steps, delivered = progress(exp_root)
    for s in steps:
        if s["time"] > since and any(delivered.get(g, 0.0) > since for g in s.get("group_ids", ())):
            return s["time"]
    return None


def stall_s(result: Audit, fault: dict, until: float | None) -> float:
    """The longest wait between trained steps that `fault` is answerable for: from the last step
    before it to the next fault (or the end). A fault that ends the launch counts from the resumed
    launch's first step: starting every role again is the resume's start-up, the same on a busy
    machine whatever the fault, not a client waiting on a dead service."""
    resumed = fault.get("resumed_at")
    return result.max_gap_s(after=resumed or fault["time"], until=until, anchored=resumed is None)


def run_with_faults(workdir: Path, model: Path, name: str, faults: list[tuple[int, str]], total_steps: int,
                    timeout_s: float = 600.0, tail_steps: int | None = None, rollout: str = "") -> dict:
    """One run; each `(after_step, kind)` injected once the run has trained `after_step` steps
    and recovered from the previous fault. A fault that ends the launch is followed by --resume.

    `total_steps` must leave room for every fault and its recovery, however long they take. With
    `tail_steps`, a last fault that ends the launch is resumed to only that many steps past the
    last one trained (`trainer.total_steps` given with --resume, as a user shortens a run), so the
    run does not train out the rest of that room after its last fault. `rollout` adds settings to
    the rollout section (an agent's: every launch starts in `workdir`, where its module is)."""
    from tandem.launcher.audit import audit
    from tandem.services.protocol import ExpDir

    cfg = experiment_file(workdir, model, name, total_steps, rollout)
    exp_root = workdir / name
    cwd = workdir if rollout else None
    proc, outputs, exits, injected = launch(cfg, cwd=cwd), [], [], []
    deadline = time.monotonic() + timeout_s

    def wait_for(ready, what: str) -> None:
        while not ready():
            if proc.poll() is not None or time.monotonic() > deadline:
                out = proc.stdout.read() if proc.stdout and proc.poll() is not None else ""
                raise RuntimeError(f"{name}: the run ended or stalled before {what}:\n{out[-3000:]}")
            time.sleep(0.2)

    for after_step, kind in faults:
        wait_for(lambda n=after_step: len(progress(exp_root)[0]) >= n, f"step {after_step}")
        if injected:
            wait_for(lambda: recovered_at(exp_root, injected[-1]["time"]) is not None,
                     f"recovering from {injected[-1]['kind']}")
        if proc.poll() is not None:
            raise RuntimeError(f"{name}: the run ended before {kind} could be injected; make it longer")
        fault = {"kind": kind, "at_step": len(progress(exp_root)[0]), "time": time.time(), "launcher_pid": proc.pid}
        ends_launch, fault["observed"] = inject(kind, exp_root, proc.pid)
        injected.append(fault)
        if ends_launch:   # the launch's teardown leaves nothing running (SIGKILLed trainer, Ctrl-C)
            code, out = finish(proc, max(1.0, deadline - time.monotonic()))
            exits.append(code), outputs.append(out)
            if kind == "launcher":   # no teardown ran: the roles stop by themselves, in their grace
                fault["left_running"], fault["stopped_s"] = roles_stopped(exp_root, fault["time"])
            else:                    # the launch's teardown ran before it exited
                fault["left_running"] = leftovers(exp_root)
            fault["resumed_at"] = time.time()
            last = len(injected) == len(faults) and tail_steps is not None
            if last:
                total_steps = max((s["step"] for s in progress(exp_root)[0]), default=0) + tail_steps
            proc = launch(cfg, *([f"trainer.total_steps={total_steps}"] if last else []), "--resume", cwd=cwd)
    code, out = finish(proc, max(1.0, deadline - time.monotonic()))
    exits.append(code), outputs.append(out)
    result = audit(ExpDir(exp_root))
    for fault, following in zip(injected, [*injected[1:], None], strict=True):
        at = recovered_at(exp_root, fault["time"])
        fault["recovery_s"] = round(at - fault["time"], 2) if at else None
        fault["max_step_gap_s"] = round(result.max_gap_s(after=fault["time"]), 2)
        fault["stall_s"] = round(stall_s(result, fault, following["time"] if following else None), 2)
    return {"exits": exits, "audit": result.as_dict(), "lost": result.lost, "trained_twice": result.trained_twice,
            "faults": injected, "total_steps": total_steps, "outputs": outputs}


def nan_setting_refused(workdir: Path, model: Path) -> tuple[int, bool]:
    """`tandem run` with `rollout.temperature=nan`: its exit code, and whether it names the key."""
    cfg = experiment_file(workdir, model, "nan", 2)
    code, out = finish(launch(cfg, "rollout.temperature=nan"), 120)
    return code, "rollout.temperature" in out


def tiny_model(workdir: Path) -> Path:
    from tandem.rollout.tiny_model import init_tiny
    return init_tiny(workdir / "tiny-model", seed=0)


def main(quick: bool = False) -> None:
    total_steps = 16 if quick else 40   # about half a second a step: room for any recovery
    rows, results = [], {}
    with tempfile.TemporaryDirectory(prefix="tandem-faults-") as tmp:
        workdir = Path(tmp)
        model = tiny_model(workdir)
        for kind in KINDS[:2] if quick else KINDS:
            t0 = time.time()
            run = run_with_faults(workdir, model, f"fault-{kind}", [(5, kind)], total_steps)
            a, (fault,) = run["audit"], run["faults"]
            results[kind] = {**a, "exits": run["exits"], "recovery_s": fault["recovery_s"],
                             "max_gap_after_s": fault["max_step_gap_s"], "wall_s": round(time.time() - t0, 1),
                             **({"left_running": len(fault["left_running"])} if "left_running" in fault else {}),
                             **({"roles_stopped_s": fault["stopped_s"]} if "stopped_s" in fault else {})}
            rows.append([kind, " ".join(map(str, run["exits"])), fault["recovery_s"], fault["max_step_gap_s"],
                         a["lost"], a["trained_twice"], a["prompts_trained_twice"], a["returned"], a["prompts_skipped"],
                         a["dropped"], a["steps"], len(fault["left_running"]) if "left_running" in fault else None])
        nan_exit, nan_named = nan_setting_refused(workdir, model)
    rows.append(["rollout.temperature=nan", nan_exit, None, None, None, None, None, None, None, None, 0, None])
    print_table(f"One fault per run at step 5 of {total_steps} (tiny model, local backend; "
                "SIGKILL unless said otherwise)",
                ["fault", "exit codes", "recovery s", "max step gap s", "groups lost", "trained twice",
                 "prompts trained twice", "returned", "prompts skipped", "stale drops", "steps",
                 "left running at the launch's end"], rows)
    if not quick:
        write_results("faults", {
            "runs": results,
            "groups_lost_total": sum(r["lost"] for r in results.values()),
            "trained_twice_total": sum(r["trained_twice"] for r in results.values()),
            "prompts_trained_twice_total": sum(r["prompts_trained_twice"] for r in results.values()),
            "prompts_skipped_total": sum(r["prompts_skipped"] for r in results.values()),
            "max_stall_s": max(r["max_gap_after_s"] for r in results.values()),
            "max_recovery_s": max((r["recovery_s"] or 0) for r in results.values()),
            "nan_setting_exit": nan_exit, "nan_setting_named": nan_named})


if __name__ == "__main__":
    cli(main)
