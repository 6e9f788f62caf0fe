"""The policy objective: decoupled PPO (Hilton et al., as in AReaL), or standard PPO.

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
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PPOSettings:
    eps_clip: float = 0.2
    use_decoupled_loss: bool = True
    # None = no cap.
    behav_imp_weight_cap: float | None = None


def ppo_token_loss(logp: torch.Tensor, behav_logp: torch.Tensor, prox_logp: torch.Tensor | None,
                   advantages: torch.Tensor, loss_mask: torch.Tensor, settings: PPOSettings,
                   n_valid: float) -> tuple[torch.Tensor, dict[str, float]]:
    """(loss summed over this micro-batch's tokens / n_valid, stats summed over its tokens).

    All inputs are aligned 1-D float tensors; `loss_mask` (bool) selects the output tokens.
    Stats are sums (divide by the global valid-token count after all-reducing): `loss`,
    `clipped` (tokens where the clipped branch won), `imp_weight_sum`, `imp_weight_max`,
    `capped` (tokens masked by the cap), `ratio_sum`, `valid`.
    """
    mask = loss_mask.bool()
    # float32 at least; a float64 model (reference tests) keeps float64 throughout.
    dt = torch.float64 if logp.dtype == torch.float64 else torch.float32
    logp32 = logp.to(dt)
    behav = behav_logp.to(dt)
    if settings.use_decoupled_loss:
        if prox_logp is None:
            raise ValueError("decoupled PPO needs proximal log-probs (prox_logp); recompute them first")
        prox = prox_logp.to(dt)
        imp_weight = torch.exp(prox - behav).detach()
    else:
        prox = behav
        imp_weight = torch.ones_like(behav)
    keep = mask
    capped = torch.zeros_like(mask)
    if settings.use_decoupled_loss and settings.behav_imp_weight_cap is not None:
        capped = mask & (imp_weight > settings.behav_imp_weight_cap)
        keep = mask & ~capped
    ratio = torch.exp(logp32 - prox)
    adv = advantages.to(dt)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - settings.eps_clip, 1.0 + settings.eps_clip) * adv
    objective = torch.minimum(unclipped, clipped)
    token_loss = -imp_weight * objective
    token_loss = torch.where(keep, token_loss, torch.zeros_like(token_loss))
    loss = token_loss.sum() / max(float(n_valid), 1.0)
    with torch.no_grad():
        w_valid = imp_weight[mask]
        stats = {
            "loss": float(token_loss.sum()),
            "clipped": float((keep & (clipped < unclipped)).sum()),
            "imp_weight_sum": float(w_valid.sum()),
            "imp_weight_max": float(w_valid.max()) if w_valid.numel() else 0.0,
            "capped": float(capped.sum()),
            "ratio_sum": float(ratio[mask].sum()),
            "valid": float(mask.sum()),
        }
    return loss, stats
