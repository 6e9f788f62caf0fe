"""`trainer.algorithm`: named bundles of objective and data-shaping keys (docs/algorithms.md).

Each preset sets every key of `ALGORITHM_KEYS`, so switching presets switches the whole recipe;
`areal` is the dataclass defaults (today's decoupled PPO, bit for bit). The launcher applies the
chosen preset after reading the experiment file and the command-line overrides, and only to
keys that neither set explicitly: an explicit key always wins (launcher/config.py). A value may
be a `Derived`, computed from the merged config (e.g. from rollout.max_new_tokens).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

PROXIMAL_MODES = ("recompute", "loglinear", "behaviour")
WEIGHT_MODES = ("cap-mask", "truncate", "mask")
WEIGHT_LEVELS = ("token", "seq-mean", "seq-product")
RATIO_LEVELS = ("token", "sequence")
AGGREGATIONS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")
KL_ESTIMATORS = ("k1", "k2", "k3")


@dataclass(frozen=True)
class Derived:
    """A preset value computed from the experiment config (`get(dotted_key)` reads it)."""
    text: str
    fn: Callable[[Callable[[str], Any]], Any]

    def __call__(self, get: Callable[[str], Any]) -> Any:
        return self.fn(get)

    def __str__(self) -> str:
        return self.text


ALGORITHM_KEYS = (
    "trainer.proximal", "trainer.behav_weight", "trainer.behav_weight_level", "trainer.behav_imp_weight_cap",
    "trainer.behav_imp_weight_low", "trainer.ratio_level", "trainer.eps_clip", "trainer.eps_clip_low",
    "trainer.eps_clip_high", "trainer.dual_clip_c", "trainer.loss_agg", "trainer.loss_agg_norm",
    "trainer.group_baseline", "trainer.leave_one_out", "trainer.normalize_advantages",
    "trainer.adv_norm_scope", "trainer.kl_coef", "trainer.kl_estimator", "trainer.entropy_coef",
    "trainer.overlong_buffer", "trainer.overlong_penalty", "trainer.mask_truncated",
    "rollout.filter_all_equal",
)

AREAL = {
    "trainer.proximal": "recompute", "trainer.behav_weight": "cap-mask", "trainer.behav_weight_level": "token",
    "trainer.behav_imp_weight_cap": None, "trainer.behav_imp_weight_low": 0.0, "trainer.ratio_level": "token",
    "trainer.eps_clip": 0.2, "trainer.eps_clip_low": None, "trainer.eps_clip_high": None,
    "trainer.dual_clip_c": None, "trainer.loss_agg": "token-mean", "trainer.loss_agg_norm": None,
    "trainer.group_baseline": True, "trainer.leave_one_out": False, "trainer.normalize_advantages": True,
    "trainer.adv_norm_scope": "batch", "trainer.kl_coef": 0.0, "trainer.kl_estimator": "k3",
    "trainer.entropy_coef": 0.0, "trainer.overlong_buffer": 0, "trainer.overlong_penalty": 1.0,
    "trainer.mask_truncated": False, "rollout.filter_all_equal": False,
}

# GRPO-style group-normalised advantages, shared by grpo, dapo and gspo.
_GROUP_NORM = {"trainer.group_baseline": True, "trainer.normalize_advantages": True,
               "trainer.adv_norm_scope": "group"}

PRESETS: dict[str, dict[str, Any]] = {
    # AReaL (Fu et al. 2025): decoupled PPO, proximal policy recomputed at the start of the step.
    "areal": AREAL,
    # GRPO (DeepSeekMath, Shao et al. 2024): clip against the sampling policy, group-normalised
    # advantages, per-sequence mean of per-token means, k3 KL to the initial policy (beta 0.04).
    "grpo": AREAL | _GROUP_NORM | {"trainer.proximal": "behaviour", "trainer.loss_agg": "seq-mean-token-mean",
                                   "trainer.kl_coef": 0.04, "trainer.kl_estimator": "k3"},
    # DAPO (Yu et al. 2025): clip-higher, token-level loss, dynamic sampling, overlong filtering
    # and soft overlong punishment (buffer = 1/5 of the length limit, penalty scaled to the reward
    # range: DAPO's rewards are +-1 and its penalty reaches -1).
    "dapo": AREAL | _GROUP_NORM | {
        "trainer.proximal": "behaviour", "trainer.eps_clip_low": 0.2, "trainer.eps_clip_high": 0.28,
        "trainer.loss_agg": "token-mean", "rollout.filter_all_equal": True, "trainer.mask_truncated": True,
        "trainer.overlong_buffer": Derived("rollout.max_new_tokens // 5",
                                           lambda get: max(1, int(get("rollout.max_new_tokens")) // 5)),
        "trainer.overlong_penalty": Derived("(reward.correct_reward - reward.wrong_reward) / 2",
                                            lambda get: (float(get("reward.correct_reward"))
                                                         - float(get("reward.wrong_reward"))) / 2),
    },
    # Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-like training"): no std normalisation,
    # no per-sequence length normalisation: token sums over a constant (the length limit).
    "dr_grpo": AREAL | {"trainer.proximal": "behaviour", "trainer.normalize_advantages": False,
                        "trainer.loss_agg": "seq-mean-token-sum",
                        "trainer.loss_agg_norm": Derived("rollout.max_new_tokens",
                                                         lambda get: float(get("rollout.max_new_tokens")))},
    # GSPO (Zheng et al. 2025): the length-normalised sequence ratio, clipped to a narrow
    # asymmetric range, averaged over sequences.
    "gspo": AREAL | _GROUP_NORM | {"trainer.proximal": "behaviour", "trainer.ratio_level": "sequence",
                                   "trainer.eps_clip_low": 3e-4, "trainer.eps_clip_high": 4e-4,
                                   "trainer.loss_agg": "seq-mean-token-mean"},
    # Truncated importance sampling (Yao et al. 2025, "Your efficient RL framework secretly brings
    # you off-policy RL training"): the trainer's own log-probs are the proximal policy and the
    # weight to the generator's log-probs is truncated at C = 2 instead of masked.
    "tis": AREAL | {"trainer.behav_weight": "truncate", "trainer.behav_imp_weight_cap": 2.0},
}

for _name, _bundle in PRESETS.items():
    assert set(_bundle) == set(ALGORITHM_KEYS), (_name, set(ALGORITHM_KEYS) ^ set(_bundle))


def preset_values(algorithm: str, get: Callable[[str], Any]) -> dict[str, Any]:
    """The preset's {dotted key: value}, Derived values computed with `get(dotted_key)`."""
    if algorithm not in PRESETS:
        raise KeyError(algorithm)
    return {k: (v(get) if isinstance(v, Derived) else v) for k, v in PRESETS[algorithm].items()}


