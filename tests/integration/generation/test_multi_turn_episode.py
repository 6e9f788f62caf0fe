"""A real multi-turn code episode whose weights change between its turns.

The embedded server runs as a process; the visible and hidden tests run in the reward sandbox
(rollout/code_feedback.py). Between the first and second model turn the server loads the next
policy from disk (as the controller has it do after a training step). What must reach the
trainer: model tokens trained (mask 1) with the version and behaviour log-prob they were sampled
with — checked against a fresh transformers forward of each policy over the same tokens —
and the environment's feedback tokens as context only (mask 0), exactly the chat template's.
"""
from __future__ import annotations

import asyncio

import numpy as np
import pytest
from gen_support import reference_logprobs

from tandem.rollout.client import GenerationClient, ServerRef
from tandem.rollout.code_feedback import checked_tests, code_with_feedback
from tandem.rollout.dataset import Prompt
from tandem.rollout.workflow import EpisodeContext, chat_prompt_ids
from tandem.services.protocol import Ticket, Trajectory, decode, encode
from tandem.trainer.batch import StepBatch, sequence_tensors
from tandem.trainer.buffer import Group, validate

TEMPERATURE = 1.0
PROBLEM = "f(1)=7, f(2)=9, f(5)=15"
VISIBLE = {"fn_name": "f", "inputs": [[1], [2], [5]], "outputs": [7, 9, 15]}
HIDDEN = {"fn_name": "f", "inputs": [[x] for x in (1, 2, 5, -1, 0, 3, 8)], "outputs": [7, 9, 15, 3, 5, 11, 21]}


def test_episode_spanning_a_weight_update(own_server, model_v1, tiny_model_dir):
    from transformers import AutoTokenizer

    from tandem.reward.code_grader import grade_code
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    info = own_server.api.get("/model_info")[1]
    old_dir, old = info["model_path"], int(info["weight_version"])
    turns: list[list[int]] = []

    async def grade(items):
        return [await asyncio.to_thread(grade_code, it.response, it.tests) for it in items]

    async def run() -> Trajectory:
        async with GenerationClient([ServerRef(own_server.url, own_server.api.api_key)]) as client:
            async def generate(ids, params, key):
                sample = await client.generate(ids, params, key)
                turns.append(list(ids))
                if len(turns) == 1:   # the next policy arrives between turn 1 and turn 2
                    status, reply = await asyncio.to_thread(
                        own_server.api.post, "/update_weights_from_disk",
                        {"model_path": str(model_v1), "weight_version": str(old + 1)})
                    assert status == 200 and reply["success"], reply
                return sample
            ctx = EpisodeContext(generate=generate, grade=grade, tokenizer=tok, n_samples=1,
                                 sampling_params={"temperature": TEMPERATURE, "max_new_tokens": 12,
                                                  "sampling_seed": 3},
                                 max_turns=2)
            prompt = Prompt("p", PROBLEM, "code", {"tests": HIDDEN, "visible_tests": VISIBLE})
            (t,) = await code_with_feedback(ctx, prompt, Ticket("g-1", admit_version=old))
            return t

    t = asyncio.run(run())
    # An untrained model fails the visible tests, so the episode took its second turn.
    assert len(turns) == 2 and t.timings["turns"] == 2
    prompt_ids = chat_prompt_ids(tok, PROBLEM)
    assert t.prompt_ids.tolist() == prompt_ids == turns[0]
    out, mask = t.output_ids.tolist(), t.output_mask.tolist()
    first = mask.index(0)
    second = first + mask[first:].index(1)
    t1, env, t2 = out[:first], out[first:second], out[second:]
    assert mask == [1] * len(t1) + [0] * len(env) + [1] * len(t2) and t1 and t2
    # Turn 2 continued exactly the context the trajectory records.
    assert turns[1] == prompt_ids + t1 + env
    # The environment's tokens are the template's user turn around the feedback text.
    user, assistant = tok.convert_tokens_to_ids(["<|user|>", "<|assistant|>"])
    closing = [] if t1[-1] == tok.eos_token_id else [tok.eos_token_id]
    feedback = tok.decode(env[len(closing) + 1:-1])
    assert env == closing + [user, *tok.encode(feedback, add_special_tokens=False), assistant]
    assert feedback.startswith(("Test failed", "Your answer was not accepted"))
    # Versions and behaviour log-probs: each model turn its own policy's; environment tokens 0.
    versions, logp = t.output_versions.tolist(), t.output_logprobs.tolist()
    assert versions == [old] * (len(t1) + len(env)) + [old + 1] * len(t2)
    assert logp[first:second] == [0.0] * len(env)
    assert logp[:first] == pytest.approx(reference_logprobs(old_dir, prompt_ids, t1, TEMPERATURE), abs=1e-4)
    want = reference_logprobs(model_v1, prompt_ids + t1 + env, t2, TEMPERATURE)
    assert logp[second:] == pytest.approx(want, abs=1e-4)
    stale = reference_logprobs(old_dir, prompt_ids + t1 + env, t2, TEMPERATURE)
    assert max(abs(a - b) for a, b in zip(stale, want, strict=True)) > 1e-2   # the policies differ here
    # Each program's own verdict (what turn credit gives its tokens); the last is the episode's.
    tests, _ = checked_tests(VISIBLE, HIDDEN)
    assert len(t.turn_rewards) == 2 and t.turn_rewards[-1] == t.reward
    assert t.turn_rewards[0] == grade_code(tok.decode(t1, skip_special_tokens=True), tests).reward
    # What the trainer makes of it, after the wire: loss on model tokens only.
    t = decode(encode(t)).body
    assert validate(t) is None
    batch = StepBatch.from_groups([Group("g-1", old, 0, [t])])
    _, fields = sequence_tensors(batch, 0, 1.0)
    assert fields["loss_mask"].tolist() == [False] * len(prompt_ids) + [bool(m) for m in mask]
    assert np.array_equal(fields["versions"][len(prompt_ids):], versions)
