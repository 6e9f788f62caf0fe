"""What a trainer step record says about the groups it trained: their ids and prompt keys (the
audit follows every group and prompt by them), the answers the reward refused, and, for
multi-turn episodes, how the turns went."""
from __future__ import annotations


def groups_fields(groups) -> dict:
    samples = [t for g in groups for t in g.samples]
    return {"group_ids": [g.group_id for g in groups], "prompt_keys": [g.prompt_key for g in groups],
            # answers the reward scored wrong for hedging, or stopped at a limit
            **{name: int(sum(t.timings.get(key, 0.0) for t in samples))
               for name, key in (("reward_hedged", "hedged"), ("reward_limits_hit", "limit_hit"))},
            **_turn_metrics(samples)}


def _turn_metrics(samples) -> dict:
    """Multi-turn episodes (rollout/code_feedback.py): model turns per sample, and how often the
    first program and the last were right; nothing for single-turn workflows."""
    turned = [t.timings for t in samples if "turns" in t.timings]
    if not turned:
        return {}
    n = len(turned)
    return {"turns_mean": sum(t["turns"] for t in turned) / n,
            "first_turn_correct": sum(t.get("first_turn_correct", 0.0) for t in turned) / n,
            "final_correct": sum(t.get("correct", 0.0) for t in turned) / n}
