"""`tandem status --exp DIR` and `tandem cancel --exp DIR`: an experiment's SLURM jobs.

Both read `<exp>/services/slurm-jobs.json`, which the slurm backend writes as it submits, so
they work from any shell on the shared filesystem while the launcher runs, after it died, or
from inside `slurm/train.sbatch`'s allocation. For an experiment of the local backend, `status`
says whether its launch runs (the launch's record in `<exp>/launcher.lock`, exp_lock.py), its
last step and the roles running on this machine.
"""
from __future__ import annotations

import datetime
import sys
import time

from tandem.services.protocol import ExpDir, read_metrics

from .config import load_experiment
from .continuation import CONTINUED, continuations
from .exp_lock import last_launch
from .launcher_watch import roles_of
from .progress import run_steps
from .slurm_jobs import SlurmUnavailable, cancel_experiment, cancel_flag, query_states, read_record


def cmd_status(args) -> int:
    exp = ExpDir(args.exp_dir)
    try:
        record = read_record(exp)
    except FileNotFoundError as e:
        if exp.config.exists():   # launched on this machine (the local backend)
            return local_status(exp)
        print(f"tandem status: {e}", file=sys.stderr)
        return 2
    roles = record.get("roles", {})
    states = query_states([r["job_id"] for r in roles.values()])
    started = datetime.datetime.fromtimestamp(record.get("started_at", 0)).strftime("%Y-%m-%d %H:%M:%S")
    print(f"experiment {record.get('experiment')} ({exp.root}): launcher status "
          f"'{record.get('status')}', started {started}"
          + (" — cancel requested" if cancel_flag(exp).exists() else ""))
    rows = [("role", "job", "state", "nodes", "elapsed", "resubmits", "detail")]
    for name, role in roles.items():
        s = states[str(role["job_id"])]
        detail = s.detail if s.detail and s.detail != s.state else ""
        if s.exit_code and s.exit_code != "0:0":
            detail = f"{detail} exit {s.exit_code}".strip()
        rows.append((name, str(role["job_id"]), s.state, s.nodes or "-", s.elapsed or "-",
                     str(role.get("resubmits", 0)), detail))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    for line in continuation_lines(exp):
        print(line)
    return 0


def continuation_lines(exp: ExpDir) -> list[str]:
    """What the launcher decided each time the cluster ended one of the run's jobs."""
    out = []
    for r in continuations(exp):
        at = datetime.datetime.fromtimestamp(r.get("time", 0)).strftime("%Y-%m-%d %H:%M:%S")
        if r.get("event") == CONTINUED:
            out.append(f"continued automatically ({r.get('attempt')} of {r.get('budget')}) at {at}: {r.get('why')}")
        else:
            out.append(f"not continued at {at}: {r.get('why')}")
    return out


def local_status(exp: ExpDir) -> int:
    """A local launch: whether it runs (its lock, exp_lock.py), its last step, its roles here."""
    launch = last_launch(exp.root)
    if launch is None:
        state = "no launch recorded (launcher.lock)"
    else:
        held, running = launch
        since = datetime.datetime.fromtimestamp(held.get("started", 0)).strftime("%Y-%m-%d %H:%M:%S")
        who = f"pid {held['pid']} on {held.get('host')}, started {since}"
        state = {True: f"launch running ({who})", False: f"no launch running (the last: {who})",
                 None: f"launched from {held.get('host')} ({who}); whether it runs, that host can tell"}[running]
    print(f"experiment {exp.root}: {state}")
    steps = run_steps(read_metrics(exp, "trainer"))
    if steps:
        ago = time.time() - steps[-1]["time"]
        total = load_experiment(exp.root).trainer.total_steps
        print(f"  step {steps[-1]['step']} of {total}, {ago:.0f} s ago")
    roles = roles_of(exp.root)
    print("  roles running here: " + ("none" if not roles else "\n    " + "\n    ".join(roles)))
    return 0


def cmd_cancel(args) -> int:
    exp = ExpDir(args.exp_dir)
    try:
        cancelled, left = cancel_experiment(exp, wait_s=args.wait)
    except FileNotFoundError as e:
        print(f"tandem cancel: {e}", file=sys.stderr)
        return 2
    except SlurmUnavailable as e:
        print(f"tandem cancel: {e}", file=sys.stderr)
        return 1
    if not cancelled:
        print(f"no job of {exp.root} is queued or running")
        return 0
    if left:
        print(f"tandem cancel: cancelled {' '.join(cancelled)} but squeue still lists {' '.join(left)} "
              f"after {args.wait:.0f}s (nodes slow to kill; check `squeue -j {','.join(left)}`)",
              file=sys.stderr)
        return 1
    print(f"cancelled {len(cancelled)} job(s): {' '.join(cancelled)}")
    return 0


def register(sub) -> None:
    # dest=exp_dir: these commands need only the job record, not the experiment's config, so a
    # config that no longer loads (edited, older code) can never stand in the way of a cancel.
    p = sub.add_parser("status", help="show each role's SLURM job and its state (slurm backend), or whether a "
                                      "local launch runs, its last step and its roles")
    p.add_argument("--exp", dest="exp_dir", required=True, help="experiment directory")
    p.set_defaults(func=cmd_status)
    p = sub.add_parser("cancel", help="cancel every SLURM job of an experiment (slurm backend)")
    p.add_argument("--exp", dest="exp_dir", required=True, help="experiment directory")
    p.add_argument("--wait", type=float, default=60.0, help="seconds to wait until squeue no longer lists them")
    p.set_defaults(func=cmd_cancel)
