"""Issue 63: a `dapo`-style run on a model that gets every answer wrong admitted 1,745 groups,
trained one step and said nothing. Here dynamic sampling (rollout.filter_all_equal) drops every
group of the untrained tiny model (all its answers are wrong: every group's rewards are equal),
and `tandem run` with every role a real process must warn, then stop at the cap
(trainer.signals.max_filtered_batches, verl's max_num_gen_batches) and say why, with exit
status 1, in its output, summary.json and report."""
from __future__ import annotations

import json

from local_run import finish, leftovers, steps, tandem, write_config

from tandem.services.protocol import ExpDir


def test_groups_dropped_in_a_row_warn_then_stop_the_run_at_the_cap(tmp_path, tiny_model_dir):
    cfg = write_config(tmp_path / "exp.yaml", tiny_model_dir, "cap")   # 2 groups a step
    proc = tandem("run", cfg, "rollout.filter_all_equal=true", "trainer.signals.filtered_warn_batches=1",
                  "trainer.signals.max_filtered_batches=3")
    out = finish(proc)
    exp = ExpDir(tmp_path / "cap")
    assert proc.returncode == 1, out[-3000:]
    assert "warning: dynamic sampling (rollout.filter_all_equal) dropped" in out
    assert "tandem run: the trainer stopped the run after step 0: dynamic sampling (rollout.filter_all_equal) " \
           "dropped" in out and "trainer.signals.max_filtered_batches (3 batches of 2 groups): the run stops" in out
    summary = json.loads((exp.root / "summary.json").read_text())
    assert summary["steps"] == 0 and steps(exp) == []
    assert "the run stops" in summary["stopped"]
    # The warning at 1 batch in a row comes first unless the trainer's first reading (every `2 s`)
    # already finds the cap passed, which a fast machine does.
    kinds = [w["kind"] for w in summary["warnings"]]
    assert kinds in (["rejected_in_a_row", "rejected_cap"], ["rejected_cap"]), kinds
    assert summary["warnings"][0]["count"] >= 2 and summary["warnings"][-1]["count"] >= 6
    assert "stopped early: dynamic sampling" in (exp.report / "report.html").read_text()
    assert leftovers(exp) == []
