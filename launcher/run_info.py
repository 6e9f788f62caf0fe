"""Which run a report is about: `<exp>/launches.jsonl`, one line per `tandem run` launch.

A report read weeks later must say what produced it: the experiment file, when it started, and
the code's commit. The resolved `config.yaml` holds the values but not where they came from, so
each launch appends {time, config, commit, resume}; a resumed run gains a line. The commit is read from the checkout's `.git`
files (no `git` process: roles and unit tests start none), and is `None` outside a checkout.

`RunInfo` is what the report says about the run: its title line, and why its held-out panel
may be empty (evaluation off, or configured but nothing recorded).

A resume the launcher made by itself (launcher/continuation.py) follows its `continued` record;
`RunInfo.resume_labels` names those marks by the continuation and the SLURM state that caused it.

Resumed-at marks (`resume_times`) come from the launcher's `resumed` record in metrics.jsonl,
else from this file; runs older than both still get them: a resumed trainer goes back to its
last checkpoint, so its step numbers fall (`resume_times_from_steps`).
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from tandem.services.protocol import ExpDir

REPO = Path(__file__).resolve().parent.parent
LAUNCHES = "launches.jsonl"


def _git_dir(repo: Path) -> Path | None:
    dot = repo / ".git"
    if dot.is_file():   # a worktree or submodule: "gitdir: <path>"
        text = dot.read_text().strip()
        if text.startswith("gitdir:"):
            target = Path(text.split(":", 1)[1].strip())
            return target if target.is_absolute() else (repo / target).resolve()
        return None
    return dot if dot.is_dir() else None


def git_commit(repo: Path = REPO) -> str | None:
    """The commit HEAD names, from the `.git` files; None when `repo` is not a checkout."""
    try:
        gd = _git_dir(repo)
        if gd is None:
            return None
        head = (gd / "HEAD").read_text().strip()
        if not head.startswith("ref:"):
            return head or None
        ref = head.split(":", 1)[1].strip()
        common = gd / "commondir"   # worktrees keep refs in the main repository
        roots = [gd] + ([(gd / common.read_text().strip()).resolve()] if common.exists() else [])
        for root in roots:
            if (root / ref).exists():
                return (root / ref).read_text().strip()
            packed = root / "packed-refs"
            if packed.exists():
                for line in packed.read_text().splitlines():
                    if line.endswith(" " + ref):
                        return line.split()[0]
    except OSError:
        return None
    return None


def record_launch(exp_root: str | os.PathLike, config_file: str | None, resume: bool) -> dict:
    """Append this launch to `<exp>/launches.jsonl` (called where the run's config is saved)."""
    entry = {"time": time.time(), "config": str(config_file) if config_file else None,
             "commit": git_commit(), "resume": bool(resume)}
    with (Path(exp_root) / LAUNCHES).open("a") as f:
        f.write(json.dumps(entry) + "\n")
    return entry


def read_launches(exp_root: str | os.PathLike) -> list[dict]:
    """The launches recorded for a run, oldest first; [] for a run made before they were."""
    try:
        lines = (Path(exp_root) / LAUNCHES).read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict) and isinstance(rec.get("time"), int | float):
            out.append(rec)
    return out


def resume_times_from_steps(records: list[dict]) -> list[float]:
    """When each resumed launch's trainer started, from its step records: a resumed trainer
    trains again from its checkpoint, so its first step number is not above the last one
    logged; its start is that record's time less the step's seconds."""
    out, last = [], None
    for r in records:
        if r.get("role") != "trainer" or r.get("event") != "step" or r.get("step") is None:
            continue
        if last is not None and r["step"] <= last:
            out.append(r["time"] - r.get("step_s", 0.0))
        last = r["step"]
    return out


def resume_times(exp_root: str | os.PathLike, records: list[dict]) -> list[float]:
    """Wall-clock times the run was resumed at, from the first source that has them: the
    launcher's `resumed` records in the metrics (where the summary's figures of a launch start),
    the launches file, the trainer's step numbers."""
    logged = [r.get("resumed_at", r["time"]) for r in records if r.get("event") == "resumed" and "time" in r]
    launched = [r["time"] for r in read_launches(exp_root) if r.get("resume")]
    return sorted(logged or launched) or resume_times_from_steps(records)


