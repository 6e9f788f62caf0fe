"""`trainer.algorithm`: named bundles of objective and data-shaping keys (docs/algorithms.md).

Each preset sets every key of `ALGORITHM_KEYS`, so switching presets switches the whole recipe;
`areal` is the dataclass defaults (today's decoupled PPO, bit for bit). The launcher applies the
chosen preset after reading the experiment file and the command-line overrides, and only to
keys that neither set explicitly: an explicit key always wins (launcher/config.py). A value may
be a `Derived`, computed from the merged config (e.g. from rollout.max_new_tokens).
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

PROXIMAL_MODES = ("recompute", "loglinear", "behaviour")
WEIGHT_MODES = ("cap-mask", "truncate", "mask")
WEIGHT_LEVELS = ("token", "seq-mean", "seq-product")
RATIO_LEVELS = ("token", "sequence")
AGGREGATIONS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")
KL_ESTIMATORS = ("k1", "k2", "k3")
ADV_NORM_STDS = ("sample", "population")
# Largest trainer.log_ratio_clamp: a weight and a ratio of e^30 each multiply to e^60 ~ 1e26,
# far below float32's largest number (~e^88.7), with room for advantages and sums.
MAX_LOG_RATIO_CLAMP = 30.0


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
    "trainer.adv_norm_scope", "trainer.adv_norm_std", "trainer.kl_coef", "trainer.kl_estimator", "trainer.entropy_coef",
    "trainer.overlong_buffer", "trainer.overlong_penalty", "trainer.mask_truncated",
    "rollout.filter_all_equal",
)

# Where each preset's numbers come from: the release and file it follows (docs/algorithms.md);
# a test checks every preset against numbers worked out by hand from these.
SOURCES = {
    "areal": "AReaL v1.0.3 (inclusionAI/AReaL @ 376ecbb): areal/api/cli_args.py PPOActorConfig "
             "(use_decoupled_loss, behave_imp_weight_cap 5.0 with behave_imp_weight_mode token_mask, "
             "eps_clip 0.2) and NormConfig (std_unbiased True); areal/utils/functional/functional.py "
             "ppo_actor_loss_fn (masked tokens stay in the token count); areal/utils/data.py "
             "Normalization (batch std over tokens, ddof 1); examples/math/gsm8k_grpo.yaml (adv_norm "
             "mean_level/std_level batch)",
    "grpo": "DeepSeekMath (arXiv 2402.03300) eq. 3 and 4, as verl v0.7.0 implements them: "
            "verl/trainer/ppo/core_algos.py compute_grpo_outcome_advantage (torch.std: ddof 1; a "
            "group of one is not scaled), kl_penalty_forward (k3, log-ratio +-20, estimate +-10)",
    "dapo": "DAPO (arXiv 2503.14476) with verl v0.7.0: recipe/dapo/run_dapo_qwen2.5_32b.sh "
            "(clip_ratio_low 0.2, clip_ratio_high 0.28, loss_agg_mode token-mean, overlong buffer 4096 "
            "of 20480 response tokens: a fifth) and verl/trainer/ppo/core_algos.py "
            "compute_grpo_outcome_advantage (torch.std: ddof 1); not its dual clip (clip_ratio_c 10), "
            "which the paper does not have",
    "dr_grpo": "Dr. GRPO (arXiv 2503.20783): the objective's 1/G sum_i sum_t over a constant, with "
               "verl v0.7.0 verl/trainer/ppo/core_algos.py compute_grpo_outcome_advantage "
               "(norm_adv_by_std_in_grpo False) and agg_loss seq-mean-token-sum-norm (token sums over "
               "the length limit; verl leaves out the paper's 1/G, a constant factor)",
    "gspo": "GSPO (arXiv 2507.18071) with verl v0.7.0: verl/trainer/ppo/core_algos.py "
            "compute_policy_loss_gspo (clip 3e-4 / 4e-4, seq-mean-token-mean) and "
            "compute_grpo_outcome_advantage (torch.std: ddof 1)",
    "tis": "Yao et al. 2025, 'Your efficient RL framework secretly brings you off-policy RL training' "
           "(truncation C = 2), on the areal recipe",
}


def _areal_cap(get: Callable[[str], Any]) -> float | None:
    """AReaL's cap where there is a behaviour weight to cap; none under standard PPO (proximal:
    behaviour or use_decoupled_loss: false), where a cap would do nothing (and is refused)."""
    standard = get("trainer.proximal") == "behaviour" or not get("trainer.use_decoupled_loss")
    return None if standard else 5.0


AREAL = {
    "trainer.proximal": "recompute", "trainer.behav_weight": "cap-mask", "trainer.behav_weight_level": "token",
    "trainer.behav_imp_weight_cap": Derived("5.0 (null under proximal: behaviour)", _areal_cap),
    "trainer.behav_imp_weight_low": 0.0, "trainer.ratio_level": "token",
    "trainer.eps_clip": 0.2, "trainer.eps_clip_low": None, "trainer.eps_clip_high": None,
    "trainer.dual_clip_c": None, "trainer.loss_agg": "token-mean", "trainer.loss_agg_norm": None,
    "trainer.group_baseline": True, "trainer.leave_one_out": False, "trainer.normalize_advantages": True,
    "trainer.adv_norm_scope": "batch", "trainer.adv_norm_std": "sample", "trainer.kl_coef": 0.0,
    "trainer.kl_estimator": "k3",
    "trainer.entropy_coef": 0.0, "trainer.overlong_buffer": 0, "trainer.overlong_penalty": 1.0,
    "trainer.mask_truncated": False, "rollout.filter_all_equal": False,
}

# GRPO-style group-normalised advantages (sample std, as verl's torch.std), shared by grpo, dapo
# and gspo.
_GROUP_NORM = {"trainer.group_baseline": True, "trainer.normalize_advantages": True,
               "trainer.adv_norm_scope": "group", "trainer.adv_norm_std": "sample"}
# The recipes that clip against the sampling policy: no behaviour weight, so no cap.
_STANDARD_PPO = {"trainer.proximal": "behaviour", "trainer.behav_imp_weight_cap": None}

PRESETS: dict[str, dict[str, Any]] = {
    # AReaL (Fu et al. 2025): decoupled PPO, proximal policy recomputed at the start of the step.
    "areal": AREAL,
    # GRPO (DeepSeekMath, Shao et al. 2024): clip against the sampling policy, group-normalised
    # advantages, per-sequence mean of per-token means, k3 KL to the initial policy (beta 0.04).
    "grpo": AREAL | _GROUP_NORM | _STANDARD_PPO | {"trainer.loss_agg": "seq-mean-token-mean",
                                   "trainer.kl_coef": 0.04, "trainer.kl_estimator": "k3"},
    # DAPO (Yu et al. 2025): clip-higher, token-level loss, dynamic sampling, overlong filtering
    # and soft overlong punishment (buffer = 1/5 of the length limit, penalty scaled to the reward
    # range: DAPO's rewards are +-1 and its penalty reaches -1).
    "dapo": AREAL | _GROUP_NORM | _STANDARD_PPO | {
        "trainer.eps_clip_low": 0.2, "trainer.eps_clip_high": 0.28,
        "trainer.loss_agg": "token-mean", "rollout.filter_all_equal": True, "trainer.mask_truncated": True,
        "trainer.overlong_buffer": Derived("rollout.max_new_tokens // 5",
                                           lambda get: max(1, int(get("rollout.max_new_tokens")) // 5)),
        "trainer.overlong_penalty": Derived("(reward.correct_reward - reward.wrong_reward) / 2",
                                            lambda get: (float(get("reward.correct_reward"))
                                                         - float(get("reward.wrong_reward"))) / 2),
    },
    # Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-like training"): no std normalisation,
    # no per-sequence length normalisation: token sums over a constant (the length limit).
    "dr_grpo": AREAL | _STANDARD_PPO | {"trainer.normalize_advantages": False,
                        "trainer.loss_agg": "seq-mean-token-sum",
                        "trainer.loss_agg_norm": Derived("rollout.max_new_tokens",
                                                         lambda get: float(get("rollout.max_new_tokens")))},
    # GSPO (Zheng et al. 2025): the length-normalised sequence ratio, clipped to a narrow
    # asymmetric range, averaged over sequences.
    "gspo": AREAL | _GROUP_NORM | _STANDARD_PPO | {"trainer.ratio_level": "sequence",
                                   "trainer.eps_clip_low": 3e-4, "trainer.eps_clip_high": 4e-4,
                                   "trainer.loss_agg": "seq-mean-token-mean"},
    # Truncated importance sampling (Yao et al. 2025, "Your efficient RL framework secretly brings
    # you off-policy RL training"): the trainer's own log-probs are the proximal policy and the
    # weight to the generator's log-probs is truncated at C = 2 instead of masked.
    "tis": AREAL | {"trainer.behav_weight": "truncate", "trainer.behav_imp_weight_cap": 2.0},
}

for _name, _bundle in PRESETS.items():
    assert set(_bundle) == set(ALGORITHM_KEYS), (_name, set(ALGORITHM_KEYS) ^ set(_bundle))
assert set(SOURCES) == set(PRESETS)


def preset_values(algorithm: str, get: Callable[[str], Any]) -> dict[str, Any]:
    """The preset's {dotted key: value}, Derived values computed with `get(dotted_key)`."""
    if algorithm not in PRESETS:
        raise KeyError(algorithm)
    return {k: (v(get) if isinstance(v, Derived) else v) for k, v in PRESETS[algorithm].items()}


