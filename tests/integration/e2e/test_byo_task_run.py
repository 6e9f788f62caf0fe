"""A user's own reward, data and prompts end to end, in one run: `tandem run
configs/math-tiny.yaml` (every role a real process) with the example reward function
(`reward.function=examples.custom_reward.reward:score`), a Parquet training set whose columns
have names of their own, read through `rollout.columns`; a held-out set saved with `datasets`'
`save_to_disk`, read through `rollout.eval_columns`; and a system prompt and template —
docs/running.md's command line ("Bring your own reward, data and prompts"), shortened to two
steps on the tiny model.

What it shows that the unit tier cannot: the rollout workers really load the mapped Parquet rows
(each group's `prompt_id` is the mapped id column); the prompt the generation server was asked
is the chat template's rendering of the system prompt and the templated problem (each group's
`prompt_tokens`, against the tokenizer here); and the rewards come from the example, not the
built-in grader: the service counts every item as the user function's, and no group earns less
than the example's floor for a short unboxed answer (-0.8), where the built-in grader gives the
untrained model's wrong answers configs/math-tiny.yaml's wrong_reward, -1."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from local_run import finish, leftovers, steps, tandem

from tandem.rollout.prompt_template import messages
from tandem.rollout.synthetic import generate
from tandem.rollout.workflow import chat_prompt_ids
from tandem.services.protocol import ExpDir, read_metrics, read_service

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
datasets = pytest.importorskip("datasets")

REPO = Path(__file__).resolve().parents[3]
SYSTEM, TEMPLATE = "Compute the result.", "{prompt} Answer in \\boxed{{}}."
FLOOR = -0.8   # the example's reward for an answer neither right nor boxed, within its length budget


def test_a_run_with_a_reward_function_on_a_mapped_parquet_set_with_a_template(tmp_path, tiny_model_dir):
    from transformers import AutoTokenizer

    rows = [{"uid": f"q{i}", "question": r["prompt"], "final_answer": r["answer"]}
            for i, r in enumerate(generate("math", 200, 7))]
    train = tmp_path / "my-math.parquet"
    pq.write_table(pa.Table.from_pylist(rows), train)
    held_out = tmp_path / "my-math-eval"
    datasets.Dataset.from_list([{"Problem": r["prompt"], "Answer": r["answer"]} for r in generate("math", 6, 99)]) \
        .save_to_disk(str(held_out))
    exp = ExpDir(tmp_path / "run")
    out = finish(tandem(
        "run", "configs/math-tiny.yaml", f"rollout.dataset={train}",
        "rollout.columns={prompt: question, answer: final_answer, id: uid}",
        f"rollout.eval_dataset={held_out}", "rollout.eval_columns={prompt: Problem, answer: Answer}",
        f"rollout.system_prompt={json.dumps(SYSTEM)}", f"rollout.prompt_template={json.dumps(TEMPLATE)}",
        "reward.function=examples.custom_reward.reward:score",
        # the shortening of README's `make train-math` quick run, on the conftest's tiny model
        f"experiment.model={tiny_model_dir}", f"experiment.exp_dir={exp.root}", "experiment.trackers=[jsonl]",
        "trainer.total_steps=2", "trainer.groups_per_step=2", "rollout.n_samples=2", "rollout.max_new_tokens=32",
        "rollout.concurrency=4", "rollout.eval_size=4", "rollout.eval_every=0", "trainer.checkpoint_every=2",
        cwd=REPO))
    assert "step 2/2" in out, out[-3000:]
    assert [r["step"] for r in steps(exp)] == [1, 2]

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    question = {r["uid"]: r["question"] for r in rows}
    groups = read_metrics(exp, "rollout", "group")
    assert len(groups) >= 2
    for g in groups:
        asked = chat_prompt_ids(tok, messages(question[g["prompt_id"]], SYSTEM, TEMPLATE))
        assert g["prompt_tokens"] == len(asked), g
    assert len(asked) > len(chat_prompt_ids(tok, question[g["prompt_id"]])) + len(SYSTEM)

    assert read_service(exp, "reward")["grader"] == "function examples.custom_reward.reward:score"
    last = read_metrics(exp, "reward", "reward")[-1]      # the service's counts at shutdown
    assert last["graded"] > 0 and last["user_graded"] == last["graded"] and last["user_refused"] == 0, last
    assert len(groups) >= 4, groups                        # 2 steps x 2 groups trained
    assert all(FLOOR - 1e-9 <= g["reward_mean"] <= 1.0 for g in groups), [g["reward_mean"] for g in groups]
    assert all(FLOOR - 1e-9 <= r["reward_mean"] <= 1.0 for r in steps(exp))

    summary = json.loads((exp.root / "summary.json").read_text())
    assert summary["eval"]["n"] == 4 and summary["eval"]["before"] is not None, summary["eval"]
    assert leftovers(exp) == []
