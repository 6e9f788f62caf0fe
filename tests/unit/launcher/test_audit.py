"""`launcher/audit.py` on a metrics stream written as the roles write theirs: each group's fate,
and what `tandem audit` prints (a verdict and the counts in words; `--json`: one JSON object)."""
from __future__ import annotations

import json

from tandem.launcher.audit import audit
from tandem.launcher.cli import main
from tandem.launcher.config import load_config, save_resolved
from tandem.services.protocol import ExpDir, MetricsWriter


def _stream(exp: ExpDir, records: list[tuple[str, dict]]) -> None:
    writers = {role: MetricsWriter(exp, role) for role in {r for r, _ in records}}
    for role, fields in records:
        writers[role].log(**fields)


def _faulty_run(tmp_path) -> ExpDir:
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
    # the CLI reads the run's config, as for every command given --exp
    save_resolved(load_config(None, ["experiment.name=audited", "experiment.model=none",
                                     f"experiment.exp_dir={exp.root}"]), exp.root)
    return exp


def test_every_group_delivered_is_accounted_for_and_the_rest_is_named(tmp_path):
    result = audit(_faulty_run(tmp_path))
    assert result.steps == 3 and result.trained == 4 and result.dropped == 1
    assert result.returned == 1 and result.prompts_trained_twice == []
    assert result.lost == ["g"]                 # delivered, and never trained, dropped, held or returned
    assert result.trained_twice == ["a"]
    assert result.prompts_skipped == 1
    assert result.as_dict()["lost"] == 1


def test_a_group_a_resume_discards_as_from_an_abandoned_launch_is_dropped_not_lost(tmp_path):
    """The trainer SIGKILLed after receipting a group admitted past its last checkpoint: the
    resumed trainer discards it (trainer/buffer.py discard_future) and says so in a record; a run
    of the fault suite once counted such a group lost, with no record of where it went."""
    exp = ExpDir(tmp_path / "exp")
    _stream(exp, [
        *[("rollout", {"event": "group", "group_id": g}) for g in ("a", "b")],
        ("trainer", {"event": "step", "step": 1, "group_ids": ["a"], "dropped_ids": []}),
        ("trainer", {"event": "discarded_future", "version": 1, "dropped_ids": ["b"]}),
        ("trainer", {"event": "exit", "version": 1, "held_ids": []}),
    ])
    result = audit(exp)
    assert result.lost == [] and result.dropped == 1 and result.trained == 1


