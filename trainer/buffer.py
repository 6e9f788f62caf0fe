"""The replay buffer on trainer rank 0: trajectories in, whole groups out, oldest first, once.

Samples of a group arrive one by one from many workers, in any order, possibly duplicated (a
worker retried a push) or after the group was already trained (a slow worker). A prompt can also
come back as a new group: a worker killed after the trainer receipted a group, but before it
saved that, issues the prompt again (rollout/data_position.py); the buffer trains one group per
prompt (`prompt_key`) and refuses the other, whose slot is given back. A group is
usable only once all its n samples are here, since the group baseline needs all of them. The
step takes the complete groups with the oldest `admit_version` (ties: the group that completed
first), which keeps staleness bounded exactly as the controller's admission rule assumes.

Everything the buffer holds or remembers is in `state_dict()` (trajectories as their wire
encoding), so a checkpoint restores it and a restart neither loses nor re-trains a group.
"""
from __future__ import annotations

import heapq
import logging
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from tandem.services.protocol import ProtocolError, Trajectory, decode, encode
from tandem.trainer.advantages import model_turns

log = logging.getLogger(__name__)


@dataclass
class Group:
    group_id: str
    admit_version: int
    # Completion order: the sequence number of the arrival that completed the group.
    arrival: int
    samples: list[Trajectory]

    @property
    def prompt_key(self) -> str | None:
        return self.samples[0].prompt_key

    def min_output_version(self) -> int:
        mins = [int(t.output_versions.min()) for t in self.samples if len(t.output_versions)]
        return min(mins) if mins else self.admit_version


@dataclass
class TakeResult:
    groups: list[Group]
    # Over-stale groups discarded by stale_policy=drop during this take.
    dropped: list[Group] = field(default_factory=list)
    # Over-stale groups trained anyway (stale_policy=train).
    over_stale_trained: int = 0


def validate(t: Trajectory, vocab_size: int | None = None, routing: tuple[int, int, int] | None = None
             ) -> str | None:
    """Why a trajectory cannot be trained on, or None when it can (with `vocab_size`, also a
    token id the model has no embedding for: it would fail the step, and every resume after).
    `routing` = (layers, top_k, experts) when routing replay is on: the sample must carry its
    routed experts, of that shape and within the experts (a bad id would index out of the
    router's range inside the step)."""
    if t.prompt_key is not None and "\n" in t.prompt_key:
        return "prompt_key must be one line"
    if t.group_size < 1:
        return f"group_size {t.group_size} < 1"
    if not (0 <= t.sample_idx < t.group_size):
        return f"sample_idx {t.sample_idx} outside [0, {t.group_size})"
    n = len(t.output_ids)
    if n == 0:
        return "no output tokens"
    if len(t.prompt_ids) == 0:
        return "no prompt tokens"
    if len(t.output_logprobs) != n or len(t.output_versions) != n:
        return (f"{n} output tokens but {len(t.output_logprobs)} log-probs and "
                f"{len(t.output_versions)} versions")
    if t.output_mask is not None:
        if len(t.output_mask) != n:
            return f"{n} output tokens but {len(t.output_mask)} mask entries"
        if not np.any(t.output_mask):
            return "output_mask leaves no model token to train"
    if t.turn_rewards is not None:
        turns = int(model_turns(t.output_mask, n).max()) + 1
        if len(t.turn_rewards) != turns:
            return f"{len(t.turn_rewards)} turn_rewards for {turns} model turns (runs of output_mask 1)"
        if not np.all(np.isfinite(t.turn_rewards)):
            return "non-finite turn reward"
    if not np.all(np.isfinite(t.output_logprobs)):
        return "non-finite behaviour log-prob"
    if not np.isfinite(t.reward):
        return f"non-finite reward {t.reward}"
    problem = _routing_problem(t, routing)
    if problem:
        return problem
    if vocab_size is not None:
        for name, ids in (("prompt", t.prompt_ids), ("output", t.output_ids)):
            low, high = int(ids.min()), int(ids.max())
            if low < 0 or high >= vocab_size:
                return f"{name} token id {low if low < 0 else high} outside the vocabulary [0, {vocab_size})"
    return None


def _routing_problem(t: Trajectory, routing: tuple[int, int, int] | None) -> str | None:
    r = t.routed_experts
    if r is None:
        return ("the run records routing (trainer.routing_replay or routing_agreement) but the sample has no "
                "routed_experts") if routing else None
    positions = len(t.prompt_ids) + len(t.output_ids) - 1
    if r.ndim != 3 or len(r) != positions:
        return (f"routed_experts of shape {tuple(r.shape)}: expected [{positions}, layers, top_k] "
                f"(every position but the last of {len(t.prompt_ids)} prompt + {len(t.output_ids)} output tokens)")
    if r.dtype.kind not in "ui":
        return f"routed_experts must hold integers, got {r.dtype}"
    if routing is not None:
        layers, top_k, experts = routing
        if r.shape[1:] != (layers, top_k):
            return f"routed_experts has {r.shape[1]} layers x top-{r.shape[2]}; the model routes {layers} x top-{top_k}"
        if r.size and (int(r.min()) < 0 or int(r.max()) >= experts):
            return f"routed_experts names expert {int(r.max())} (or {int(r.min())}); the model has {experts}"
    return None


