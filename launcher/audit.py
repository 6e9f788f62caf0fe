"""Every group's fate in a run, from `<exp>/metrics.jsonl` and the workers' data positions.

A run that survived faults is only as good as its accounting: a group a worker delivered must
end trained, dropped (over-stale, or generated past the checkpoint a resume went back to),
refused (invalid), still waiting in the trainer's buffer
when the run ended, or returned (the trainer never receipted it, so its prompt is generated
again) — never nowhere (lost) and never twice (trained twice; nor its prompt, under another
group id). The trainer's step records carry the ids (and prompt keys) they trained and dropped
and its last record the ids it still held; the workers'
`group` records the ids they delivered and `unreceipted` records the ids they returned; their
data positions the prompts they gave up on. A worker killed before it could log `unreceipted`
(SIGKILL, or past the launcher's grace) still shows what it returned: its restart issues those
prompts again (rollout/data_position.py), so a group whose worker later delivered the same
prompt (`prompt_index`, per worker) was returned, unless the trainer had it (its receipts were
lost, not the group: the trainer refuses the second by its prompt key, trainer/buffer.py).
`tandem audit --exp DIR` prints it (a verdict, then
each count with what it means; `--json`: the counts as JSON); the fault suite and
`benchmarks/faults.py` assert it.
"""
from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field

from tandem.services.protocol import ExpDir, read_metrics

from .progress import run_steps
from .run_info import server_changes


@dataclass
class Audit:
    delivered: int = 0                  # groups workers reported pushed to the trainer
    trained: int = 0
    dropped: int = 0                    # over-stale, refused or discarded by a resume, their slots given back
    held_at_end: int = 0                # complete or partial in the trainer's buffer at exit
    returned: int = 0                   # never receipted by the trainer: the prompt goes out again
    lost: list[str] = field(default_factory=list)
    trained_twice: list[str] = field(default_factory=list)
    prompts_trained_twice: list[str] = field(default_factory=list)   # prompt keys, under two group ids
    prompts_skipped: int = 0            # prompts workers gave up on after repeated failures
    steps: int = 0
    # Why each dropped group was thrown away ({reason: group count}), and every sample the trainer
    # refused alone before any group (its sender may not send it: trainer/trajectory_check.py).
    drop_reasons: Counter = field(default_factory=Counter)
    samples_refused: list[dict] = field(default_factory=list)
    samples_refused_total: int = 0
    step_times: list[float] = field(default_factory=list)
    delivered_at: dict[str, float] = field(default_factory=dict)   # group id -> when a worker delivered it
    # Generation servers that joined or left during the run (run_info.server_changes): what the
    # counts held through.
    server_changes: list[dict] = field(default_factory=list)

    def max_gap_s(self, after: float | None = None, until: float | None = None, anchored: bool = True) -> float:
        """The longest time between consecutive trained steps (of those from `after` and before
        `until`, if given). `anchored`: counted from the last step before `after`, so the wait
        `after` fell in counts too."""
        times = [t for t in self.step_times if (after is None or t >= after) and (until is None or t < until)]
        if after is not None and anchored:
            before = [t for t in self.step_times if t < after]
            times = before[-1:] + times
        return max((b - a for a, b in zip(times, times[1:], strict=False)), default=0.0)

    def as_dict(self) -> dict:
        return {"steps": self.steps, "delivered": self.delivered, "trained": self.trained,
                "dropped": self.dropped, "held_at_end": self.held_at_end, "returned": self.returned,
                "lost": len(self.lost), "trained_twice": len(self.trained_twice),
                "prompts_trained_twice": len(self.prompts_trained_twice), "prompts_skipped": self.prompts_skipped,
                "samples_refused": self.samples_refused_total, "drop_reasons": dict(self.drop_reasons),
                "max_step_gap_s": round(self.max_gap_s(), 2),
                "server_changes": [f"{c['label']} at step {c['step']}" for c in self.server_changes]}


def audit(exp: ExpDir) -> Audit:
    records = read_metrics(exp)
    steps = run_steps([r for r in records if r.get("role") == "trainer"])
    trained = Counter(gid for r in steps for gid in r.get("group_ids", ()))
    dropped = {gid for r in records if r.get("role") == "trainer" for gid in r.get("dropped_ids", ())}
    exits = [r for r in records if r.get("role") == "trainer" and r.get("event") == "exit"]
    held = set(exits[-1].get("held_ids", ())) if exits else set()
    rollout = [r for r in records if r.get("role") == "rollout"]
    delivered_at = {r["group_id"]: r["time"] for r in rollout if r.get("event") == "group"}
    sent_again = {gid for r in rollout if r.get("event") == "unreceipted" for gid in r["group_ids"]}
    # what the trainer trained or holds was not returned, whatever its worker thought
    kept = set(trained) | held
    returned = (sent_again | _delivered_again(rollout)) - kept
    prompts = Counter(key for r in steps for key in r.get("prompt_keys", ()) if key is not None)
    out = Audit(delivered=len(delivered_at), trained=len(trained), dropped=len(dropped), held_at_end=len(held),
                returned=len(returned), steps=len(steps), step_times=[r["time"] for r in steps],
                delivered_at=delivered_at)
    out.lost = sorted(set(delivered_at) - kept - dropped - returned)
    out.server_changes = server_changes(records)
    thrown = [r for r in records if r.get("role") == "trainer" and r.get("event") in ("thrown_away", "discarded_future")]
    why = {}
    for r in thrown:
        reason = r.get("reason") or "generated past the checkpoint a resume went back to"
        why.update(dict.fromkeys(r.get("group_ids") or r.get("dropped_ids") or (), reason))
        out.samples_refused += r.get("samples", [])
        out.samples_refused_total += r.get("samples_count", 0)
    out.drop_reasons = Counter(why.get(gid, "(reason not recorded)") for gid in dropped)
    out.trained_twice = sorted(g for g, n in trained.items() if n > 1)
    out.prompts_trained_twice = sorted(k for k, n in prompts.items() if n > 1)
    for path in exp.checkpoints.glob("rollout-*.json"):
        out.prompts_skipped += int(json.loads(path.read_text()).get("skipped", 0))
    return out


