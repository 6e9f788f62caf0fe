"""How far a bf16 computation may be from its fp32 reference, derived once and written down.

bf16 keeps 8 significant bits: every rounding to bf16 has a relative error of at most
u = 2**-8 (unit roundoff). On the GPU, matrix products multiply bf16 inputs and accumulate in
fp32, so the error comes from the roundings of activations and weights between operations, not
from the sums. Along a Qwen2 layer the hidden state is rounded about R_LAYER = 10 times (norm,
q/k/v, attention output, o-proj, residual, norm, gate/up, SiLU*up, down, residual), plus 3
outside the layers (embedding, final norm, head). Independent roundings add like a random walk:
the relative error of the logits is about sqrt(n) * u, so their absolute error about
sqrt(n) * u * rms(logits) =: s.

- Log-probs: log_softmax moves the error of the target's logit and of the log-sum-exp (a
  p-weighted mean of logit errors): |d logp| <= 2 * max |d logit|. Mean over tokens: 2 s.
  Largest over the ~100-1000 tokens of a check: a half-normal's maximum over N draws is about
  sqrt(2 ln N) <= 3.7 standard deviations, times 2 again for the two terms: 8 s (the tail).
- Gradient norm: the backward pass rounds as often again (n doubles) and a norm averages
  errors over all elements: relative error about sqrt(2n) * u; allowed 4 sqrt(2n) u.
- The step's effect on the policy (log-probs after minus before): Adam's first update is about
  lr * sign(g), so elements whose gradient is below the bf16 noise may flip sign; the effect
  vectors must point the same way (cosine >= 0.9: up to ~20% of the effect's energy in flipped
  or noisy parts) once the effect is at least 5 times the forward noise (asserted, else the
  check would compare noise with noise).

Packed and per-sequence forwards in bf16 are two roundings of the same function: their
difference obeys the forward bounds (twice the noise of one: 2 x mean, same tail bound); a
packing error (attention across sequences, misplaced positions) moves whole sequences by O(1).
"""
from __future__ import annotations

import math

import torch

U_BF16 = 2.0 ** -8
R_LAYER = 10
R_OUTSIDE = 3
MIN_COSINE = 0.9
MIN_EFFECT_OVER_NOISE = 5.0


def roundings(num_layers: int) -> int:
    return R_LAYER * num_layers + R_OUTSIDE


def logit_noise(num_layers: int, logits_rms: float) -> float:
    """s: the expected absolute error of a bf16 logit."""
    return math.sqrt(roundings(num_layers)) * U_BF16 * logits_rms


def logp_bounds(num_layers: int, logits_rms: float) -> tuple[float, float]:
    """(mean, max) allowed |bf16 - fp32| over the log-probs of one check."""
    s = logit_noise(num_layers, logits_rms)
    return 2 * s, 8 * s


def grad_norm_rtol(num_layers: int) -> float:
    return 4 * math.sqrt(2 * roundings(num_layers)) * U_BF16


def logits_rms(model_dir, mbs) -> float:
    """rms of the fp32 logits of these micro-batches (transformers on the CPU, one sequence at a time)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    sq, n = 0.0, 0
    with torch.no_grad():
        for mb in mbs:
            cu = mb.cu_seqlens.tolist()
            for a, b in zip(cu[:-1], cu[1:], strict=True):
                logits = model(input_ids=mb.input_ids[None, a:b]).logits[0]
                sq += float(logits.double().pow(2).sum())
                n += logits.numel()
    return math.sqrt(sq / n)


def bf16_parameters_expected(backend: str, on_gpu: bool) -> bool:
    """Whether a bf16 run's parameters are bf16: always on a GPU; on the CPU (the rehearsal) only
    on the torch backend, since Megatron's CPU path keeps float32 parameters."""
    return on_gpu or backend == "torch"


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.double()[None], b.double()[None])[0])
