"""Math verdicts: math-verify on the final answer of a reasoning model's response.

math-verify's own timeouts use `signal.alarm` and raise ValueError off the main thread (callers
that catch it and score 0 silently zero their rewards), so they are always disabled here. Time
is bounded instead by an interval timer of our own when grading on the main thread, and, in the
service, by the pool killing a worker that overruns (see reward.pool). Either way a timeout
becomes a verdict with reason "timeout", never a silent zero.
"""
from __future__ import annotations

import contextlib
import logging
import signal
import threading

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

from reward.answer_contract import disagreeing_boxes, final_sentence, hedge, too_costly
from reward.config import RewardConfig
from reward.extract import answer_text, boxes, last_boxed
from services.protocol import Verdict

# math-verify warns once that its timeouts are off; that is deliberate here.
logging.getLogger("math_verify").setLevel(logging.ERROR)

_EXTRACTION = [LatexExtractionConfig(), ExprExtractionConfig()]
_SHOWN = 200  # characters of the extracted answer kept in a verdict


class MathTimeout(BaseException):
    """Raised by our interval timer; BaseException so math-verify's `except Exception` lets it by."""


@contextlib.contextmanager
def time_limit(seconds: float | None):
    """Interrupt the block after `seconds` (main thread only; elsewhere the caller's process
    must be killable, which the pool's workers are)."""
    if not seconds or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum, frame):
        raise MathTimeout()

    old = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _gold(answer: str):
    """Parse the reference answer, which data sets give bare (`1/2`), in LaTeX or boxed."""
    text = answer.strip()
    if "\\boxed" in text or "$" in text:
        return parse(text, _EXTRACTION, parsing_timeout=None)
    return parse(f"${text}$", _EXTRACTION, parsing_timeout=None) or \
        parse(text, _EXTRACTION, parsing_timeout=None)


def _verdict(ok: bool, cfg: RewardConfig, reason: str, extracted: str | None, **extra) -> Verdict:
    shown = None if extracted is None else extracted[:_SHOWN]
    # Counted per step (reward_hedged, reward_limits_hit): a policy drifting into hedging or
    # pathological answers shows on the report before it shows in the accuracy.
    flags = {"hedged": True} if reason.startswith("hedged") else \
        {"limit": True} if reason.startswith(("too costly", "timeout")) else {}
    return Verdict(reward=cfg.correct_reward if ok else cfg.wrong_reward, correct=ok,
                   details={"task": "math", "reason": reason, "extracted": shown, **flags, **extra})


def grade_math(response: str, answer: str, cfg: RewardConfig | None = None,
               timeout_s: float | None = -1.0) -> Verdict:
    """Grade one response against the reference `answer`.

    The final answer is the content of the last `\\boxed{}` after `</think>`. Without a box:
    wrong when `cfg.math_require_box`, else math-verify's extraction on the answer sentence
    (the last sentence naming the answer, else the last sentence). A hedged or pathological
    answer is wrong before any symbolic work (answer_contract.py). `timeout_s` -1
    means cfg.math_timeout_s, None means no in-process limit.
    """
    cfg = cfg or RewardConfig()
    if timeout_s is not None and timeout_s < 0:
        timeout_s = cfg.math_timeout_s
    text = answer_text(response)
    if text is None:
        return _verdict(False, cfg, "no answer: <think> block never closed", None)
    boxed = last_boxed(text)
    if boxed is None and cfg.math_require_box:
        return _verdict(False, cfg, "no \\boxed{} answer", None, source="none")
    source = "boxed" if boxed is not None else "fallback: the answer sentence"
    # The answer contract (answer_contract.py): one final answer, at a bounded cost.
    final = boxed if boxed is not None else final_sentence(text)
    why = too_costly(final) or hedge(final, answer, prose=boxed is None) or \
        (disagreeing_boxes(text, boxes(text), answer) if boxed is not None else None)
    if why:
        return _verdict(False, cfg, why, final, source=source)
    try:
        with time_limit(timeout_s):
            gold = _gold(answer)
            if not gold:
                return _verdict(False, cfg, f"reference answer {answer[:100]!r} is not parsable", None,
                                source=source)
            pred = parse(f"\\boxed{{{boxed}}}" if boxed is not None else final, _EXTRACTION,
                         parsing_timeout=None)
            if not pred:
                return _verdict(False, cfg, "no parsable answer", boxed, source=source)
            extracted = str(pred[-1])
            ok = verify(gold, pred, timeout_seconds=None)
    except MathTimeout:
        return _verdict(False, cfg, f"timeout: grading took over {timeout_s:g}s", boxed, source=source)
    except RecursionError:
        return _verdict(False, cfg, "answer too deeply nested to parse", boxed, source=source)
    return _verdict(ok, cfg, "correct" if ok else "wrong answer", extracted, source=source)
