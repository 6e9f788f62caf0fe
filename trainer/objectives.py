"""The pieces of the policy objective, one small function each (composed by loss.py).

Notation, per output token t of sequence i (all tensors 1-D, aligned with the packed tokens):
`logp` the current policy (with gradient), `prox` the proximal policy, `behav` the behaviour
policy (the generation server's log-probs), `A` the advantage, `mask` the output tokens.
`seg[t]` is the index of the token's sequence in the micro-batch (sequences are never split
across micro-batches, so every per-sequence quantity below is exact within one micro-batch).
Everything that carries no gradient is detached here, not by the caller.

Bounds (docs/algorithms.md, "Bounds"): every `exp` here takes a log-ratio clamped to
[-bound, bound] first (`trainer.log_ratio_clamp`, 20 as verl v0.7.0 clamps its PPO ratio,
its k3 KL and its rollout importance weights), so no weight or ratio overflows however far the
log-probs drift (a sequence product of 100 tokens at log-ratio 0.6 would be e^60); the KL
estimate itself is clamped to [-kl_clamp, kl_clamp] (`trainer.kl_clamp`, 10 as verl's and
AReaL's KL estimators). Inside the bounds a clamp is the identity, value and gradient alike, so
no ordinary number changes; beyond them the gradient through the clamped quantity is 0 (as in
both sources).
"""
from __future__ import annotations

import torch

from tandem.trainer.presets import (  # noqa: F401  (the settings' names, shared with config checks)
    AGGREGATIONS,
    KL_ESTIMATORS,
    PROXIMAL_MODES,
    RATIO_LEVELS,
    WEIGHT_LEVELS,
    WEIGHT_MODES,
)

# The defaults of trainer.log_ratio_clamp and trainer.kl_clamp (verl v0.7.0,
# verl/trainer/ppo/core_algos.py: kl_penalty_forward, compute_policy_loss_vanilla).
LOG_RATIO_BOUND = 20.0
KL_BOUND = 10.0
# The loss's terms (loss.py), each checked for NaN/inf per micro-batch: the clipped
# policy-gradient term, the KL penalty, the entropy bonus. `nonfinite_<term>` stats count the
# micro-batches; every backend refuses the update on any (backend.py: agreed_nonfinite).
LOSS_TERMS = ("policy", "kl", "entropy")


def bounded_exp(log_ratio: torch.Tensor, bound: float = LOG_RATIO_BOUND) -> torch.Tensor:
    """exp(clamp(log_ratio, -bound, bound)): the only way this module exponentiates a log-ratio."""
    return torch.exp(torch.clamp(log_ratio, -bound, bound))


