"""The example reward function trains the tiny model in a real `tandem run` (issue 34): the
shipped math config with `reward.function=examples.custom_reward.reward:score`, every role a
real process, a few short steps. The rewards come from the example, not the built-in grader:
the service counts every item as the user function's, and no group earns less than the
example's floor for a short unboxed answer (-0.8), where the built-in grader gives the untrained
model's wrong answers configs/math-tiny.yaml's wrong_reward, -1."""
from __future__ import annotations

from pathlib import Path

from local_run import finish, leftovers, steps, tandem

from services.protocol import ExpDir, read_metrics, read_service

ROOT = Path(__file__).parents[3]
FLOOR = -0.8   # the example's reward for an answer neither right nor boxed, within its length budget


def test_the_example_reward_function_trains_the_tiny_model(tmp_path, tiny_model_dir):
    exp = ExpDir(tmp_path / "custom")
    out = finish(tandem("run", "configs/math-tiny.yaml", f"experiment.model={tiny_model_dir}",
                        f"experiment.exp_dir={exp.root}", "experiment.trackers=[jsonl]",
                        "reward.function=examples.custom_reward.reward:score",
                        "trainer.total_steps=2", "trainer.groups_per_step=2", "trainer.checkpoint_every=2",
                        "rollout.n_samples=2", "rollout.max_new_tokens=32", "rollout.concurrency=4",
                        "rollout.eval_size=0", "rollout.eval_every=0", cwd=ROOT))
    assert "step 2/2" in out, out[-3000:]
    assert [r["step"] for r in steps(exp)] == [1, 2]
    assert read_service(exp, "reward")["grader"] == "function examples.custom_reward.reward:score"
    last = read_metrics(exp, "reward", "reward")[-1]      # the service's counts at shutdown
    assert last["graded"] > 0 and last["user_graded"] == last["graded"] and last["user_refused"] == 0, last
    groups = read_metrics(exp, "rollout", "group")
    assert len(groups) >= 4, groups                        # 2 steps x 2 groups trained
    assert all(FLOOR - 1e-9 <= g["reward_mean"] <= 1.0 for g in groups), [g["reward_mean"] for g in groups]
    assert all(FLOOR - 1e-9 <= r["reward_mean"] <= 1.0 for r in steps(exp))
    assert leftovers(exp) == []
