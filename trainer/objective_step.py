"""The training loop's side of the objective: the settings from the config, the no-grad forwards
before a step's first update, the loss function of each update, and the step's objective and
mismatch metrics. Kept out of loop.py so the loop reads as the order of a step.

Mismatch metrics (every step, whatever the objective): over the output tokens generated at the
version being trained (per-token `versions` == the trainer's version), the trainer's log-probs
at the step's start parameters against the generator's behaviour log-probs, rho = exp(trainer -
generator): `mismatch_k3` (mean of rho - 1 - log rho, the k3 estimate of KL(generator ||
trainer)), `mismatch_ratio_mean`, `mismatch_ratio_max`, over `mismatch_tokens` tokens (null
when the step has none). The trainer's log-probs are the proximal forward's when it runs
(`proximal: recompute`: every token of the step); when it is skipped (loglinear, behaviour),
the first update's training forward, which runs with the start parameters before any update:
the tokens of the first minibatch only (all of them with ppo_n_minibatches = 1). The record's
`mismatch_source` says which ("proximal" or "first_update").

Per-version drift (same tokens and source, one version older): over the output tokens generated
one version before the one being trained, the same k3 gives `version_kl`, an estimate of
KL(policy v-1 || policy v) on the policy's own samples (plus the mismatch above, which it
includes). It is how far one update moves the policy — what makes staleness matter: the
staleness ablation (benchmarks/staleness_ablation.py) reports it to place its runs against a
real run's per-update KL. Null when the step has no such token (eta = 0).
"""
from __future__ import annotations

from dataclasses import dataclass

from tandem.trainer.backend import PackedBatch, TokenOutputs, TrainBackend
from tandem.trainer.batch import MinibatchPlan, Shaping, StepPlan
from tandem.trainer.loss import PPOSettings, ppo_token_loss
from tandem.trainer.objectives import mismatch_sums

# Stats the loss function adds to the loop's (summed, resp. maxed over micro-batches and ranks).
EXTRA_SUMS = ("objective", "dual_clipped", "kl_sum", "sample_masked", "mismatch_tokens", "mismatch_k3_sum",
              "mismatch_ratio_sum", "drift_tokens", "drift_k3_sum")
EXTRA_MAXES = ("mismatch_ratio_max",)


def settings_from_config(t) -> PPOSettings:
    return PPOSettings(
        eps_clip=t.eps_clip, use_decoupled_loss=t.use_decoupled_loss, behav_imp_weight_cap=t.behav_imp_weight_cap,
        eps_clip_low=t.eps_clip_low, eps_clip_high=t.eps_clip_high, dual_clip_c=t.dual_clip_c,
        proximal=t.proximal, behav_weight=t.behav_weight, behav_imp_weight_low=t.behav_imp_weight_low,
        behav_weight_level=t.behav_weight_level, ratio_level=t.ratio_level, loss_agg=t.loss_agg,
        loss_agg_norm=t.loss_agg_norm, kl_coef=t.kl_coef, kl_estimator=t.kl_estimator, entropy_coef=t.entropy_coef,
        log_ratio_clamp=t.log_ratio_clamp, kl_clamp=t.kl_clamp)


def shaping_from_config(t) -> Shaping:
    return Shaping(leave_one_out=t.leave_one_out, norm_scope=t.adv_norm_scope, norm_std=t.adv_norm_std,
                   overlong_buffer=t.overlong_buffer,
                   overlong_max_len=t.overlong_max_len if t.overlong_buffer > 0 else 0,
                   overlong_penalty=t.overlong_penalty, mask_truncated=t.mask_truncated,
                   turn_credit=t.turn_credit)


def start_of_step(plan: StepPlan, backend: TrainBackend, temperature: float, settings: PPOSettings) -> None:
    """The no-grad forwards with the step's start parameters, before any update: the proximal
    log-probs (`prox_logp`, proximal: recompute only — loglinear and behaviour skip this pass)
    and the initial policy's (`ref_logp`, when kl_coef > 0), into each micro-batch's fields."""
    recompute = settings.proximal_mode == "recompute"
    for mp in plan.minibatches:
        for mb in mp.micro_batches:
            if not mb.n_tokens:
                continue
            if recompute:
                mb.fields["prox_logp"] = backend.forward_logprobs(mb, temperature).logp
            if settings.kl_coef:
                mb.fields["ref_logp"] = backend.forward_ref_logprobs(mb, temperature).logp