def test_audit_prints_a_verdict_and_each_count_in_words(tmp_path, capsys):
    exp = _faulty_run(tmp_path)
    assert main(["audit", "--exp", str(exp.root)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"audit of {exp.root} (3 training steps): PROBLEM: 1 lost, 1 trained twice"
    rows = {line[2:22].strip(): line[22:].split() for line in lines[1:] if line.startswith("  ")}
    assert rows["delivered"][0] == "7" and rows["trained"] == ["4"] and rows["lost"][0] == "1"
    assert rows["prompts skipped"][:2] == ["1", "(workers"] and rows["longest step gap"][1] == "s"
    assert lines[-2:] == ["lost groups: g", "trained twice: a"]


def test_audit_json_is_one_object(tmp_path, capsys):
    exp = _faulty_run(tmp_path)
    assert main(["audit", "--exp", str(exp.root), "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out == {**audit(exp).as_dict(), "lost_ids": ["g"], "trained_twice_ids": ["a"]}


def test_a_prompt_delivered_again_marks_its_earlier_group_returned(tmp_path):
    """A worker SIGKILLed (or killed past its drain) cannot log `unreceipted`; its restart
    issuing the same prompt again says the earlier group was never receipted. The prompt index
    is per worker: worker 1's prompt 5 says nothing about worker 0's."""
    exp = ExpDir(tmp_path / "exp")
    w0, w1, trainer = MetricsWriter(exp, "rollout", 0), MetricsWriter(exp, "rollout", 1), MetricsWriter(exp, "trainer")
    w0.log(event="group", group_id="x", prompt_index=5)     # sent; the worker dies with it unreceipted
    w1.log(event="group", group_id="z", prompt_index=6)     # sent; never trained
    w0.log(event="group", group_id="y", prompt_index=5)     # the restarted worker's second try
    w1.log(event="group", group_id="w", prompt_index=5)
    w0.log(event="group", group_id="v", prompt_index=6)
    trainer.log(event="step", step=1, group_ids=["y", "w", "v"], dropped_ids=[])
    trainer.log(event="exit", version=1, held_ids=[])
    result = audit(exp)
    assert result.returned == 1 and result.lost == ["z"] and result.trained == 3


def test_a_prompt_sent_again_after_its_receipts_were_lost(tmp_path):
    """The worker was killed after the trainer receipted group x but before it saved that: its
    restart sends prompt 5 again as y. The trainer refused y by its prompt key (dropped), so x
    was not returned and the prompt trained once; had it trained y too, the audit says so."""
    exp = ExpDir(tmp_path / "exp")
    worker, trainer = MetricsWriter(exp, "rollout", 0), MetricsWriter(exp, "trainer")
    worker.log(event="group", group_id="x", prompt_index=5)
    trainer.log(event="step", step=1, group_ids=["x"], prompt_keys=["0:5"], dropped_ids=[])
    worker.log(event="group", group_id="y", prompt_index=5)
    worker.log(event="group", group_id="z", prompt_index=6)
    trainer.log(event="step", step=2, group_ids=["z"], prompt_keys=["0:6"], dropped_ids=["y"])
    trainer.log(event="exit", version=2, held_ids=[])
    result = audit(exp)
    assert (result.returned, result.dropped, result.lost, result.prompts_trained_twice) == (0, 1, [], [])

    trainer.log(event="step", step=3, group_ids=["y"], prompt_keys=["0:5"], dropped_ids=[])
    result = audit(exp)
    assert result.prompts_trained_twice == ["0:5"] and result.trained_twice == []
    assert result.returned == 0 and result.as_dict()["prompts_trained_twice"] == 1


def test_every_group_and_sample_thrown_away_is_named_with_its_reason(tmp_path, capsys):
    """Groups dropped as over-stale or refused, a resume's discard, and samples the trainer refused
    alone (a sender that may not send them): each listed by reason, the samples one by one."""
    exp = ExpDir(tmp_path / "exp")
    sample = {"group_id": "0-9", "sample_idx": 1, "sender": "rollout-1",
              "reason": "group 0-9 (version 0) was not admitted to rollout-1"}
    _stream(exp, [
        *[("rollout", {"event": "group", "group_id": g}) for g in ("a", "b", "c", "d", "e")],
        ("trainer", {"event": "thrown_away", "group_ids": ["b", "c"], "reason": "staler than eta=1"}),
        ("trainer", {"event": "thrown_away", "group_ids": ["d"],
                     "reason": "refused: output token id 1000000000 outside the vocabulary [0, 100)"}),
        ("trainer", {"event": "thrown_away", "samples": [sample], "samples_count": 3}),
        ("trainer", {"event": "step", "step": 1, "group_ids": ["a"], "dropped_ids": ["b", "c", "d"]}),
        ("trainer", {"event": "discarded_future", "version": 1, "dropped_ids": ["e"]}),
        ("trainer", {"event": "exit", "version": 1, "held_ids": []}),
    ])
    save_resolved(load_config(None, ["experiment.name=audited", "experiment.model=none",
                                     f"experiment.exp_dir={exp.root}"]), exp.root)
    result = audit(exp)
    assert result.lost == [] and result.dropped == 4 and result.samples_refused_total == 3
    assert result.drop_reasons == {"staler than eta=1": 2,
                                   "refused: output token id 1000000000 outside the vocabulary [0, 100)": 1,
                                   "generated past the checkpoint a resume went back to": 1}
    assert main(["audit", "--exp", str(exp.root)]) == 0
    out = capsys.readouterr().out
    assert "groups dropped, by reason:\n        2  staler than eta=1\n" in out
    assert "samples refused alone, before any group (3; the first 1):\n  0-9/1 from rollout-1: group 0-9 " \
           "(version 0) was not admitted to rollout-1" in out
