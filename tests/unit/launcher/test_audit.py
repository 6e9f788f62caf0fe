"""`launcher/audit.py` on a metrics stream written as the roles write theirs: each group's fate."""
from __future__ import annotations

import json

from launcher.audit import audit
from services.protocol import ExpDir, MetricsWriter


def _stream(exp: ExpDir, records: list[tuple[str, dict]]) -> None:
    writers = {role: MetricsWriter(exp, role) for role in {r for r, _ in records}}
    for role, fields in records:
        writers[role].log(**fields)


def test_every_group_delivered_is_accounted_for_and_the_rest_is_named(tmp_path):
    exp = ExpDir(tmp_path / "exp")
    _stream(exp, [
        *[("rollout", {"event": "group", "group_id": g}) for g in ("a", "b", "c", "d", "e", "f", "g")],
        ("trainer", {"event": "step", "step": 1, "group_ids": ["a", "b"], "dropped_ids": []}),
        ("trainer", {"event": "step", "step": 2, "group_ids": ["c"], "dropped_ids": ["d"]}),
        # a resumed trainer trains step 2 again: the abandoned record does not count twice
        ("trainer", {"event": "step", "step": 2, "group_ids": ["c"], "dropped_ids": []}),
        ("trainer", {"event": "step", "step": 3, "group_ids": ["a", "e"], "dropped_ids": []}),
        ("rollout", {"event": "unreceipted", "group_ids": ["f"]}),
        ("trainer", {"event": "exit", "version": 3, "held_ids": []}),
    ])
    (exp.checkpoints).mkdir(parents=True)
    (exp.checkpoints / "rollout-0.json").write_text(json.dumps({"position": 9, "skipped": 1}))
    result = audit(exp)
    assert result.steps == 3 and result.trained == 4 and result.dropped == 1
    assert result.returned == 1 and result.returned_but_trained == 0
    assert result.lost == ["g"]                 # delivered, and never trained, dropped, held or returned
    assert result.trained_twice == ["a"]
    assert result.prompts_skipped == 1
    assert result.as_dict()["lost"] == 1
