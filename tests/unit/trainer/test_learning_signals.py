"""The trainer's watch on whether the run can learn (trainer/learning_signals.py): steps whose
groups all had equal rewards, groups rejected in a row with the cap that stops the run or goes
on. The controller's side is the real admission ledger; what the trainer would get over its
socket (a status reply with the ledger's counters) is read from it directly, since a unit test
opens no socket. The records go to a real metrics.jsonl."""
from __future__ import annotations

import pytest

from tandem.services.controller.admission import AdmissionLedger
from tandem.services.protocol import MetricsWriter, read_metrics
from tandem.trainer.buffer import Group
from tandem.trainer.learning_signals import LearningSignals, SignalsConfig

B = 2


class LedgerStatus:
    """The status the controller answers with (services/controller/server.py: its counters)."""

    def __init__(self, ledger: AdmissionLedger):
        self.ledger = ledger

    def admission(self):
        return self.ledger.counters()


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        self.t += 10.0   # past POLL_S at every reading: each wait polls
        return self.t


def groups(traj, *rewards_per_group):
    return [Group(f"g{i}", 0, i, [traj(f"g{i}", j, len(rs), reward=r) for j, r in enumerate(rs)])
            for i, rs in enumerate(rewards_per_group)]


def warnings(exp):
    return [r for r in read_metrics(exp, "trainer") if r.get("event") == "warning"]


@pytest.fixture
def ledger():
    return AdmissionLedger(B, max_staleness=100, max_concurrent=1000)


def finish(ledger, *statuses):
    for gid, _ in ledger.admit("w", len(statuses), 0.0)[0]:
        ledger.finish("w", gid, statuses[0], 0.0)
        statuses = statuses[1:]


def test_steps_without_reward_signal_warn_every_n_in_a_row(exp, traj, ledger):
    signals = LearningSignals(SignalsConfig(no_signal_steps=2), B, MetricsWriter(exp, "trainer"), filtering=False)
    link = LedgerStatus(ledger)
    flat, mixed = groups(traj, [-5, -5], [5, 5]), groups(traj, [-5, 5], [-5, -5])
    fields = []
    for step, g in enumerate([flat, flat, flat, flat, mixed, flat], 1):
        fields.append(signals.step_fields(g, step, link))
        if step == 2:
            assert warnings(exp) == []    # written after the step's record, by flush()
        signals.flush()
    assert [f["no_signal_steps"] for f in fields] == [1, 2, 3, 4, 0, 1]
    assert [f["signal_groups"] for f in fields] == [0, 0, 0, 0, 1, 0]
    said = warnings(exp)
    assert [(w["kind"], w["step"], w["count"]) for w in said] == [("no_reward_signal", 2, 2), ("no_reward_signal", 4, 4)]
    assert said[0]["message"].startswith("no reward signal for 2 steps: every trained group's samples got the "
                                         "same reward (this step: -5, 5)")


def test_groups_filtered_in_a_row_warn_then_stop_the_run_at_the_cap(exp, traj, ledger):
    cfg = SignalsConfig(filtered_warn_batches=1, max_filtered_batches=3)
    signals = LearningSignals(cfg, B, MetricsWriter(exp, "trainer"), filtering=True, clock=Clock())
    link = LedgerStatus(ledger)
    finish(ledger, "rejected")
    assert not signals.should_stop(0, link) and warnings(exp) == []
    finish(ledger, "rejected", "rejected", "rejected")     # 4 in a row: past 1 batch of 2, short of 3
    assert not signals.should_stop(0, link)
    assert [w["kind"] for w in warnings(exp)] == ["rejected_in_a_row"]
    assert warnings(exp)[0]["message"].startswith("dynamic sampling (rollout.filter_all_equal) dropped 4 groups in "
                                                  "a row")
    assert "At 6 in a row the run stops" in warnings(exp)[0]["message"]
    finish(ledger, "rejected", "failed", "rejected")       # a failure does not break the run: 6
    assert signals.should_stop(0, link)
    assert "trainer.signals.max_filtered_batches (3 batches of 2 groups): the run stops" in signals.stop_reason
    stopped = [r for r in read_metrics(exp, "trainer") if r.get("event") == "run_stopped"]
    assert [r["reason"] for r in stopped] == [signals.stop_reason]
    assert [w["kind"] for w in warnings(exp)] == ["rejected_in_a_row", "rejected_cap"]
    assert signals.should_stop(0, link) and len(warnings(exp)) == 2    # said once


def test_at_the_cap_continue_goes_on_and_says_so_at_each_multiple(exp, ledger):
    cfg = SignalsConfig(filtered_warn_batches=0, max_filtered_batches=1, on_max_filtered="continue")
    signals = LearningSignals(cfg, B, MetricsWriter(exp, "trainer"), filtering=True, clock=Clock())
    link = LedgerStatus(ledger)
    counts = []
    for _ in range(5):
        finish(ledger, "rejected")
        assert not signals.should_stop(0, link)
        counts.append(len(warnings(exp)))
    assert counts == [0, 1, 1, 2, 2]      # at 2 and 4 in a row: each multiple of the cap once
    finish(ledger, "accepted", "rejected", "rejected")   # a new run of rejections starts from 0
    signals.should_stop(0, link)
    assert len(warnings(exp)) == 3 and "going on (trainer.signals.on_max_filtered: continue)" in \
        warnings(exp)[-1]["message"]


def test_the_step_counts_groups_filtered_since_the_last_step(exp, traj, ledger):
    signals = LearningSignals(SignalsConfig(), B, MetricsWriter(exp, "trainer"), filtering=True)
    link = LedgerStatus(ledger)
    finish(ledger, "rejected", "accepted", "rejected")
    first = signals.step_fields(groups(traj, [1, -1]), 1, link)
    signals.flush()
    finish(ledger, "rejected")
    second = signals.step_fields(groups(traj, [1, -1]), 2, link)
    assert (first["dynamic_filtered_groups"], second["dynamic_filtered_groups"]) == (2, 1)
    assert (first["rejected_in_a_row"], second["rejected_in_a_row"]) == (1, 2)


def test_bad_settings_are_named():
    bad = SignalsConfig(no_signal_steps=-1, on_max_filtered="pause").problems()
    assert [k for k, _ in bad] == ["no_signal_steps", "on_max_filtered"]
