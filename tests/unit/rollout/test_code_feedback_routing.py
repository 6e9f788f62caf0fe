"""Routed experts of a multi-turn code episode (routing replay, rollout/code_feedback.py): each
turn's request fed the whole conversation so far; the trajectory keeps, for every position, the
experts of the first turn that fed it, covers prompt + output - 1 positions whatever the turns,
and an episode stopped after an environment turn gives its trailing (untrained) positions the last
fed position's experts. A turn that came without experts leaves the sample without any."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from tandem.rollout.code_feedback import _Conversation

P = 5   # prompt tokens


def _sample(fed: int, out: int, tag: int):
    """A turn's reply: `out` new tokens; experts of positions [0, fed + out - 1), tagged by turn."""
    experts = np.full((fed + out - 1, 2, 2), tag, dtype=np.int32)
    return SimpleNamespace(output_ids=list(range(out)), output_logprobs=[-1.0] * out, output_versions=[0] * out,
                           finish_reason="stop", routed_experts=experts)


def _env(conv, n):
    conv.ids += [9] * n
    conv.logprobs += [0.0] * n
    conv.versions += [0] * n
    conv.mask += [0] * n


def test_each_position_keeps_the_turn_that_first_fed_it():
    conv = _Conversation([])
    conv.add_model_turn(_sample(P, 4, tag=1), "a")          # positions [0, 8) from turn 1
    _env(conv, 3)
    conv.add_model_turn(_sample(P + 7, 2, tag=2), "b")      # turn 2 fed 12 tokens: [8, 13) are new
    rows = conv.experts(P)
    assert rows.shape == (P + len(conv.ids) - 1, 2, 2)
    assert (rows[:8] == 1).all() and (rows[8:] == 2).all()


def test_trailing_environment_tokens_and_a_turn_without_experts():
    conv = _Conversation([])
    conv.add_model_turn(_sample(P, 4, tag=1), "a")
    _env(conv, 3)                                            # the context limit stopped the episode here
    rows = conv.experts(P)
    assert rows.shape == (P + 7 - 1, 2, 2) and (rows == 1).all()
    plain = SimpleNamespace(**{**vars(_sample(P, 4, tag=1)), "routed_experts": None})
    conv = _Conversation([])
    conv.add_model_turn(plain, "a")
    assert conv.experts(P) is None