def segment_ids(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """seg[t] = s for cu_seqlens[s] <= t < cu_seqlens[s+1] (int64), on cu_seqlens's device. Give
    it the packer's host copy and move the result: from a device copy the output's size, which
    only the data knows, would make the host wait for the GPU."""
    cu = cu_seqlens.long()
    lens = cu[1:] - cu[:-1]
    return torch.repeat_interleave(torch.arange(len(lens), device=cu.device), lens)


def segment_sum(values: torch.Tensor, seg: torch.Tensor, n_seqs: int) -> torch.Tensor:
    """out[s] = sum of values[t] over the tokens t of sequence s (differentiable)."""
    return torch.zeros(n_seqs, dtype=values.dtype, device=values.device).index_add(0, seg, values)


def proximal_logp(mode: str, logp: torch.Tensor, behav: torch.Tensor, recomputed: torch.Tensor | None,
                  versions: torch.Tensor | None, version: int, progress: float) -> torch.Tensor:
    """The proximal log-probs `prox` (detached).

    recompute:  prox = log pi_{theta_V}(token), a no-grad forward with the parameters at the start
                of the step (version V), before any update (`recomputed`).
    behaviour:  prox = behav (standard PPO: the trust region is around the behaviour policy).
    loglinear:  log-linear interpolation by policy version, no forward of its own (AReaL's
                approximation). A token sampled at version v_b <= V, trained in update k of the
                step's n (0-based) — whose parameters are treated as the fractional version
                v_theta = V + k/n — gets

                    alpha = (V - v_b) / (v_theta - v_b)                      in [0, 1]
                    prox  = behav + alpha * (sg[logp] - behav)

                i.e. log pi_prox is placed between the behaviour log-prob (at v_b) and the current
                log-prob (at v_theta) in proportion to version distance. In the step's first update
                (k = 0) the current parameters *are* version V, so prox = sg[logp] exactly: the
                value `recompute` would get, without its forward. A token of version V in a later
                update gets alpha = 0: prox = behav (the generator's own version-V log-prob).
    """
    if mode == "recompute":
        if recomputed is None:
            raise ValueError("decoupled PPO needs proximal log-probs (prox_logp); recompute them first")
        return recomputed.detach()
    if mode == "behaviour":
        return behav.detach()
    if mode != "loglinear":
        raise ValueError(f"proximal must be one of {PROXIMAL_MODES}, got {mode!r}")
    current = logp.detach()
    if progress <= 0:
        return current
    if versions is None:
        raise ValueError("proximal: loglinear needs the per-token policy versions (field 'versions')")
    v_b = versions.to(current.dtype)
    alpha = ((version - v_b) / (version + progress - v_b)).clamp(0.0, 1.0)
    return behav.detach() + alpha * (current - behav.detach())


def behaviour_weight(prox: torch.Tensor, behav: torch.Tensor, level: str, mask: torch.Tensor,
                     seg: torch.Tensor | None = None, n_seqs: int = 0, bound: float = LOG_RATIO_BOUND
                     ) -> torch.Tensor:
    """The raw behaviour importance weight (detached), per token.

    token:        w_t = exp(prox_t - behav_t)
    seq-mean:     w_t = exp( (1/|y_i|) * sum_{u in y_i} (prox_u - behav_u) )   for t in sequence i
                  (the geometric mean of the sequence's token weights)
    seq-product:  w_t = exp( sum_{u in y_i} (prox_u - behav_u) )
                  (the sequence's likelihood ratio pi_prox(y_i) / pi_behav(y_i))
    |y_i| and the sums run over the sequence's output tokens (`mask`). The exponent (the token's
    log-weight, the sequence's mean or sum: always in log space) is clamped to [-bound, bound],
    so w <= e^bound at every level.
    """
    log_w = (prox - behav).detach()
    if level == "token":
        return bounded_exp(log_w, bound)
    if level not in WEIGHT_LEVELS:
        raise ValueError(f"behav_weight_level must be one of {WEIGHT_LEVELS}, got {level!r}")
    if seg is None:
        raise ValueError(f"behav_weight_level: {level} needs the sequence boundaries (cu_seqlens)")
    m = mask.to(log_w.dtype)
    total = segment_sum(log_w * m, seg, n_seqs)
    if level == "seq-mean":
        total = total / segment_sum(m, seg, n_seqs).clamp(min=1.0)
    return bounded_exp(total, bound)[seg]


def apply_weight_mode(w: torch.Tensor, mode: str, cap: float | None, low: float
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight used in the loss, tokens masked by it) from the raw weight w.

    cap-mask:  w unchanged; tokens with w > cap masked (cap None: none)        AReaL's cap
    truncate:  w' = min(w, cap); nothing masked                                TIS
    mask:      w unchanged; tokens with w < low or w > cap masked             MIS / IcePop
    A masked token contributes zero loss but still counts in the aggregation's denominators.
    """
    if mode == "cap-mask":
        if cap is None:
            return w, torch.zeros_like(w, dtype=torch.bool)
        return w, w > cap
    if mode == "truncate":
        return torch.clamp(w, max=cap), torch.zeros_like(w, dtype=torch.bool)
    if mode == "mask":
        return w, (w < low) | (w > cap)
    raise ValueError(f"behav_weight must be one of {WEIGHT_MODES}, got {mode!r}")


def policy_ratio(logp: torch.Tensor, prox: torch.Tensor, level: str, mask: torch.Tensor,
                 seg: torch.Tensor | None = None, n_seqs: int = 0, bound: float = LOG_RATIO_BOUND
                 ) -> torch.Tensor:
    """The ratio against the proximal policy, per token (with gradient through logp).

    token (PPO):     r_t = exp(logp_t - prox_t)
    sequence (GSPO): r_t = s_i = exp( (1/|y_i|) * sum_{u in y_i} (logp_u - prox_u) ) for t in i,
                     the length-normalised sequence ratio (pi(y_i)/pi_prox(y_i))^(1/|y_i|).
    The exponent is clamped to [-bound, bound] (verl's compute_policy_loss_vanilla: +-20).
    """
    if level == "token":
        return bounded_exp(logp - prox, bound)
    if level != "sequence":
        raise ValueError(f"ratio_level must be one of {RATIO_LEVELS}, got {level!r}")
    if seg is None:
        raise ValueError("ratio_level: sequence needs the sequence boundaries (cu_seqlens)")
    m = mask.to(logp.dtype)
    mean = segment_sum((logp - prox) * m, seg, n_seqs) / segment_sum(m, seg, n_seqs).clamp(min=1.0)
    return bounded_exp(mean, bound)[seg]


def clipped_surrogate(ratio: torch.Tensor, adv: torch.Tensor, eps_low: float, eps_high: float,
                      dual_clip_c: float | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(objective to maximise, clipped branch won, dual clip won), per token.

    obj = min(r * A, clip(r, 1 - eps_low, 1 + eps_high) * A)            asymmetric clip (DAPO)
    dual clip (Ye et al. 2020), c > 1, for A < 0 only:  obj = max(obj, c * A)
    (bounds the loss of a token whose ratio has run far above 1 with a negative advantage).
    """
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high) * adv
    objective = torch.minimum(unclipped, clipped)
    clip_won = clipped < unclipped
    dual_won = torch.zeros_like(clip_won)
    if dual_clip_c is not None:
        floor = dual_clip_c * adv
        dual_won = (adv < 0) & (objective < floor)
        objective = torch.where(dual_won, floor, objective)
    return objective, clip_won, dual_won


def aggregation_weights(mode: str, mask: torch.Tensor, n_valid: float, n_seqs_global: float,
                        seg: torch.Tensor | None = None, n_seqs: int = 0,
                        norm: float | None = None) -> torch.Tensor | float:
    """Per-token factor c_t such that the minibatch loss is sum_t c_t * l_t (l_t per-token loss).

    token-mean:           c_t = 1 / N                 N = valid tokens of the whole minibatch
    seq-mean-token-sum:   c_t = 1 / G                 G = sequences of the whole minibatch
                          c_t = 1 / (G * C)           with loss_agg_norm = C (Dr. GRPO: a constant
                                                      such as max_new_tokens instead of |y_i|)
    seq-mean-token-mean:  c_t = 1 / (G * |y_i|)       t in sequence i (GRPO's 1/G sum 1/|o_i| sum)
    N and G are global over every micro-batch and data-parallel rank of the minibatch and known
    before the forward; |y_i| is local to a sequence, which a micro-batch holds whole. So summing
    the micro-batches' losses gives the same gradient however the minibatch is split.
    token-mean returns a scalar (the caller divides the token sum, bit for bit the old loss).
    """
    if mode == "token-mean":
        return 1.0 / max(float(n_valid), 1.0)
    g = max(float(n_seqs_global), 1.0)
    if mode == "seq-mean-token-sum":
        return 1.0 / (g * (float(norm) if norm is not None else 1.0))
    if mode != "seq-mean-token-mean":
        raise ValueError(f"loss_agg must be one of {AGGREGATIONS}, got {mode!r}")
    if seg is None:
        raise ValueError("loss_agg: seq-mean-token-mean needs the sequence boundaries (cu_seqlens)")
    m = mask.to(torch.float64)
    lengths = segment_sum(m, seg, n_seqs).clamp(min=1.0)
    return (1.0 / (g * lengths))[seg]


def aggregate(token_values: torch.Tensor, weights: torch.Tensor | float, mode: str, n_valid: float
              ) -> torch.Tensor:
    """sum_t c_t * v_t with `weights` from aggregation_weights (v_t already zero where masked)."""
    if mode == "token-mean":
        return token_values.sum() / max(float(n_valid), 1.0)
    if isinstance(weights, torch.Tensor):
        weights = weights.to(token_values.dtype)
    return (token_values * weights).sum()


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str,
                bound: float = LOG_RATIO_BOUND, kl_bound: float = KL_BOUND) -> torch.Tensor:
    """Per-token estimate of KL(pi_theta || pi_ref) (Schulman's k1/k2/k3), with gradient.

    d = ref_logp - logp:   k1 = -d,   k2 = d^2 / 2,   k3 = exp(d') - 1 - d'   (>= 0; GRPO's choice)
    with d' = clamp(d, -bound, bound) (verl v0.7.0's kl_penalty_forward: +-20), then every
    estimate clamped to [-kl_bound, kl_bound] (+-10: verl's k3; AReaL v1.0.3's KLEstimator,
    areal/utils/data.py, clamps all three). Unclamped, a token at log-prob -20 under the policy
    and -0.05 under the reference gives k3 = e^19.95 ~ 4.6e8 and as large a gradient.
    The tokens were sampled by the behaviour policy, not pi_theta; like GRPO, no correction.
    """
    d = ref_logp.detach() - logp
    if estimator == "k1":
        k = -d
    elif estimator == "k2":
        k = 0.5 * d * d
    elif estimator == "k3":
        d = torch.clamp(d, -bound, bound)
        k = torch.exp(d) - 1.0 - d
    else:
        raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")
    return torch.clamp(k, -kl_bound, kl_bound)