def objective_problems(t) -> list[tuple[str, str]]:
    """Config mistakes in the objective keys of a TrainerConfig `t`: (key, message)."""
    out = []
    choices = (("algorithm", tuple(PRESETS)), ("proximal", PROXIMAL_MODES), ("behav_weight", WEIGHT_MODES),
               ("behav_weight_level", WEIGHT_LEVELS), ("ratio_level", RATIO_LEVELS), ("loss_agg", AGGREGATIONS),
               ("kl_estimator", KL_ESTIMATORS), ("adv_norm_scope", ("batch", "group")))
    for key, allowed in choices:
        if getattr(t, key) not in allowed:
            out.append((key, f"must be one of {', '.join(allowed)}; got {getattr(t, key)!r}"))
    if not t.use_decoupled_loss and t.proximal == "loglinear":
        out.append(("proximal", "loglinear needs use_decoupled_loss: true (false means proximal: behaviour)"))
    for key in ("eps_clip_low", "eps_clip_high"):
        v = getattr(t, key)
        if v is not None and not (0 < v < 1 if key == "eps_clip_low" else v > 0):
            out.append((key, f"must be {'in (0, 1)' if key == 'eps_clip_low' else '> 0'} or null, got {v}"))
    if t.dual_clip_c is not None and t.dual_clip_c <= 1:
        out.append(("dual_clip_c", f"must be > 1 or null, got {t.dual_clip_c}"))
    if t.behav_weight in ("truncate", "mask") and t.behav_imp_weight_cap is None:
        out.append(("behav_imp_weight_cap", f"behav_weight: {t.behav_weight} needs an upper bound"))
    if t.behav_weight == "mask" and not (0 <= t.behav_imp_weight_low < 1):
        out.append(("behav_imp_weight_low", f"must be in [0, 1), got {t.behav_imp_weight_low}"))
    if t.loss_agg_norm is not None and (t.loss_agg != "seq-mean-token-sum" or t.loss_agg_norm <= 0):
        out.append(("loss_agg_norm", "must be > 0, and only with loss_agg: seq-mean-token-sum"))
    if t.leave_one_out and not t.group_baseline:
        out.append(("leave_one_out", "is a kind of group baseline: needs group_baseline: true"))
    if t.kl_coef < 0 or t.entropy_coef < 0:
        out.append(("kl_coef" if t.kl_coef < 0 else "entropy_coef", "must be >= 0"))
    if t.kl_coef > 0 and t.backend != "torch":
        out.append(("kl_coef", f"the KL penalty needs the initial policy's log-probs, computed on the "
                               f"torch backend only (a frozen copy of the model); not available on "
                               f"trainer.backend: {t.backend} (set trainer.kl_coef=0)"))
    if t.overlong_buffer < 0:
        out.append(("overlong_buffer", "must be >= 0 (0 = off)"))
    elif t.overlong_buffer > 0 and not (0 < t.overlong_buffer <= t.overlong_max_len):
        out.append(("overlong_buffer", f"must be <= overlong_max_len ({t.overlong_max_len})"))
    if t.overlong_penalty < 0:
        out.append(("overlong_penalty", "must be >= 0"))
    return out