@dataclass
class RunInfo:
    """What the report says about the run itself, and what its empty panels are explained by."""
    name: str
    config_file: str | None = None
    started: float | None = None
    commit: str | None = None
    eval_size: int | None = None        # rollout.eval_size, rollout.eval_every (None: no config.yaml)
    eval_every: int | None = None
    reward_range: tuple[float, float] | None = None   # (wrong_reward, correct_reward)
    resumes: list[float] = field(default_factory=list)   # wall-clock times
    # The launcher's own continuations: {time, attempt, cause, role} of each `continued` record.
    continued: list[dict] = field(default_factory=list)
    # Generation servers that joined or left the run (`tandem scale`, the elastic split): {time, label}.
    server_changes: list[dict] = field(default_factory=list)

    def resume_labels(self) -> list[str]:
        """A label for each resume: "resumed", or "continued #k: CAUSE" for one the launcher
        made by itself (its `continued` record falls after the resume before it; k counts the
        run's continuations, whichever launcher made them)."""
        out, before = [], -float("inf")
        for t in self.resumes:
            made = [c for c in self.continued if before < c["time"] <= t]
            out.append(f"continued #{self.continued.index(made[-1]) + 1}: {made[-1].get('cause')}" if made
                       else "resumed")
            before = t
        return out

    def title(self) -> str:
        return f"Tandem run {self.name}"

    def subtitle(self) -> str:
        date = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(self.started)) if self.started else "unknown"
        return (f"config: {self.config_file or 'not recorded'} · started: {date} · commit: "
                f"{self.commit[:12] if self.commit else 'not recorded'}"
                + (f" · resumed {len(self.resumes)}x" if self.resumes else "")
                + (f" ({len(self.continued)} by the launcher itself)" if self.continued else ""))

    def why_no_held_out(self) -> str:
        if self.eval_size is None:
            return "no held-out evaluation recorded (the run's config.yaml is missing)"
        if not self.eval_size and not self.eval_every:
            return "no held-out curve: evaluation off (rollout.eval_size and rollout.eval_every are 0)"
        return (f"no held-out evaluation recorded (rollout.eval_size: {self.eval_size}, eval_every: "
                f"{self.eval_every}): did the evaluation fail? see the run's logs/")


def run_info(exp: ExpDir, records: list[dict]) -> RunInfo:
    """The run's name and settings from its `config.yaml` (read as plain YAML: a report must
    draw even a run whose config an older or newer Tandem wrote), its launches, its records."""
    try:
        cfg = yaml.safe_load(exp.config.read_text()) or {}
    except (OSError, yaml.YAMLError):
        cfg = {}
    ex, ro, rw = (cfg.get(k) or {} for k in ("experiment", "rollout", "reward"))
    launches = read_launches(exp.root)
    first = launches[0] if launches else {}
    times = [r["time"] for r in records if isinstance(r.get("time"), int | float) and r["time"] > 0]
    reward = (rw.get("wrong_reward"), rw.get("correct_reward"))
    return RunInfo(name=ex.get("name") or exp.root.name, config_file=first.get("config"),
                   started=first.get("time") or (min(times) if times else None), commit=first.get("commit"),
                   eval_size=int(ro.get("eval_size") or 0) if cfg else None,
                   eval_every=int(ro.get("eval_every") or 0) if cfg else None,
                   reward_range=tuple(sorted(reward)) if None not in reward else None,
                   resumes=resume_times(exp.root, records),
                   continued=[{"time": r["time"], "attempt": r.get("attempt"), "cause": r.get("cause"),
                               "role": r.get("failed_role")}
                              for r in records if r.get("event") == "continued" and "time" in r],
                   server_changes=server_changes(records))


def server_changes(records: list[dict]) -> list[dict]:
    """{time, step, label} of each generation server that joined or left the run: `tandem scale`'s
    `scale` records (launcher/scaling.py) and the elastic split's moves, those that were made."""
    out = []
    for r in records:
        if r.get("role") != "launcher" or not r.get("ok") or "time" not in r:
            continue
        if r.get("event") == "scale":
            out.append({"time": r["time"], "step": r.get("step"),
                        "label": f"{r.get('server')} {'joined' if r.get('op') == 'add' else 'left'}"})
        elif r.get("event") == "elastic_move":
            out.append({"time": r["time"], "step": r.get("step"),
                        "label": f"{r.get('server')} {'left' if r.get('direction') == 'to_train' else 'joined'} "
                                 f"(elastic)"})
    return out