def no_effect_problems(t) -> list[tuple[str, str]]:
    """Combinations of the objective's keys where one key does nothing, or nothing bounds the
    estimate: (key, message naming the other key). A setting that silently does nothing is a
    run that trains something other than what its config says (docs/algorithms.md lists them).
    A key whose default is inert (kl_estimator, kl_clamp, adv_norm_scope, adv_norm_std,
    eps_clip) is refused only when changed from it, so a preset that leaves it alone passes; a
    cap under standard PPO is refused whatever its value (the areal preset derives a null one)."""
    out = []
    standard = t.proximal == "behaviour" or not t.use_decoupled_loss
    why = "trainer.proximal: behaviour" if t.proximal == "behaviour" else "trainer.use_decoupled_loss: false"
    none = f"has no effect with {why} (no behaviour weight: prox = behav, w = 1)"
    if standard:
        if t.behav_weight != "cap-mask":
            out.append(("behav_weight", f"{t.behav_weight} {none}"))
        elif t.behav_imp_weight_cap is not None:
            out.append(("behav_imp_weight_cap", f"{t.behav_imp_weight_cap} {none}; set it to null"))
        if t.behav_weight_level != "token":
            out.append(("behav_weight_level", f"{t.behav_weight_level} {none}"))
    if t.behav_imp_weight_low != 0 and t.behav_weight != "mask" and not standard:
        out.append(("behav_imp_weight_low", f"{t.behav_imp_weight_low} has no effect with trainer.behav_weight: "
                                            f"{t.behav_weight} (only mask has a lower bound)"))
    if not standard and t.behav_weight == "cap-mask" and t.behav_imp_weight_cap is None \
            and t.behav_weight_level == "seq-product":
        out.append(("behav_imp_weight_cap", "null leaves trainer.behav_weight_level: seq-product unbounded "
                                            "(a sequence's likelihood ratio: 100 tokens at log-ratio 0.6 "
                                            "weigh e^60); set a cap"))
    cap, bound = t.behav_imp_weight_cap, t.log_ratio_clamp
    if not standard and cap is not None and 0 < bound <= MAX_LOG_RATIO_CLAMP and cap >= math.exp(bound):
        out.append(("behav_imp_weight_cap", f"{cap} is never reached: trainer.log_ratio_clamp: {bound} bounds "
                                            f"every weight by e^{bound:g} = {math.exp(bound):.4g}"))
    if t.kl_coef == 0:
        for key in ("kl_estimator", "kl_clamp"):
            if getattr(t, key) != _default(t, key):
                out.append((key, f"{getattr(t, key)} has no effect with trainer.kl_coef: 0 (no KL penalty)"))
    if not t.normalize_advantages:
        for key in ("adv_norm_scope", "adv_norm_std"):
            if getattr(t, key) != _default(t, key):
                out.append((key, f"{getattr(t, key)} has no effect with trainer.normalize_advantages: false"))
    if t.eps_clip_low is not None and t.eps_clip_high is not None and t.eps_clip != _default(t, "eps_clip"):
        out.append(("eps_clip", f"{t.eps_clip} has no effect: trainer.eps_clip_low and trainer.eps_clip_high "
                                f"are both set"))
    return out


