"""docs/agents.md's agent, written out from the page into a project directory of its own, checked
and trained there as the page says (`cd my_project && tandem config check my_agent.yaml &&
tandem run my_agent.yaml`), shortened to two steps on the tiny model.

What it shows that the unit tier cannot: the rollout workers import the user's agent from the
directory the run was launched in and run its episodes against the real generation server and
reward service; each group's prompt is the chat template's rendering of the agent's own
messages (its system prompt, the problem); the held-out evaluation runs the same agent; nothing
is lost. A mistake in `rollout.agent` is named by the check before anything starts.
"""
from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import yaml
from doc_commands import page_files
from local_run import finish, leftovers, steps, tandem

from tandem.launcher.audit import audit
from tandem.rollout.agent_client import render
from tandem.rollout.dataset import load_prompts
from tandem.services.protocol import ExpDir, read_metrics

REPO = Path(__file__).resolve().parents[3]
PAGE = REPO / "docs" / "agents.md"


def test_the_agent_of_the_docs_trains_in_its_own_project(tmp_path, tiny_model_dir):
    from transformers import AutoTokenizer

    files = page_files(PAGE)
    assert set(files) == {"my_project/my_agent.py", "my_project/my_agent.yaml"}, files
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    project = tmp_path / "my_project"
    exp = ExpDir(tmp_path / "run")
    short = [f"experiment.model={tiny_model_dir}", f"experiment.exp_dir={exp.root}", "experiment.trackers=[jsonl]",
             "trainer.total_steps=2", "trainer.groups_per_step=2", "rollout.n_samples=2", "rollout.max_new_tokens=16",
             "rollout.concurrency=4", "rollout.eval_size=4", "rollout.eval_every=0", "trainer.checkpoint_every=2"]

    def check(*extra):
        return subprocess.run([sys.executable, "-m", "tandem.launcher.cli", "config", "check", "my_agent.yaml",
                               *short, *extra], cwd=project, capture_output=True, text=True, timeout=300)

    wrong = check("rollout.agent=my_agent:solv")   # `tandem run` makes the same checks before it starts
    assert wrong.returncode == 2 and "rollout.agent" in wrong.stderr and "no function 'solv'" in wrong.stderr, \
        wrong.stderr

    out = finish(tandem("run", "my_agent.yaml", *short, cwd=project))
    assert "step 2/2" in out, out[-3000:]
    assert [r["step"] for r in steps(exp)] == [1, 2]

    # The workers asked what the agent asked: its own system prompt, then the problem.
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    system = ast.literal_eval(re.search(r'"role": "system", "content": ("[^"]*")', files["my_project/my_agent.py"])[1])
    seed = yaml.safe_load((exp.root / "config.yaml").read_text())["experiment"]["seed"]
    problems = {p.id: p.text for p in load_prompts("synthetic:math", "math", 20000, seed, {}, "", "")}
    groups = read_metrics(exp, "rollout", "group")
    assert len(groups) >= 4
    for g in groups:
        asked = [{"role": "system", "content": system}, {"role": "user", "content": problems[g["prompt_id"]]}]
        assert g["prompt_tokens"] == len(render(tok, asked, None, add_generation_prompt=True)), g
    result = audit(exp)
    assert result.lost == [] and result.trained_twice == [], result.as_dict()
    evaluated = (exp.root / "eval-after.json").read_text()
    assert '"n": 4' in evaluated, evaluated
    assert leftovers(exp) == []
