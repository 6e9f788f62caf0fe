"""Interruption without resubmission: one request held on the server across two weight updates
(`retract` pauses) comes back once, with `weight_versions` spans over three policies, and the
client stamps every token with the version that produced it.

Then the point of exact per-token versions: the trajectory built from that sample carries the
right behaviour version and log-prob on every token, so the trainer's bookkeeping (token
staleness from min(output_versions)) and the decoupled PPO loss (importance weight
exp(logp_prox - logp_behav), 1 exactly where the behaviour policy is the proximal one) see the
truth. Real server, real client, real trainer code; nothing mocked.
"""
from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
import torch
from gen_support import ServerProcess, reference_logprobs

from tandem.rollout.client import GenerationClient, ServerRef
from tandem.rollout.tiny_model import init_tiny
from tandem.services.protocol import Trajectory
from tandem.trainer.batch import StepBatch, sequence_tensors
from tandem.trainer.buffer import Group
from tandem.trainer.loss import PPOSettings, ppo_token_loss

PROMPT = [1, 6, 57, 50, 58, 61]
NEW_TOKENS = 300
TEMPERATURE = 0.8


@pytest.fixture(scope="module")
def policies(tiny_model_dir, tmp_path_factory):
    """Three different weight sets: the served start (v0) and the next two policies."""
    root = tmp_path_factory.mktemp("policies")
    return [tiny_model_dir, init_tiny(root / "p1", seed=11), init_tiny(root / "p2", seed=12)]


@pytest.fixture(scope="module")
def held_sample(policies, tmp_path_factory):
    """(GenerationResult, the server's raw spans check) for one sample held across two updates."""
    srv = ServerProcess(policies[0], tmp_path_factory.mktemp("gen-retract"), api_key="k", admin_key="adm")
    try:
        yield asyncio.run(_generate_across_two_updates(srv, policies))
    finally:
        srv.stop()


def _generated_tokens(api) -> int:
    return api.get("/server_info")[1]["internal_states"][0]["generated_tokens"]


def _wait_tokens(api, at_least: int) -> None:
    base = _generated_tokens(api)
    deadline = time.monotonic() + 60
    while _generated_tokens(api) < base + at_least:
        assert time.monotonic() < deadline, "generation did not progress"
        time.sleep(0.02)


async def _generate_across_two_updates(srv, policies):
    async with GenerationClient([ServerRef(srv.url, "k", admin_api_key="adm")]) as client:
        task = asyncio.ensure_future(client.generate(
            PROMPT, {"max_new_tokens": NEW_TOKENS, "temperature": TEMPERATURE, "ignore_eos": True}))
        for version in (1, 2):
            await asyncio.to_thread(_wait_tokens, srv.api, 20)
            assert not task.done(), "the sample finished before the update; make it longer"
            for path, body in (("/pause_generation", {"mode": "retract"}),
                               ("/update_weights_from_disk", {"model_path": str(policies[version]),
                                                              "weight_version": str(version)}),
                               ("/continue_generation", {})):
                status, reply = await asyncio.to_thread(srv.admin.post, path, body)
                assert status == 200, (path, reply)
        return await task


def _segments(versions: list[int]) -> list[tuple[int, int, int]]:
    """(version, start, end) runs of equal versions."""
    out = []
    for i, v in enumerate(versions):
        if out and out[-1][0] == v:
            out[-1][2] = i + 1
        else:
            out.append([v, i, i + 1])
    return [tuple(s) for s in out]


def test_retract_keeps_the_request_and_stamps_each_token(held_sample, policies):
    res = held_sample
    assert res.requests == 1 and res.interruptions == 0, "retract must not return the request to the client"
    assert len(res.output_ids) == NEW_TOKENS and res.finish_reason == "length"
    segs = _segments(res.output_versions)
    assert [v for v, _, _ in segs] == [0, 1, 2], segs
    assert all(end > start for _, start, end in segs)
    # Each segment's log-probs are those of the policy its tokens are stamped with, over the same
    # context: the held request was re-prefilled under the new weights after each update.
    for version, start, end in segs:
        want = reference_logprobs(policies[version], PROMPT + res.output_ids[:start],
                                  res.output_ids[start:end], TEMPERATURE)
        assert res.output_logprobs[start:end] == pytest.approx(want, abs=1e-4), f"segment v{version}"
    # and the policies really differ there (else the check above proves nothing)
    _, start, end = segs[1]
    other = reference_logprobs(policies[0], PROMPT + res.output_ids[:start], res.output_ids[start:end], TEMPERATURE)
    assert max(abs(a - b) for a, b in zip(other, res.output_logprobs[start:end], strict=True)) > 1e-2


def test_decoupled_loss_sees_each_tokens_behaviour_version(held_sample, policies):
    """The trajectory from a sample spanning two updates, as the workflow builds it, through the
    trainer's buffer, batch and loss at step 2 (the proximal policy is policy 2)."""
    res = held_sample
    traj = Trajectory(group_id="g0", sample_idx=0, group_size=1, prompt_ids=np.asarray(PROMPT, np.int32),
                      output_ids=np.asarray(res.output_ids, np.int32),
                      output_logprobs=np.asarray(res.output_logprobs, np.float32),
                      output_versions=np.asarray(res.output_versions, np.int32),
                      admit_version=0, reward=1.0, finish_reason=res.finish_reason, task="math", timings={})
    group = Group(group_id="g0", admit_version=0, arrival=0, samples=[traj])
    step = 2
    # the trainer's token staleness: step - min(output_versions)
    assert step - group.min_output_version() == 2
    batch = StepBatch.from_groups([group])
    ids, fields = sequence_tensors(batch, 0, advantage=1.0)
    n_p = len(PROMPT)
    assert list(ids) == PROMPT + res.output_ids
    assert (fields["versions"][:n_p] == -1).all()
    assert list(fields["versions"][n_p:]) == res.output_versions
    assert np.allclose(fields["behav_logp"][n_p:], res.output_logprobs)
    # the proximal log-probs: policy 2 (the trainer's parameters at step 2) over the whole output
    prox = np.zeros(len(ids), np.float32)
    prox[n_p:] = reference_logprobs(policies[2], PROMPT, res.output_ids, TEMPERATURE)
    segs = _segments(res.output_versions)
    for version, start, end in segs:
        mask = np.zeros(len(ids), bool)
        mask[n_p + start:n_p + end] = True
        _, stats = ppo_token_loss(torch.tensor(prox), torch.tensor(fields["behav_logp"]), torch.tensor(prox),
                                  torch.tensor(fields["advantages"]), torch.tensor(mask),
                                  PPOSettings(use_decoupled_loss=True), n_valid=float(mask.sum()))
        mean_w = stats["imp_weight_sum"] / stats["valid"]
        want_w = np.exp(prox[mask] - np.asarray(
            reference_logprobs(policies[version], PROMPT + res.output_ids[:start], res.output_ids[start:end],
                               TEMPERATURE), np.float32)).mean()
        assert mean_w == pytest.approx(float(want_w), rel=1e-3), f"segment v{version}"
        if version == 2:
            # behaviour policy == proximal policy on these tokens: no correction at all
            assert mean_w == pytest.approx(1.0, abs=1e-3)
            assert stats["imp_weight_max"] == pytest.approx(1.0, abs=1e-3)
        else:
            assert abs(mean_w - 1.0) > 1e-3, f"segment v{version} must be reweighted"
