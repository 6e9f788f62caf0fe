"""Sampling parameters as SGLang accepts them, and the one sampling / log-prob convention.

Convention (the trainer must reproduce it): the behaviour log-prob of a generated token is
`log_softmax(logits / T)[token]` with T the request's temperature (T = 0, greedy, uses T = 1).
Top-k / top-p only restrict which tokens may be drawn; they are not part of the reported
log-prob. Keeping truncation out makes the log-prob a smooth function of the logits, which is
what the decoupled PPO importance weights need.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

# SGLang sampling keys the embedded server accepts only at their neutral value.
NEUTRAL_KEYS = {
    "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0,
    "min_new_tokens": 0, "min_p": 0.0, "json_schema": None, "regex": None, "ebnf": None,
    "structural_tag": None, "logit_bias": None, "custom_params": None,
}
# Keys accepted and ignored (they change nothing in a non-streaming response here).
IGNORED_KEYS = {"spaces_between_special_tokens", "stream_interval", "no_stop_trim_whitespace"}


class BadRequest(ValueError):
    """Input the server refuses with HTTP 400; the message names the field."""


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    sampling_seed: int | None = None
    n: int = 1

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5 or self.top_k == 1


def _number(d: dict, key: str, kind, where: str):
    v = d[key]
    if (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
            or (kind is int and not float(v).is_integer())):
        # JSON parsers accept NaN and Infinity; a NaN temperature would pass every range check.
        raise BadRequest(f"{where}.{key} must be {'an integer' if kind is int else 'a finite number'}, got {v!r}")
    return kind(v)


def parse_sampling_params(raw, where: str = "sampling_params") -> SamplingParams:
    """Validate one SGLang `sampling_params` dict; errors name the offending key."""
    if raw is None:
        return SamplingParams()
    if not isinstance(raw, dict):
        raise BadRequest(f"{where} must be an object, got {type(raw).__name__}")
    p = SamplingParams()
    for key, value in raw.items():
        if key in ("max_new_tokens", "top_k", "n"):
            if value is None and key == "max_new_tokens":
                continue
            setattr(p, key, _number(raw, key, int, where))
        elif key in ("temperature", "top_p"):
            setattr(p, key, _number(raw, key, float, where))
        elif key == "sampling_seed":
            p.sampling_seed = None if value is None else _number(raw, key, int, where)
        elif key in ("ignore_eos", "skip_special_tokens", "no_stop_trim"):
            if not isinstance(value, bool):
                raise BadRequest(f"{where}.{key} must be true or false, got {value!r}")
            setattr(p, key, value)
        elif key == "stop":
            stops = [value] if isinstance(value, str) else value
            if stops is None:
                stops = []
            if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
                raise BadRequest(f"{where}.stop must be a non-empty string or a list of them, got {value!r}")
            p.stop = list(stops)
        elif key == "stop_token_ids":
            ids = value or []
            if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise BadRequest(f"{where}.stop_token_ids must be a list of integers, got {value!r}")
            p.stop_token_ids = list(ids)
        elif key in NEUTRAL_KEYS:
            if value is not None and value != NEUTRAL_KEYS[key]:
                raise BadRequest(f"{where}.{key}={value!r} is not supported by the embedded server "
                                 f"(only {NEUTRAL_KEYS[key]!r})")
        elif key not in IGNORED_KEYS:
            raise BadRequest(f"{where}: unknown sampling parameter {key!r}")
    if p.max_new_tokens < 0:
        raise BadRequest(f"{where}.max_new_tokens must be >= 0, got {p.max_new_tokens}")
    if p.temperature < 0:
        raise BadRequest(f"{where}.temperature must be >= 0, got {p.temperature}")
    if not (0 < p.top_p <= 1):
        raise BadRequest(f"{where}.top_p must be in (0, 1], got {p.top_p}")
    if p.top_k == 0 or p.top_k < -1:
        raise BadRequest(f"{where}.top_k must be -1 (off) or >= 1, got {p.top_k}")
    if p.n < 1:
        raise BadRequest(f"{where}.n must be >= 1, got {p.n}")
    return p


def logprob_temperature(p: SamplingParams) -> float:
    """The T of the log-prob convention: the request's temperature, or 1 when greedy."""
    return 1.0 if p.temperature < 1e-5 else p.temperature


def sample_rows(logits: torch.Tensor, params: list[SamplingParams],
                generators: list[torch.Generator]) -> tuple[list[int], list[float]]:
    """Draw one token per row; return the tokens and their log-probs under the convention above.

    Each row consumes exactly one uniform number from its own generator per token, so a seeded
    request draws the same tokens whatever else shares the batch. Rows without top-k/top-p
    (the RL default) are sampled together by inverse CDF; truncated rows one by one.

    The generators are CPU generators (engine.py `request_generator` says why); their numbers
    and every other tensor here are made on the logits' device, and only the tokens and
    log-probs come back, as python lists.
    """
    logits = logits.float()
    device = logits.device
    temps = torch.tensor([logprob_temperature(p) for p in params], dtype=torch.float32, device=device).unsqueeze(1)
    logp = torch.log_softmax(logits / temps, dim=-1)
    u = torch.tensor([torch.rand(1, generator=g, device=g.device).item() for g in generators],
                     dtype=torch.float32, device=device)
    tokens = torch.argmax(logits, dim=-1)
    plain = [i for i, p in enumerate(params) if not p.greedy and p.top_k <= 0 and p.top_p >= 1.0]
    if plain:
        rows = torch.tensor(plain, dtype=torch.long, device=device)
        cdf = torch.cumsum(logp[rows].exp(), dim=-1)
        drawn = torch.searchsorted(cdf, (u[rows] * cdf[:, -1]).unsqueeze(1)).squeeze(1)
        tokens[rows] = drawn.clamp(max=logits.shape[1] - 1)
    for i, p in enumerate(params):
        if p.greedy or i in plain:
            continue
        sorted_lp, order = torch.sort(logp[i], descending=True)
        probs = sorted_lp.exp()
        keep = torch.ones_like(probs, dtype=torch.bool)
        if p.top_k > 0:
            keep[p.top_k:] = False
        if p.top_p < 1.0:
            # Keep the smallest prefix whose mass reaches top_p (always the first token).
            keep &= (torch.cumsum(probs, 0) - probs) < p.top_p
        cdf = torch.cumsum(torch.where(keep, probs, torch.zeros_like(probs)), 0)
        j = int(torch.searchsorted(cdf, u[i] * cdf[-1]).clamp(max=int(keep.sum()) - 1).item())
        tokens[i] = order[j]
    return tokens.tolist(), logp.gather(1, tokens.unsqueeze(1)).squeeze(1).tolist()