def make_loss_fn(settings: PPOSettings, mp: MinibatchPlan, k: int, n_updates: int, version: int):
    """The loss of update k (0-based) of the step's n_updates, for backend.train_step."""
    recomputed = settings.proximal_mode == "recompute"

    def loss_fn(mb: PackedBatch, out: TokenOutputs):
        f = mb.fields
        loss, stats = ppo_token_loss(
            out.logp, f["behav_logp"], f.get("prox_logp"), f["advantages"], f["loss_mask"], settings, mp.n_valid,
            cu_seqlens=mb.cu_seqlens, n_seqs=mp.n_seqs, versions=f.get("versions"), version=version,
            progress=k / max(n_updates, 1), ref_logp=f.get("ref_logp"),
            entropy=out.entropy if settings.entropy_coef else None, sample_mask=f.get("sample_mask"))
        if out.entropy is not None:
            stats["entropy_sum"] = (out.entropy.detach() * f["loss_mask"]).sum()
        start = f.get("prox_logp") if recomputed else (out.logp if k == 0 else None)
        if start is not None and "versions" in f:
            start = start.to(f["behav_logp"].device)
            select = f["loss_mask"].bool() & (f["versions"] == version)
            stats.update(mismatch_sums(start, f["behav_logp"], select, settings.log_ratio_clamp))
            older = f["loss_mask"].bool() & (f["versions"] == version - 1)
            drift = mismatch_sums(start, f["behav_logp"], older, settings.log_ratio_clamp)
            stats.update(drift_tokens=drift["mismatch_tokens"], drift_k3_sum=drift["mismatch_k3_sum"])
        return loss, stats
    return loss_fn


def step_metrics(totals: dict, n_updates: int, settings: PPOSettings) -> dict:
    """The objective's and the mismatch's part of the step record, from the reduced totals."""
    valid = max(totals["valid"], 1.0)
    n = int(totals["mismatch_tokens"])
    n_drift = int(totals["drift_tokens"])
    return {
        "objective": totals["objective"] / max(n_updates, 1),
        "dual_clip_fraction": totals["dual_clipped"] / valid,
        "kl": totals["kl_sum"] / valid,
        "sample_masked_fraction": totals["sample_masked"] / valid,
        "mismatch_tokens": n,
        "mismatch_k3": totals["mismatch_k3_sum"] / n if n else None,
        "mismatch_ratio_mean": totals["mismatch_ratio_sum"] / n if n else None,
        "mismatch_ratio_max": totals["mismatch_ratio_max"] if n else None,
        "mismatch_source": "proximal" if settings.proximal_mode == "recompute" else "first_update",
        "version_kl": totals["drift_k3_sum"] / n_drift if n_drift else None,
        "version_kl_tokens": n_drift,
    }


@dataclass
class NonFiniteStop:
    """A step stopped because loss terms were NaN or inf in update `update` (0-based) of `n`:
    that update was not applied and the step's later updates were not run (earlier ones were)."""
    version: int
    update: int
    n: int
    terms: dict[str, int]

    def __str__(self) -> str:
        named = ", ".join(f"{t} ({c} micro-batch{'es' if c > 1 else ''})" for t, c in self.terms.items())
        rest = self.n - self.update - 1
        return (f"step {self.version}: loss term {named} is NaN or inf in update {self.update + 1} of "
                f"{self.n}: the step stops here (that update not applied"
                f"{f', {rest} later update(s) not run' if rest else ''}); the log-ratios and the KL are "
                f"bounded (trainer.log_ratio_clamp, trainer.kl_clamp), so a log-prob, advantage or "
                f"entropy itself was NaN or inf")


def nonfinite_fields(stop: NonFiniteStop | None, total: int) -> dict:
    """The step record's account of a NaN/inf loss: `nonfinite_loss` ({term: micro-batches},
    empty when the step ran whole), `updates_not_run` and `nonfinite_steps_total`."""
    return {"nonfinite_loss": dict(stop.terms) if stop else {},
            "updates_not_run": stop.n - stop.update - 1 if stop else 0,
            "nonfinite_steps_total": total}
