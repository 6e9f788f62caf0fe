"""The elastic split's decision rule: whether to move GPUs between generation and training, and where.

One rule, called by both sides so they agree: the runtime (the launcher's elastic loop, which
measures the rates every `launcher.elastic_every_steps` training steps and asks the simulator
what the other splits would do) and the simulator's prediction of the gain before the run
(`launcher/simulate/elastic.py`, which replays the decisions on simulated phases).

The splits are a sequence ordered by the generation side's share, one unit apart (on a cluster
one node; in the CPU miniature one generation server's CPUs). Given the current split and
predicted speeds of the candidates (any rate where higher is faster: steps per second or per
hour, the same unit for all), the rule is:

1. Find the fastest candidate. If it is not faster than the current split by more than
   `min_gain` (a fraction: 0.15 = 15%), stay. Why a threshold: a move is not free (a server
   drains or is interrupted and restarts, the trainer re-forms its ranks and reloads its
   state), and rates predicted from a few steps' windows err by several percent, so a small
   predicted gain is as likely to be noise as real and would not repay the move.
2. Otherwise move ONE unit towards it: the neighbouring split on that side. Why a neighbour:
   a wrong prediction then costs one unit's worth for one window, and the next decision,
   made on rates measured at the new split, corrects it; a long jump on a bad prediction costs
   many units at once. Repeated decisions still walk to a far optimum, one window per unit.
3. Stay if that neighbour itself is predicted slower than the current split (a valley between
   here and the far optimum): the rule never takes a step it predicts to lose.

Equal speeds never move (a gain of 0 is not more than any min_gain >= 0). The threshold is also
the hysteresis: having moved from A to B because B was predicted faster by more than min_gain,
moving back needs A predicted faster than B by more than min_gain, which the same predictions
cannot say; only new measurements can. There is no extra cool-down: one move per decision,
and decisions are `elastic_every_steps` apart, already bound how often it can move.
"""
from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import TypeVar

S = TypeVar("S", bound=Hashable)


def choose_split(splits: Sequence[S], current: S, speeds: Mapping[S, float | None],
                 min_gain: float) -> S | None:
    """The split to move to (a neighbour of `current` in `splits`), or None to stay.

    `splits`: every candidate, ordered by the generation share, one unit apart. `speeds`: the
    predicted speed of each (higher = faster); a split missing, None or not positive cannot be
    run (the plan refuses it, or it could not be predicted) and is never chosen. With no speed
    for the current split there is nothing to compare against: stay."""
    if min_gain < 0:
        raise ValueError(f"min_gain must be >= 0, got {min_gain}")
    order = list(splits)
    if current not in order:
        raise ValueError(f"current split {current!r} is not one of {order}")
    here = order.index(current)

    def speed(i: int) -> float | None:
        v = speeds.get(order[i])
        return v if v is not None and v > 0 else None

    now = speed(here)
    if now is None:
        return None
    known = [i for i in range(len(order)) if speed(i) is not None]
    # The fastest; among equals the one nearest the current split (no move for a tie).
    best = max(known, key=lambda i: (speed(i), -abs(i - here)))
    if not speed(best) / now - 1 > min_gain:
        return None
    step = here + (1 if best > here else -1)
    neighbour = speed(step)
    if neighbour is None or neighbour < now:
        return None
    return order[step]
