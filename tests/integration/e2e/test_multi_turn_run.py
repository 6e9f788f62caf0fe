"""The multi-turn code episode end to end: `tandem run` with `rollout.workflow:
tandem.rollout.code_feedback:code_with_feedback` on the local backend (every role a real process,
programs run in the reward sandbox). The untrained tiny model never passes the visible tests,
so every sample takes every turn: the trainer's records, the evaluations and the summary must
all say so, and the steps must train on the model's tokens only."""
from __future__ import annotations

from local_run import finish, leftovers, steps, tandem, write_config

from tandem.services.protocol import ExpDir, read_metrics


def test_feedback_episodes_train_and_evaluate_by_turn(tmp_path, tiny_model_dir):
    cfg = write_config(tmp_path / "exp.yaml", tiny_model_dir, "agent")
    out = finish(tandem("run", cfg, "rollout.dataset=synthetic:code", "reward.task=code",
                        "rollout.workflow=tandem.rollout.code_feedback:code_with_feedback", "rollout.max_turns=2",
                        "rollout.max_new_tokens=16", "rollout.eval_size=4", "trainer.total_steps=2",
                        "reward.allow_unisolated=true"))
    exp = ExpDir(tmp_path / "agent")
    assert "step 2/2" in out, out[-3000:]
    records = steps(exp)
    assert [r["step"] for r in records] == [1, 2]
    groups = {g["group_id"]: g for g in read_metrics(exp, "rollout", "group")}
    for r in records:
        assert r["turns_mean"] == 2.0 and r["first_turn_correct"] == 0.0 and r["final_correct"] == 0.0, r
        # 2 groups x 2 samples, each: turn 1 (<= 16 tokens), the feedback turn, turn 2 (<= 16 tokens):
        # only the model's tokens count as valid; the trajectories hold the feedback too
        outputs = sum(groups[g]["tokens"] for g in r["group_ids"])
        assert r["n_seqs"] == 4 and 0 < r["valid_tokens"] <= 4 * 2 * 16 < outputs, (r["valid_tokens"], outputs)
    evals = read_metrics(exp, event="eval")
    assert {e["tag"] for e in evals} >= {"before", "after"}
    for e in evals:
        assert e["eval_turns_mean"] == 2.0 and e["eval_first_turn_accuracy"] == e["eval_accuracy"] == 0.0
    import json
    summary = json.loads((exp.root / "summary.json").read_text())
    assert summary["eval"]["first_turn_before"] == summary["eval"]["first_turn_after"] == 0.0
    assert summary["rl_s"] > 0
    assert leftovers(exp) == []
