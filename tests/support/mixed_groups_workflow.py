"""A rollout workflow for mechanics tests of dynamic sampling (rollout.filter_all_equal) with an
untrained model, which answers every problem wrong (so every group would be all-equal and
filtered): the default workflow, with the grader's rewards replaced by a rule of the group's
ticket. Even ticket numbers (group ids `<epoch>-<seq>`) get one right sample and the rest wrong
(a group with signal, trained); odd ones get all wrong (filtered). Admission hands out
consecutive numbers, so about half the groups are filtered, deterministically.

    rollout.workflow: mixed_groups_workflow:alternating   (tests/support on PYTHONPATH)
"""
from __future__ import annotations

from dataclasses import replace

from tandem.rollout.workflow import EpisodeContext, single_turn
from tandem.services.protocol import Verdict


async def alternating(ctx: EpisodeContext, prompt, ticket):
    mixed = int(ticket.group_id.rsplit("-", 1)[-1]) % 2 == 0

    async def grade(items):
        await ctx.grade(items)   # the real grader still runs (its timings, its failures)
        return [Verdict(reward=5.0 if mixed and i == 0 else -5.0, correct=mixed and i == 0, details={})
                for i in range(len(items))]
    return await single_turn(replace(ctx, grade=grade), prompt, ticket)
