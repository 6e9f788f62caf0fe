"""The multi-turn code episode's pieces: the chat template's turn boundaries, the feedback text,
the warm-up's revision conversations, and what the trainer makes of environment tokens."""
from __future__ import annotations

import random

import numpy as np
import pytest

from tandem.rollout.code_feedback import checked_tests, describe_failure, feedback_message, visible_passed
from tandem.rollout.synthetic import CODE_TEMPLATES, code_problem, code_revision
from tandem.rollout.workflow import chat_prompt_ids, next_turn_ids
from tandem.services.protocol import Verdict
from tandem.trainer.batch import StepBatch, sequence_tensors
from tandem.trainer.buffer import Group, validate


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def test_next_turn_after_a_model_turn_that_ended_with_eos(tok):
    user, assistant = tok.convert_tokens_to_ids(["<|user|>", "<|assistant|>"])
    messages = [{"role": "user", "content": "f(1)=3"}, {"role": "assistant", "content": "abc"},
                {"role": "user", "content": "bad"}]
    said = tok.encode("abc", add_special_tokens=False) + [tok.eos_token_id]
    # The tiny template: "<|user|>" + feedback + "<|assistant|>"; EOS was the model's own.
    assert next_turn_ids(tok, messages, said) == [user, *tok.encode("bad", add_special_tokens=False), assistant]
    # The whole context then equals the template's rendering of the conversation.
    prompt = chat_prompt_ids(tok, "f(1)=3")
    assert prompt + said + next_turn_ids(tok, messages, said) == chat_prompt_ids(tok, messages)


def test_next_turn_closes_a_turn_cut_at_max_new_tokens(tok):
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "ab"},
                {"role": "user", "content": "no"}]
    cut = tok.encode("ab", add_special_tokens=False)          # no EOS: the environment adds it
    env = next_turn_ids(tok, messages, cut)
    assert env[0] == tok.eos_token_id
    assert chat_prompt_ids(tok, "q") + cut + env == chat_prompt_ids(tok, messages)


def test_next_turn_refuses_a_conversation_without_the_new_user_turn(tok):
    with pytest.raises(ValueError, match="assistant turn and a new user turn"):
        next_turn_ids(tok, [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], [])


def test_feedback_names_the_first_failing_visible_test():
    visible = {"fn_name": "f", "inputs": [[1], [3], [5]], "outputs": [4, 12, 28]}
    verdict = Verdict(-1.0, False, {"tests": [{"passed": True, "status": "passed"},
                                              {"passed": False, "status": "wrong output", "got": "14", "expected": "12"},
                                              {"passed": False, "status": "wrong output", "got": "9", "expected": "28"}]})
    assert feedback_message(visible, verdict, 300) == "Test failed: f(3) returned 14, expected 12. Fix f."
    crashed = Verdict(-1.0, False, {"tests": [{"passed": False, "status": "exception: NameError: y"}]})
    assert feedback_message(visible, crashed, 300) == "Test failed: f(1) exception: NameError: y, expected 4. Fix f."
    none = Verdict(-1.0, False, {"reason": "no program: no code block"})
    assert feedback_message(visible, none, 300) == "Your answer was not accepted: no program: no code block. Fix it."
    assert len(feedback_message(visible, none, 30)) == 30 and feedback_message(visible, none, 30).endswith("...")


def test_feedback_never_reads_the_hidden_records():
    """A turn's run holds the visible tests first, then hidden ones: a failing hidden test is
    neither shown nor a reason to revise."""
    visible = {"fn_name": "f", "inputs": [[1]], "outputs": [4]}
    hidden_fails = Verdict(-1.0, False, {"tests": [{"passed": True, "status": "passed"},
                                                   {"passed": False, "status": "wrong output", "got": "0"}]})
    assert visible_passed(hidden_fails, 1)
    assert "Your answer was not accepted" in feedback_message(visible, hidden_fails, 300)
    assert not visible_passed(Verdict(-1.0, False, {"reason": "no program"}), 1)


def test_a_turn_runs_the_visible_tests_first_and_each_test_once():
    visible = {"fn_name": "f", "inputs": [[1], [2]], "outputs": [3, 5]}
    hidden = {"fn_name": "f", "inputs": [[1], [2], [7], [9]], "outputs": [3, 5, 15, 19]}
    tests, n = checked_tests(visible, hidden)
    assert n == 2 and tests == {"fn_name": "f", "inputs": [[1], [2], [7], [9]], "outputs": [3, 5, 15, 19]}
    tests, n = checked_tests({"fn_name": "f", "inputs": [[9]], "outputs": [19]}, hidden)
    assert n == 1 and tests["inputs"] == [[9], [1], [2], [7]] and tests["outputs"] == [19, 3, 5, 15]
    assert checked_tests(None, hidden) == (hidden, 0)
    with pytest.raises(ValueError, match="same function"):
        checked_tests({"fn_name": "g", "inputs": [[1]], "outputs": [3]}, hidden)


def test_stdio_feedback_shows_input_expected_and_printed():
    text = describe_failure(None, "3 4\n", "'8'", "7\n")
    assert text == "Test failed on input '3 4\\n': your program printed \"'8'\", expected '7\\n'."


def test_synthetic_code_rows_show_their_visible_points():
    row = code_problem(random.Random(3))
    vis, tests = row["visible_tests"], row["tests"]
    shown = ", ".join(f"f({x[0]})={y}" for x, y in zip(vis["inputs"], vis["outputs"], strict=True))
    assert row["problem"] == shown
    assert tests["inputs"][:3] == vis["inputs"] and len(tests["inputs"]) == 11   # 8 points never shown


def test_revision_conversation_is_consistent():
    """The wrong program really fails where the feedback says, with the value it says."""
    rng = random.Random(0)
    for _ in range(200):
        ex = code_revision(rng, describe_failure)
        user, wrong, said = ex["prompt"]
        assert [m["role"] for m in ex["prompt"]] == ["user", "assistant", "user"]
        feedback = said["content"]
        src = wrong["content"].split("\n")[1]
        ns: dict = {}
        exec(src, ns)
        x = int(feedback.split("f(")[1].split(")")[0])
        got = int(feedback.split("returned ")[1].split(",")[0])
        expected = int(feedback.split("expected ")[1].split(".")[0])
        assert ns["f"](x) == got != expected
        assert f"f({x})={expected}" in user["content"]
        right: dict = {}
        exec(ex["solution"].split("\n")[1], right)
        assert right["f"](x) == expected
    assert len(CODE_TEMPLATES) == 5


def test_environment_tokens_are_never_trained(traj):
    """output_mask 0 tokens are context: out of the loss mask and out of the valid-token count."""
    t = traj("g", 0, group_size=1, out_len=6)
    t.output_mask = np.array([1, 1, 0, 0, 1, 1], np.uint8)
    assert validate(t) is None
    batch = StepBatch.from_groups([Group("g", 0, 0, [t])])
    _, fields = sequence_tensors(batch, 0, 1.0)
    assert fields["loss_mask"].tolist() == [False] * 5 + [True, True, False, False, True, True]
    from tandem.trainer.batch import plan_step
    plan = plan_step(batch, 1, 1000, 1, 0, group_baseline=False, normalize=False)
    assert plan.minibatches[0].n_valid == 4


def test_a_mask_that_does_not_fit_is_refused(traj):
    t = traj("g", 0, group_size=1, out_len=4)
    t.output_mask = np.ones(3, np.uint8)
    assert "3 mask entries" in validate(t)
    t.output_mask = np.zeros(4, np.uint8)
    assert "no model token" in validate(t)
