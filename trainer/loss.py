"""The policy objective: decoupled PPO (Hilton et al., as in AReaL) and its variants.

Asynchronous RL trains on tokens sampled by older policies (the behaviour policy), sometimes
several versions within one sequence. Clipping the ratio against the behaviour policy would
trust-region around a stale policy; decoupled PPO clips around the *proximal* policy (the
parameters at the start of this step) and corrects the distribution shift with the behaviour
importance weight, which carries no gradient:

    w    = exp(logp_prox - logp_behav)            (detached; tokens with w > cap are masked)
    r    = exp(logp - logp_prox)
    loss = -w * min(r * A, clip(r, 1 - eps, 1 + eps) * A)   averaged over valid tokens

Standard PPO is the same with logp_prox := logp_behav (so w = 1). The average is over all valid
tokens of the minibatch (`n_valid`, over every micro-batch and rank), masked tokens included in
the count, so splitting a minibatch never changes the gradient.

That is the default (`trainer.algorithm: areal`). Every piece is a setting, each one a small
function of objectives.py with its formula: how the proximal log-probs are obtained, how the
behaviour weight is handled and at which level, the ratio's level (GSPO), asymmetric and dual
clipping, the aggregation over tokens and sequences, a KL penalty to the initial policy and an
entropy bonus (docs/algorithms.md has the table of recipes):

    loss = sum_t c_t * keep_t * (-w'_t * obj_t)  +  kl_coef * sum_t c_t * k_t
           - entropy_coef * sum_t c_t * H_t                      (sums over this micro-batch)

with c_t the aggregation factor, keep_t = 0 for tokens masked by the weight handling or in a
masked sample, w'_t the handled weight and obj_t the clipped surrogate.

Each exp takes a clamped log-ratio and the KL estimate is clamped (objectives.py, "Bounds"), so
finite log-probs give a finite loss and gradient. Non-finite inputs (a NaN log-prob from a
generator, say) still give a non-finite term: the three terms (LOSS_TERMS) are checked here and
reported as `nonfinite_<term>` stats, and the backend then applies no update and the loop stops
the step, naming the term (trainer/backend.py: agreed_nonfinite) — never a silent skip.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.trainer import objectives as obj
from tandem.trainer.backend import to_device
from tandem.trainer.objectives import LOSS_TERMS


@dataclass
class PPOSettings:
    eps_clip: float = 0.2
    use_decoupled_loss: bool = True
    # None = no cap (cap-mask); the upper bound C of truncate and mask.
    behav_imp_weight_cap: float | None = None
    # None = eps_clip.
    eps_clip_low: float | None = None
    eps_clip_high: float | None = None
    # None = no dual clip.
    dual_clip_c: float | None = None
    proximal: str = "recompute"
    behav_weight: str = "cap-mask"
    behav_imp_weight_low: float = 0.0
    behav_weight_level: str = "token"
    ratio_level: str = "token"
    loss_agg: str = "token-mean"
    loss_agg_norm: float | None = None
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0
    # Every log-ratio is clamped to [-log_ratio_clamp, log_ratio_clamp] before exp; the KL
    # estimate to [-kl_clamp, kl_clamp] (objectives.py).
    log_ratio_clamp: float = obj.LOG_RATIO_BOUND
    kl_clamp: float = obj.KL_BOUND

    @property
    def proximal_mode(self) -> str:
        """What is used: `use_decoupled_loss: false` is standard PPO, i.e. prox = behav."""
        return self.proximal if self.use_decoupled_loss else "behaviour"

    @property
    def clip_range(self) -> tuple[float, float]:
        low = self.eps_clip if self.eps_clip_low is None else self.eps_clip_low
        high = self.eps_clip if self.eps_clip_high is None else self.eps_clip_high
        return low, high

    @property
    def needs_sequences(self) -> bool:
        return (self.behav_weight_level != "token" or self.ratio_level != "token"
                or self.loss_agg == "seq-mean-token-mean")


def ppo_token_loss(logp: torch.Tensor, behav_logp: torch.Tensor, prox_logp: torch.Tensor | None,
                   advantages: torch.Tensor, loss_mask: torch.Tensor, settings: PPOSettings,
                   n_valid: float, *, cu_seqlens: torch.Tensor | None = None, n_seqs: float = 0,
                   versions: torch.Tensor | None = None, version: int = 0, progress: float = 0.0,
                   ref_logp: torch.Tensor | None = None, entropy: torch.Tensor | None = None,
                   sample_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor | float]]:
    """(this micro-batch's share of the minibatch loss, stats summed over its tokens, as 0-d
    tensors on the loss's device: `trainer.backend.stats_on_host` reads them).

    All inputs are aligned 1-D tensors; `loss_mask` (bool) selects the output tokens. `n_valid`
    (valid tokens) and `n_seqs` (sequences) count the whole minibatch over all micro-batches and
    ranks. `cu_seqlens` (this micro-batch's sequence boundaries) is needed by the sequence-level
    settings; `versions`/`version`/`progress` (= k/n in the step's k-th of n updates) by
    proximal: loglinear; `ref_logp` by kl_coef > 0; `entropy` (with gradient) by entropy_coef > 0;
    `sample_mask` (bool) masks whole samples (mask_truncated). Stats are sums (divide by the
    global valid-token count after all-reducing): `loss` (the policy-gradient term),
    `objective` (the value returned), `clipped` (tokens where the clipped branch won),
    `dual_clipped`, `imp_weight_sum`, `imp_weight_max`, `capped` (tokens masked by the weight
    handling), `ratio_sum`, `valid`, `kl_sum`, `sample_masked`, and `nonfinite_<term>` (1 when
    that term of this micro-batch is NaN or inf, for each of LOSS_TERMS).
    """
    s = settings
    mask = loss_mask.bool()
    # float32 at least; a float64 model (reference tests) keeps float64 throughout.
    dt = torch.float64 if logp.dtype == torch.float64 else torch.float32
    logp32 = logp.to(dt)
    behav = behav_logp.to(dt)
    seg = n_local = None
    if s.needs_sequences:
        if cu_seqlens is None:
            raise ValueError("these objective settings work per sequence: pass cu_seqlens")
        seg = to_device(obj.segment_ids(cu_seqlens), logp.device)
        n_local = int(cu_seqlens.numel()) - 1
    mode = s.proximal_mode
    if mode == "behaviour":
        prox = behav
        imp_weight = torch.ones_like(behav)
    else:
        prox = obj.proximal_logp(mode, logp32, behav, None if prox_logp is None else prox_logp.to(dt),
                                 versions, version, progress)
        imp_weight = obj.behaviour_weight(prox, behav, s.behav_weight_level, mask, seg, n_local,
                                          s.log_ratio_clamp)
    used_weight, weight_masked = obj.apply_weight_mode(
        imp_weight, s.behav_weight if mode != "behaviour" else "cap-mask",
        s.behav_imp_weight_cap if mode != "behaviour" else None, s.behav_imp_weight_low)
    capped = mask & weight_masked
    keep = mask & ~capped
    sample_masked = torch.zeros_like(mask)
    if sample_mask is not None:
        sample_masked = mask & ~sample_mask.bool()
        keep = keep & ~sample_masked
    ratio = obj.policy_ratio(logp32, prox, s.ratio_level, mask, seg, n_local, s.log_ratio_clamp)
    adv = advantages.to(dt)
    eps_low, eps_high = s.clip_range
    objective, clip_won, dual_won = obj.clipped_surrogate(ratio, adv, eps_low, eps_high, s.dual_clip_c)
    token_loss = -used_weight * objective
    token_loss = torch.where(keep, token_loss, torch.zeros_like(token_loss))
    weights = obj.aggregation_weights(s.loss_agg, mask, n_valid, n_seqs, seg, n_local or 0, s.loss_agg_norm)
    loss = obj.aggregate(token_loss, weights, s.loss_agg, n_valid)
    terms = {"policy": loss}
    in_sample = mask & ~sample_masked
    kl_sum = 0.0
    if s.kl_coef:
        if ref_logp is None:
            raise ValueError("kl_coef > 0 needs the initial policy's log-probs (ref_logp)")
        kl = obj.kl_estimate(logp32, ref_logp.to(dt), s.kl_estimator, s.log_ratio_clamp, s.kl_clamp)
        kl = torch.where(in_sample, kl, torch.zeros_like(kl))
        terms["kl"] = s.kl_coef * obj.aggregate(kl, weights, s.loss_agg, n_valid)
        loss = loss + terms["kl"]
        kl_sum = kl.detach().sum()
    if s.entropy_coef:
        if entropy is None:
            raise ValueError("entropy_coef > 0 needs the entropy of the training forward")
        ent = torch.where(in_sample, entropy.to(dt), torch.zeros_like(behav))
        terms["entropy"] = -s.entropy_coef * obj.aggregate(ent, weights, s.loss_agg, n_valid)
        loss = loss + terms["entropy"]
    with torch.no_grad():   # 0-d tensors, read once per step (trainer/backend.py stats_on_host)
        w_valid = torch.where(mask, imp_weight, torch.zeros_like(imp_weight))   # weights are > 0
        stats = {
            "loss": token_loss.sum(),
            "objective": loss.detach(),
            "clipped": (keep & clip_won).sum(),
            "dual_clipped": (keep & dual_won).sum(),
            "imp_weight_sum": w_valid.sum(),
            "imp_weight_max": w_valid.amax() if w_valid.numel() else 0.0,
            "capped": capped.sum(),
            "ratio_sum": torch.where(mask, ratio, torch.zeros_like(ratio)).sum(),
            "valid": mask.sum(),
            "kl_sum": kl_sum,
            "sample_masked": sample_masked.sum(),
            **nonfinite_stats(terms),
        }
    return loss, stats


def nonfinite_stats(terms: dict[str, torch.Tensor]) -> dict[str, torch.Tensor | float]:
    """{`nonfinite_<term>`: 1 if that term's value is NaN or inf, else 0} for every term of
    LOSS_TERMS (0.0 for a term this micro-batch does not compute), as 0-d tensors."""
    if set(terms) - set(LOSS_TERMS):
        raise ValueError(f"unknown loss terms {sorted(set(terms) - set(LOSS_TERMS))}")
    return {f"nonfinite_{name}": (~torch.isfinite(terms[name].detach())).to(torch.float64)
            if name in terms else 0.0 for name in LOSS_TERMS}