def mismatch_sums(trainer_logp: torch.Tensor, behav: torch.Tensor, select: torch.Tensor,
                  bound: float = LOG_RATIO_BOUND) -> dict[str, torch.Tensor]:
    """Training-inference mismatch over the selected tokens, as sums (no gradient; 0-d tensors,
    read once per step with the loss's other statistics).

    rho = exp(trainer_logp - behav), the trainer's probability of a token over the generator's,
    both for the same policy version. k3 = rho - 1 - log(rho) estimates KL(generator || trainer)
    from the generator's samples (>= 0, ~0 when they agree). Returned: `mismatch_tokens`,
    `mismatch_k3_sum`, `mismatch_ratio_sum`, `mismatch_ratio_max`. log rho is clamped to
    [-bound, bound] like every log-ratio of the objective, so a garbage log-prob from the
    generator shows as a ratio of e^bound, not as inf in the step record.
    """
    with torch.no_grad():
        sel = select.bool()
        # unselected tokens at log rho = 0: rho = 1 and k3 = 0 there, and left out of the sums
        log_rho = torch.where(sel, (trainer_logp.detach().double() - behav.detach().double()).clamp(-bound, bound),
                              0.0)
        rho = torch.exp(log_rho)
        picked = torch.where(sel, rho, 0.0)   # rho > 0: a maximum of 0 means no token selected
        return {"mismatch_tokens": sel.sum(),
                "mismatch_k3_sum": (rho - 1.0 - log_rho).sum(),
                "mismatch_ratio_sum": picked.sum(),
                "mismatch_ratio_max": picked.amax() if picked.numel() else 0.0}
