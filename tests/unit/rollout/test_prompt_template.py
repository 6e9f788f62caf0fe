"""`rollout.system_prompt` and `rollout.prompt_template`: which templates are refused, and that
training's episodes (single-turn and multi-turn) and the held-out evaluation all ask the model
the same rendered messages through the tokenizer's chat template."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from tandem.rollout.code_feedback import code_with_feedback
from tandem.rollout.dataset import Prompt
from tandem.rollout.prompt_template import messages, render, template_problem
from tandem.rollout.workflow import EpisodeContext, chat_prompt_ids, single_turn
from tandem.services.protocol import Ticket, Verdict

SYSTEM, TEMPLATE = "You are careful.", "Solve: {prompt}\nEnd with \\boxed{{}}."


@pytest.mark.parametrize("template, problem", [
    ("", None),
    ("Q: {prompt}", None),
    ("{prompt} in \\boxed{{}}", None),
    ("Solve the problem.", "must contain {prompt}, where the problem text goes"),
    ("{prompt} in \\boxed{}", "unknown field {}: only {prompt} is filled in; write a literal brace as {{ or }}"),
    ("{prompt} ({answer})", "unknown field {answer}"),
    ("{prompt.upper} {prompt}", "unknown field {prompt.upper}"),
    ("{prompt", "not a format string"),
])
def test_which_templates_are_refused(template, problem):
    got = template_problem(template)
    assert got == problem if problem is None else got.startswith(problem)


def test_the_template_and_system_prompt_make_the_messages():
    assert render("1+1?", TEMPLATE) == "Solve: 1+1?\nEnd with \\boxed{}."
    assert render("a {b}", "") == "a {b}"               # no template: braces in a problem are text
    assert render("a {b}", "<{prompt}>") == "<a {b}>"  # the problem is inserted, never formatted
    assert messages("1+1?", SYSTEM, TEMPLATE) == [{"role": "system", "content": SYSTEM},
                                                  {"role": "user", "content": "Solve: 1+1?\nEnd with \\boxed{}."}]
    assert messages("1+1?") == [{"role": "user", "content": "1+1?"}]


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def _rendered(tok, conversation: list[dict], add_generation_prompt: bool) -> list[int]:
    """The chat template's token ids, straight from the tokenizer."""
    out = tok.apply_chat_template(conversation, tokenize=True, add_generation_prompt=add_generation_prompt)
    return list(out if isinstance(out, list) else out["input_ids"])


def _expected_ids(tok, text: str) -> list[int]:
    return _rendered(tok, messages(text, SYSTEM, TEMPLATE), add_generation_prompt=True)


class _Generator:
    """Records the prompt ids it is asked; answers with fixed tokens."""

    def __init__(self, tok, answer: str = "x"):
        self.asked: list[list[int]] = []
        self.ids = tok.encode(answer, add_special_tokens=False) + [tok.eos_token_id]

    async def generate(self, prompt_ids, params, key):
        self.asked.append(list(prompt_ids))
        return SimpleNamespace(output_ids=self.ids, output_logprobs=[0.0] * len(self.ids),
                               output_versions=[0] * len(self.ids), finish_reason="stop")


def test_a_training_episode_asks_the_templated_problem_with_the_system_prompt(tok):
    gen = _Generator(tok)

    async def grade(items):
        return [Verdict(1.0, True, {}) for _ in items]

    ctx = EpisodeContext(generate=gen.generate, grade=grade, tokenizer=tok, n_samples=2, sampling_params={})
    prompt = Prompt("p", "1+1?", "math", {"answer": "2"}, system=SYSTEM, template=TEMPLATE)
    trajs = asyncio.run(single_turn(ctx, prompt, Ticket(group_id="g", admit_version=0)))
    assert gen.asked == [_expected_ids(tok, "1+1?")] * 2
    assert trajs[0].prompt_ids.tolist() == _expected_ids(tok, "1+1?")
    assert gen.asked[0] != chat_prompt_ids(tok, "1+1?")        # the template and system prompt changed it


def test_a_multi_turn_episode_keeps_the_system_prompt_in_its_conversation(tok):
    """The whole context (prompt, model turn, feedback turn, model turn) is what the chat template
    renders of the conversation that starts with the system prompt and the templated problem."""
    gen = _Generator(tok, "def f(x): return x")
    verdicts = iter([Verdict(-1.0, False, {"tests": [{"passed": False, "status": "wrong output", "got": "1"}]}),
                     Verdict(1.0, True, {"tests": [{"passed": True, "status": "passed"}]})])

    async def grade(items):
        return [next(verdicts) for _ in items]

    tests = {"fn_name": "f", "inputs": [[1]], "outputs": [2]}
    ctx = EpisodeContext(generate=gen.generate, grade=grade, tokenizer=tok, n_samples=1, sampling_params={},
                         max_turns=2)
    prompt = Prompt("c", "f(1)=2", "code", {"tests": tests, "visible_tests": tests}, system=SYSTEM, template=TEMPLATE)
    (traj,) = asyncio.run(code_with_feedback(ctx, prompt, Ticket(group_id="g", admit_version=0)))
    assert traj.timings["turns"] == 2 and gen.asked[0] == _expected_ids(tok, "f(1)=2")
    answer = "def f(x): return x"
    conversation = [*messages("f(1)=2", SYSTEM, TEMPLATE), {"role": "assistant", "content": answer},
                    {"role": "user", "content": "Test failed: f(1) returned 1, expected 2. Fix f."},
                    {"role": "assistant", "content": answer}]
    assert traj.prompt_ids.tolist() + traj.output_ids.tolist() == _rendered(tok, conversation, False)


def test_the_held_out_evaluation_asks_as_training_does(tok):
    from tandem.rollout.evaluation import evaluate_prompts
    from tandem.rollout.workflow import DEFAULT_WORKFLOW

    gen = _Generator(tok, "\\boxed{2}")

    class Reward:
        async def request(self, req):
            return SimpleNamespace(verdicts=[Verdict(1.0, True, {}) for _ in req.items])

    cfg = SimpleNamespace(rollout=SimpleNamespace(workflow=DEFAULT_WORKFLOW, agent="", max_new_tokens=8),
                          experiment=SimpleNamespace(model="unused"))
    prompts = [Prompt(str(i), f"{i}+{i}?", "math", {"answer": str(2 * i)}, system=SYSTEM, template=TEMPLATE)
               for i in range(3)]
    result = asyncio.run(evaluate_prompts(cfg, prompts, gen, Reward(), tokenizer=tok))
    assert result["n"] == 3
    assert sorted(gen.asked) == sorted(_expected_ids(tok, p.text) for p in prompts)