class ReplayBuffer:
    def __init__(self, vocab_size: int | None = None, routing: tuple[int, int, int] | None = None):
        self.vocab_size = vocab_size   # token ids must be below it (validate)
        self.routing = routing         # (layers, top_k, experts) with routing replay on (validate)
        self._partial: dict[str, dict[int, Trajectory]] = {}
        self._ready: list[tuple[int, int, str]] = []  # heap of (admit_version, arrival, group_id)
        self._groups: dict[str, Group] = {}
        self._consumed: set[str] = set()    # trained, dropped or refused: never again
        self._prompts: dict[str, str] = {}   # prompt key -> the complete group that has it
        self.refused: dict[str, str] = {}   # group id -> why, until the trainer reports them
        self._arrivals = 0
        self.counters: Counter[str] = Counter()

    # ---- intake -------------------------------------------------------------------------------
    def add(self, t: Trajectory) -> bool:
        """Keep a trajectory; False (and counted, never raised) when it is refused.

        An invalid trajectory refuses its whole group (a group trains only whole): the samples
        already here are discarded, later ones are refused, and the group id waits in
        `refused` for the trainer to give its admission slot back to the controller."""
        gid = t.group_id
        if not gid or "\n" in gid:   # no admission ticket is named so, so no slot to give back
            self.counters["rejected_invalid"] += 1
            log.warning("refused trajectory with group id %r: not one non-empty line", gid[:100])
            return False
        if gid in self._consumed or gid in self._groups:
            self.counters["rejected_late_duplicate"] += 1
            log.warning("refused trajectory %s/%s: group already complete, trained or refused", gid,
                        t.sample_idx)
            return False
        samples = self._partial.setdefault(gid, {})
        first = next(iter(samples.values()), None)
        problem = validate(t, self.vocab_size, self.routing)
        if problem is None and first is not None and (first.group_size, first.admit_version, first.prompt_key) \
                != (t.group_size, t.admit_version, t.prompt_key):
            problem = (f"group_size/admit_version/prompt_key differ from its group's ({t.group_size}/"
                       f"{t.admit_version}/{t.prompt_key} vs {first.group_size}/{first.admit_version}/"
                       f"{first.prompt_key})")
        if problem:
            self._refuse(gid, t.sample_idx, problem)
            return False
        if t.sample_idx in samples:
            self.counters["rejected_duplicate"] += 1
            return False
        samples[t.sample_idx] = t
        self._arrivals += 1
        self.counters["received"] += 1
        if len(samples) == t.group_size:
            owner = self._prompts.get(t.prompt_key) if t.prompt_key is not None else None
            if owner is not None:   # checked when complete: a partial group may never be
                self._refuse(gid, t.sample_idx, f"duplicate: prompt {t.prompt_key} is group {owner}'s",
                             counter="refused_duplicate")
                return False
            if t.prompt_key is not None:
                self._prompts[t.prompt_key] = gid
            del self._partial[gid]
            group = Group(gid, t.admit_version, self._arrivals, [samples[i] for i in range(t.group_size)])
            self._groups[gid] = group
            heapq.heappush(self._ready, (group.admit_version, group.arrival, gid))
        return True

    def _refuse(self, gid: str, sample_idx: int, problem: str, counter: str = "rejected_invalid") -> None:
        self._partial.pop(gid, None)
        self._consumed.add(gid)
        self.refused[gid] = problem
        self.counters[counter] += 1
        self.counters["refused_groups"] += 1
        log.warning("refused trajectory %s/%s and its group: %s", gid, sample_idx, problem)

    def discard_future(self, version: int) -> list[str]:
        """Forget groups admitted past `version`: on a resume from a checkpoint at `version`, the
        trajectories logged after it by a launch that went further were generated by policies
        that are no longer in the run's history. Returns the discarded groups' ids."""
        future = {gid for gid, g in self._groups.items() if g.admit_version > version}
        future |= {gid for gid, samples in self._partial.items()
                   if next(iter(samples.values())).admit_version > version}
        self._prompts = {key: gid for key, gid in self._prompts.items() if gid not in future}
        for gid in future:
            self._groups.pop(gid, None)
            self._partial.pop(gid, None)
            self._consumed.add(gid)
        self._ready = [entry for entry in self._ready if entry[2] not in future]
        heapq.heapify(self._ready)
        self.counters["discarded_future"] += len(future)
        return sorted(future)

    def take_refused(self) -> dict[str, str]:
        """Groups refused since the last call, with why: their slots are to be given back."""
        refused, self.refused = self.refused, {}
        return refused

    # ---- output -------------------------------------------------------------------------------
    @property
    def n_ready(self) -> int:
        return len(self._ready)

    @property
    def n_consumed(self) -> int:
        """Groups trained, dropped or refused (each counted once, ever)."""
        return len(self._consumed)

    @property
    def n_trained(self) -> int:
        """Groups handed out for training (each once, ever): with the ready ones, what holds an
        admission slot — dropped and refused groups gave theirs back."""
        return self.counters["taken"]

    @property
    def n_partial(self) -> int:
        return len(self._partial)

    def held_ids(self) -> list[str]:
        """Groups here, complete or partial, not yet trained."""
        return sorted(set(self._groups) | set(self._partial))

    def peek_order(self) -> list[str]:
        """Group ids in the order `take` would hand them out."""
        return [g for _, _, g in sorted(self._ready)]

    def take(self, n: int, version: int, max_staleness: int, stale_policy: str = "train"
             ) -> TakeResult:
        """The n oldest complete groups for a step at policy `version`; `groups` is empty (and
        nothing is taken) when fewer than n usable groups are ready. Over-stale groups (version - admit_version >
        max_staleness) are dropped or kept per `stale_policy`, and counted either way."""
        if stale_policy not in ("train", "drop"):
            raise ValueError(f"stale_policy must be 'train' or 'drop', got {stale_policy!r}")
        result = TakeResult(groups=[])
        if stale_policy == "drop":
            while self._ready and version - self._ready[0][0] > max_staleness:
                _, _, gid = heapq.heappop(self._ready)
                group = self._groups.pop(gid)
                self._consumed.add(gid)
                result.dropped.append(group)
            self.counters["dropped_stale"] += len(result.dropped)
            if result.dropped:
                log.warning("dropped %d groups staler than eta=%d at version %d", len(result.dropped),
                            max_staleness, version)
        if len(self._ready) < n:
            return result
        for _ in range(n):
            _, _, gid = heapq.heappop(self._ready)
            group = self._groups.pop(gid)
            self._consumed.add(gid)
            result.groups.append(group)
            if version - group.admit_version > max_staleness:
                result.over_stale_trained += 1
        self.counters["trained_over_stale"] += result.over_stale_trained
        self.counters["taken"] += n
        return result

    # ---- persistence --------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Plain Python/bytes only (safe for `torch.save(weights_only=True)` and msgpack). What
        grows with the run (every group id consumed, every prompt key) is kept as one string of
        lines: a million ids as a list took 2.9 s to load with `weights_only` and the prompt keys
        as a dict 6.3 s more; as strings, 0.2 s together (and faster to save)."""
        ready = [{"group_id": g.group_id, "admit_version": g.admit_version, "arrival": g.arrival,
                  "samples": [encode(t) for t in g.samples]} for g in self._groups.values()]
        partial = [encode(t) for samples in self._partial.values() for t in samples.values()]
        return {"ready": ready, "partial": partial, "consumed": "\n".join(self._consumed),
                "refused": dict(self.refused), "prompt_keys": "\n".join(self._prompts),
                "prompt_groups": "\n".join(self._prompts.values()), "arrivals": self._arrivals,
                "counters": dict(self.counters)}

    def load_state_dict(self, state: dict) -> None:
        self.__init__()
        for g in state["ready"]:
            samples = [_decode_trajectory(b) for b in g["samples"]]
            group = Group(g["group_id"], g["admit_version"], g["arrival"], samples)
            self._groups[group.group_id] = group
            heapq.heappush(self._ready, (group.admit_version, group.arrival, group.group_id))
        for b in state["partial"]:
            t = _decode_trajectory(b)
            self._partial.setdefault(t.group_id, {})[t.sample_idx] = t
        self._consumed = set(_lines(state["consumed"]))
        self.refused = dict(state.get("refused", {}))
        self._prompts = dict(zip(_lines(state.get("prompt_keys", "")), _lines(state.get("prompt_groups", "")),
                                 strict=True))
        self._arrivals = int(state["arrivals"])
        self.counters = Counter(state["counters"])


def _lines(value: str | list[str]) -> list[str]:
    """A state_dict string of lines back as a list (checkpoints before it held lists)."""
    if isinstance(value, list):
        return value
    return value.split("\n") if value else []


def _decode_trajectory(frame: bytes) -> Trajectory:
    msg = decode(frame)
    if isinstance(msg, ProtocolError) or not isinstance(msg.body, Trajectory):
        raise ValueError(f"checkpointed buffer holds an undecodable trajectory: {msg}")
    return msg.body
