"""A prompt whose group the trainer received, but whose worker never saved that, trains once.

A rollout worker settles a prompt when the trainer's receipts arrive and saves it at once
(rollout/data_position.py); SIGKILLed between the two, its restart issues the prompt again as a
new group. The fault suite meets that window by chance (twice in 32 runs once); here it is
made certain: after a real `tandem run`, the worker's saved position is put back six prompts,
as a kill before those saves would have left it, and the run is resumed. Every role is a real
process; the trainer refuses each group sent again by its prompt key (trainer/buffer.py), and
`tandem audit` finds no prompt trained twice.
"""
from __future__ import annotations

import json

from local_run import finish, leftovers, steps, tandem, write_config

from tandem.launcher.audit import audit
from tandem.services.protocol import ExpDir, read_metrics


def test_a_prompt_sent_again_after_its_receipts_were_lost_is_refused(tmp_path, tiny_model_dir):
    cfg = write_config(tmp_path / "exp.yaml", tiny_model_dir, "again")
    out = finish(tandem("run", cfg))
    assert "step 4/4" in out, out[-3000:]
    exp = ExpDir(tmp_path / "again")
    saved = exp.checkpoints / "rollout-0.json"
    position = json.loads(saved.read_text())["position"]
    back = max(0, position - 6)
    saved.write_text(json.dumps({"position": back, "settled_ahead": [], "skipped": 0}))
    # The trainer resumes holding the first launch's extra groups, up to B x (eta + 1) = 6: three
    # steps' worth. Three more steps need new groups, and the worker's first are the six prompts
    # sent again, so those reach the trainer before the run can end. (Resumed to 7 steps, the
    # held groups alone finished it once, the six arriving after the trainer's exit: returned,
    # none refused.)
    out = finish(tandem("run", cfg, "--resume", "trainer.total_steps=10"))
    assert "step 10/10" in out, out[-3000:]
    # (not the last step's time: the first launch's worker delivers groups after it)
    resumed_at = read_metrics(exp, "launcher", "resumed")[-1]["resumed_at"]
    again = [r["group_id"] for r in read_metrics(exp, "rollout", "group")
             if r["time"] > resumed_at and back <= r["prompt_index"] < position]
    assert again, "the resumed worker sent none of the six prompts again"
    dropped = {gid for r in read_metrics(exp, "trainer") for gid in r.get("dropped_ids", ())}
    trained = {gid for r in steps(exp) for gid in r["group_ids"]}
    assert not set(again) & trained, again
    # refused, their slots given back (one still on the wire when the run ends is returned)
    assert set(again) & dropped, (again, dropped)
    result = audit(exp)
    assert (result.prompts_trained_twice, result.trained_twice, result.lost) == ([], [], []), result.as_dict()
    assert leftovers(exp) == []