def _delivered_again(rollout: list[dict]) -> set[str]:
    """Groups whose worker delivered their prompt again later: each delivery of a prompt but
    the last (records without `prompt_index`, from before it was logged, say nothing)."""
    last: dict[tuple, str] = {}
    earlier: set[str] = set()
    for r in rollout:
        if r.get("event") == "group" and r.get("prompt_index") is not None:
            key = (r.get("rank"), r["prompt_index"])
            if key in last:
                earlier.add(last[key])
            last[key] = r["group_id"]
    return earlier


# What each count means, in the order a reader follows a group: (label, key, meaning).
ROWS = (("delivered", "delivered", "groups the rollout workers pushed to the trainer"),
        ("trained", "trained", ""),
        ("dropped", "dropped", "over-stale, refused or past a resumed checkpoint; slots given back"),
        ("held at the end", "held_at_end", "in the trainer's buffer when it exited"),
        ("returned", "returned", "never receipted: their prompts are generated again"),
        ("lost", "lost", "delivered, then nowhere"),
        ("trained twice", "trained_twice", ""),
        ("prompts trained twice", "prompts_trained_twice", "a worker's prompt, under two group ids"),
        ("prompts skipped", "prompts_skipped", "workers gave up on them after repeated failures"),
        ("samples refused", "samples_refused", "refused alone before any group: their sender may not send them"))


def audit_text(exp: ExpDir, result: Audit) -> str:
    """What `tandem audit` prints: a verdict line, one row per count (with what it means),
    the longest gap between steps, and the ids of lost and twice-trained groups."""
    d = result.as_dict()
    bad = [f"{d[k]} {label}" for label, k in (("lost", "lost"), ("trained twice", "trained_twice"),
                                              ("prompts trained twice", "prompts_trained_twice")) if d[k]]
    verdict = ("PROBLEM: " + ", ".join(bad)) if bad else "OK: every delivered group is accounted for"
    lines = [f"audit of {exp.root} ({result.steps} training steps): {verdict}"]
    width = max(len(label) for label, _, _ in ROWS)
    for label, key, meaning in ROWS:
        lines.append(f"  {label:<{width}}  {d[key]:>7,}" + (f"  ({meaning})" if meaning else ""))
    lines.append(f"  {'longest step gap':<{width}}  {d['max_step_gap_s']:>7.2f} s")
    if d["server_changes"]:
        lines.append(f"  {'servers':<{width}}  {', '.join(d['server_changes'])}")
    if result.drop_reasons:
        lines.append("groups dropped, by reason:")
        lines += [f"  {n:>7,}  {reason}" for reason, n in result.drop_reasons.most_common()]
    if result.samples_refused_total:
        lines.append(f"samples refused alone, before any group ({result.samples_refused_total:,}; the first "
                     f"{min(20, len(result.samples_refused))}):")
        lines += [f"  {s['group_id']}/{s['sample_idx']} from {s['sender']}: {s['reason']}"
                  for s in result.samples_refused[:20]]
    if result.lost:
        lines.append(f"lost groups: {' '.join(result.lost[:20])}")
    if result.trained_twice:
        lines.append(f"trained twice: {' '.join(result.trained_twice[:20])}")
    if result.prompts_trained_twice:
        lines.append(f"prompts trained twice: {' '.join(result.prompts_trained_twice[:20])}")
    return "\n".join(lines)


def cmd_audit(args) -> int:
    exp = ExpDir(args.exp)
    result = audit(exp)
    if args.json:
        out = result.as_dict()
        out.update({k: v[:20] for k, v in (("lost_ids", result.lost), ("trained_twice_ids", result.trained_twice),
                                           ("prompts_trained_twice_keys", result.prompts_trained_twice)) if v})
        print(json.dumps(out, indent=1))
    else:
        print(audit_text(exp, result))
    return 1 if result.lost or result.trained_twice or result.prompts_trained_twice else 0


def register(sub) -> None:
    p = sub.add_parser("audit", help="every group's fate in a run: lost, trained twice (or its prompt), prompts skipped")
    p.add_argument("--exp", required=True, help="experiment directory")
    p.add_argument("--json", action="store_true", help="print the counts as one JSON object")
    p.set_defaults(func=cmd_audit)