def _default(t, key: str):
    """The dataclass default of field `key` of the config object `t`."""
    f = {f.name: f for f in dataclasses.fields(t)}[key]
    return f.default


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
    if t.adv_norm_std not in ADV_NORM_STDS:
        out.append(("adv_norm_std", f"must be one of {', '.join(ADV_NORM_STDS)}; got {t.adv_norm_std!r}"))
    if not (0 < t.log_ratio_clamp <= MAX_LOG_RATIO_CLAMP):
        out.append(("log_ratio_clamp", f"must be in (0, {MAX_LOG_RATIO_CLAMP:g}] (a weight times a ratio "
                                       f"must stay far below float32's e^88), got {t.log_ratio_clamp}"))
    if not t.kl_clamp > 0:
        out.append(("kl_clamp", f"must be > 0, got {t.kl_clamp}"))
    out += no_effect_problems(t)
    if t.loss_agg_norm is not None and (t.loss_agg != "seq-mean-token-sum" or t.loss_agg_norm <= 0):
        out.append(("loss_agg_norm", "must be > 0, and only with loss_agg: seq-mean-token-sum"))
    if t.leave_one_out and not t.group_baseline:
        out.append(("leave_one_out", "is a kind of group baseline: needs group_baseline: true"))
    if t.kl_coef < 0 or t.entropy_coef < 0:
        out.append(("kl_coef" if t.kl_coef < 0 else "entropy_coef", "must be >= 0"))
    if t.overlong_buffer < 0:
        out.append(("overlong_buffer", "must be >= 0 (0 = off)"))
    elif t.overlong_buffer > 0 and not (0 < t.overlong_buffer <= t.overlong_max_len):
        out.append(("overlong_buffer", f"must be <= overlong_max_len ({t.overlong_max_len})"))
    if t.overlong_penalty < 0:
        out.append(("overlong_penalty", "must be >= 0"))
    return out
