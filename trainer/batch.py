"""One global step's data: from trained groups to each rank's packed micro-batches.

Rank 0 turns the groups it took from the buffer into a `StepBatch` (plain numpy, cheap to
broadcast), and every rank derives the same plan from it: advantages over the global batch,
`ppo_n_minibatches` minibatches of whole groups, each allocated into micro-batches and dealt to
data-parallel ranks. Every rank computes the identical plan from identical input, so only the
batch itself crosses the network.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from tandem.trainer.advantages import model_turns, sequence_advantages
from tandem.trainer.backend import PackedBatch
from tandem.trainer.buffer import Group
from tandem.trainer.microbatch import allocate_for_ranks, pack
from tandem.trainer.shaping import keep_samples, overlong_penalty


@dataclass
class StepBatch:
    """The sequences of one global step, in group order (groups oldest first)."""
    group_ids: list[str] = field(default_factory=list)
    prompt_ids: list[np.ndarray] = field(default_factory=list)
    output_ids: list[np.ndarray] = field(default_factory=list)
    behav_logp: list[np.ndarray] = field(default_factory=list)
    versions: list[np.ndarray] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    admit_versions: list[int] = field(default_factory=list)
    n_groups: int = 0
    # "stop" (EOS) or "length" (truncated at max_new_tokens), per sequence.
    finish_reasons: list[str] = field(default_factory=list)
    # Per output token: trained (True) or written by the environment (False; multi-turn).
    loss_masks: list[np.ndarray] = field(default_factory=list)
    # Per sequence: the reward of each model turn (multi-turn episodes), or None.
    turn_rewards: list[np.ndarray | None] = field(default_factory=list)
    # Per sequence: the sampler's routed experts [prompt + output - 1, layers, k] (MoE routing
    # replay), or None; kept only when every sequence of the step has them.
    routed_experts: list[np.ndarray | None] = field(default_factory=list)

    @classmethod
    def from_groups(cls, groups: list[Group]) -> StepBatch:
        b = cls(n_groups=len(groups))
        for g in groups:
            for t in g.samples:
                b.group_ids.append(g.group_id)
                b.prompt_ids.append(np.asarray(t.prompt_ids, np.int64))
                b.output_ids.append(np.asarray(t.output_ids, np.int64))
                b.behav_logp.append(np.asarray(t.output_logprobs, np.float32))
                b.versions.append(np.asarray(t.output_versions, np.int64))
                b.rewards.append(float(t.reward))
                b.admit_versions.append(int(g.admit_version))
                b.finish_reasons.append(str(t.finish_reason))
                n = len(t.output_ids)
                b.loss_masks.append(np.ones(n, bool) if t.output_mask is None else np.asarray(t.output_mask, bool))
                b.turn_rewards.append(None if t.turn_rewards is None else np.asarray(t.turn_rewards, np.float64))
                b.routed_experts.append(t.routed_experts)
        if any(r is None for r in b.routed_experts):
            b.routed_experts = [None] * len(b.routed_experts)
        return b

    def __len__(self) -> int:
        return len(self.group_ids)

    def seq_len(self, i: int) -> int:
        return len(self.prompt_ids[i]) + len(self.output_ids[i])


@dataclass
class MinibatchPlan:
    """One optimizer update: this rank's micro-batches and the global valid-token count."""
    micro_batches: list[PackedBatch]
    n_valid: int
    n_seqs: int


@dataclass
class StepPlan:
    minibatches: list[MinibatchPlan]
    # Sequences left out because prompt + output exceeds max_tokens_per_mb.
    too_long: int
    advantages: np.ndarray
    # Data shaping of the step (shaping.py): mean overlong penalty, samples masked as truncated.
    shaping: dict = field(default_factory=dict)
    # Per sequence, per output token (0 on environment tokens); `advantages` is its mean over
    # the sequence's model tokens (the same thing for a single-turn sequence).
    token_advantages: list[np.ndarray] = field(default_factory=list)


@dataclass
class Shaping:
    """How rewards and samples are shaped before advantages (trainer keys of the same names)."""
    leave_one_out: bool = False
    norm_scope: str = "batch"
    norm_std: str = "sample"
    overlong_buffer: int = 0
    overlong_max_len: int = 0
    overlong_penalty: float = 1.0
    mask_truncated: bool = False
    # Credit each model turn of a multi-turn sequence with its own reward (advantages.py).
    turn_credit: bool = True


