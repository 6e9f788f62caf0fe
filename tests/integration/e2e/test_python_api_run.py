"""The Python API end to end, from a user's project directory that has its own `reward.py`,
`trainer.py` and `rollout.py` (the natural names; before the package was `tandem.*` they
shadowed Tandem's packages, or were shadowed by them, and the roles crashed at start).

The user's script (run as a real process in that directory, as a user runs one) composes the
experiment with `tandem.Experiment`, names `reward.function: reward:score` (their module),
starts the run in the background, watches `progress()`, stops it after its first step, resumes
it to the end and reads its records. Every role is a real process. The project's `trainer.py`
and `rollout.py` raise when imported: if any role imported them instead of Tandem's own, the run
would fail."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from local_run import leftovers, write_config

from tandem.services.protocol import ExpDir, read_metrics, read_service

REWARD = '''
def score(prompt, response, row):
    """Reward 0.25 for any answer (inside [wrong_reward, correct_reward]); correct when exact."""
    return {"reward": 0.25, "correct": response.strip() == str(row["answer"])}
'''
TRAP = 'raise RuntimeError("the project\'s own {name}.py was imported in place of Tandem\'s {name}")\n'
SCRIPT = '''
import json, sys, time
import tandem

exp = tandem.Experiment(sys.argv[1]).set("reward.function", "reward:score").set("trainer.total_steps", 3)
exp.check()
run = exp.start(output=exp.exp_dir / "launcher-1.out")   # in the run's directory, not made yet
while run.progress()["step"] < 1:
    assert run.running(), "the run ended before its first step"
    time.sleep(0.2)
stopped = run.stop()
first = run.progress()
summary = exp.start(resume=True, output="launcher-2.out").wait()
records = tandem.open_run(exp.exp_dir)
print(json.dumps({"stopped": stopped, "first": first, "summary": summary,
                  "steps": [s["step"] for s in records.steps()], "audit": records.audit().as_dict()}))
'''


def test_a_user_project_with_reward_trainer_and_rollout_modules_runs_through_the_api(tmp_path, tiny_model_dir):
    project = tmp_path / "my_project"
    project.mkdir()
    (project / "reward.py").write_text(REWARD)
    for name in ("trainer", "rollout"):
        (project / f"{name}.py").write_text(TRAP.format(name=name))
    (project / "train.py").write_text(textwrap.dedent(SCRIPT))
    cfg = write_config(project / "exp.yaml", tiny_model_dir, "api-run")
    exp = ExpDir(project / "api-run")

    proc = subprocess.run([sys.executable, "train.py", str(cfg)], cwd=project, capture_output=True, text=True,
                          timeout=600)
    logs = "".join(p.read_text()[-3000:] for p in sorted([*project.glob("launcher-*.out"), *exp.root.glob("*.out")]))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + logs
    out = json.loads(proc.stdout.strip().splitlines()[-1])

    assert out["stopped"] == 130 and out["first"]["step"] >= 1 and not out["first"]["running"], out
    assert "resume" in (exp.root / "launcher-1.out").read_text()   # the stop's hint
    assert out["steps"] == [1, 2, 3] and out["summary"]["steps"] == 3, out
    assert out["audit"]["lost"] == 0 and out["audit"]["trained_twice"] == 0, out["audit"]
    # The rewards are the user's module's: every item graded by it, every group's mean 0.25.
    assert read_service(exp, "reward")["grader"] == "function reward:score"
    # (each launch's reward service counts its own: the resumed one may have had nothing to grade)
    counts = read_metrics(exp, "reward", "reward")
    assert sum(r["graded"] for r in counts) > 0 and all(r["user_graded"] == r["graded"] for r in counts), counts
    assert {g["reward_mean"] for g in read_metrics(exp, "rollout", "group")} == {0.25}
    assert leftovers(exp) == []