def token_advantages(batch: StepBatch, rewards, shaping: Shaping, group_baseline: bool, normalize: bool
                     ) -> list[np.ndarray]:
    """Advantages per output token. A sequence is one credit unit with its reward, or, with
    `turn_credit` and `turn_rewards`, one unit per model turn grouped by (prompt group, turn)."""
    keys, unit_rewards, lens, units = [], [], [], []   # units: (sequence, turn or None)
    turns_of: dict[int, np.ndarray] = {}                # sequence -> turn index of each output token
    for i, g in enumerate(batch.group_ids):
        mask, per_turn = batch.loss_masks[i], batch.turn_rewards[i] if shaping.turn_credit else None
        if per_turn is None:
            keys.append(g)
            unit_rewards.append(rewards[i])
            lens.append(int(mask.sum()))
            units.append((i, None))
            continue
        turns = turns_of[i] = model_turns(mask, len(mask))
        for k, r in enumerate(per_turn):
            keys.append((g, k))
            unit_rewards.append(float(r) + rewards[i] - batch.rewards[i])   # + any shaping penalty
            lens.append(int((turns == k).sum()))
            units.append((i, k))
    adv = sequence_advantages(unit_rewards, keys, lens, group_baseline=group_baseline, normalize=normalize,
                              leave_one_out=shaping.leave_one_out, norm_scope=shaping.norm_scope,
                              std=shaping.norm_std)
    out = [np.zeros(len(o), np.float64) for o in batch.output_ids]
    for (i, k), a in zip(units, adv, strict=True):
        if k is None:
            out[i][batch.loss_masks[i]] = a
        else:
            out[i][turns_of[i] == k] = a
    return out


def sequence_tensors(batch: StepBatch, i: int, advantage, keep: bool | None = None
                     ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Tokens of sequence i and its per-token fields, aligned with the tokens (see backend.py)."""
    p, o = batch.prompt_ids[i], batch.output_ids[i]
    n_p, n_o = len(p), len(o)
    ids = np.concatenate([p, o])
    mask = np.zeros(n_p + n_o, dtype=bool)
    mask[n_p:] = batch.loss_masks[i]
    behav = np.zeros(n_p + n_o, dtype=np.float32)
    behav[n_p:] = batch.behav_logp[i]
    adv = np.zeros(n_p + n_o, dtype=np.float32)
    adv[n_p:] = advantage   # a number, or one per output token
    versions = np.full(n_p + n_o, -1, dtype=np.int64)
    versions[n_p:] = batch.versions[i]
    fields = {"loss_mask": mask, "behav_logp": behav, "advantages": adv, "versions": versions}
    if keep is not None:  # masked samples keep their tokens in the denominators, with zero loss
        fields["sample_mask"] = np.full(n_p + n_o, keep, dtype=bool)
    routed = batch.routed_experts[i] if batch.routed_experts else None
    if routed is not None:   # every position but the last, which the sampler never fed (-1: unrouted)
        rows = np.full((n_p + n_o, *routed.shape[1:]), -1, dtype=np.int16)
        rows[:-1] = routed
        fields["routed_experts"] = rows
    return ids, fields


def plan_step(batch: StepBatch, n_minibatches: int, max_tokens: int, dp_size: int, dp_rank: int,
              group_baseline: bool, normalize: bool, shaping: Shaping | None = None) -> StepPlan:
    sh = shaping or Shaping()
    lens = [len(o) for o in batch.output_ids]
    rewards, penalty = batch.rewards, None
    if sh.overlong_buffer > 0:
        penalty = overlong_penalty(lens, sh.overlong_max_len, sh.overlong_buffer, sh.overlong_penalty)
        rewards = (np.asarray(batch.rewards, np.float64) + penalty).tolist()
    tok_adv = token_advantages(batch, rewards, sh, group_baseline, normalize)
    adv = np.array([float(a[m].mean()) if m.any() else 0.0 for a, m in zip(tok_adv, batch.loss_masks, strict=True)])
    keep = keep_samples(batch.finish_reasons, True) if sh.mask_truncated else None
    # Minibatches of whole groups, in order.
    order = list(dict.fromkeys(batch.group_ids))
    per_mb = max(1, -(-len(order) // n_minibatches))
    group_mb = {g: k // per_mb for k, g in enumerate(order)}
    members: list[list[int]] = [[] for _ in range(n_minibatches)]
    too_long = 0
    for i, g in enumerate(batch.group_ids):
        if batch.seq_len(i) > max_tokens:
            too_long += 1
            continue
        members[group_mb[g]].append(i)
    plans = []
    for seqs in members:
        lengths = [batch.seq_len(i) for i in seqs]
        ranks = allocate_for_ranks(lengths, max_tokens, dp_size)
        mbs = []
        for local in ranks[dp_rank]:
            idx = [seqs[k] for k in local]
            tensors = [sequence_tensors(batch, i, tok_adv[i], None if keep is None else bool(keep[i]))
                       for i in idx]
            names = tensors[0][1].keys() if tensors else []
            mbs.append(pack([t[0] for t in tensors], {n: [t[1][n] for t in tensors] for n in names}, idx))
        n_valid = sum(int(batch.loss_masks[i].sum()) for i in seqs)
        plans.append(MinibatchPlan(mbs, n_valid, len(seqs)))
    shaped = {"overlong_penalty_mean": float(penalty.mean()) if penalty is not None and len(penalty) else 0.0,
              "truncated_samples": int(len(keep) - keep.sum()) if keep is not None else
              sum(r != "stop" for r in batch.finish_reasons)}
    return StepPlan(plans, too_long, adv, shaped, tok_adv)
