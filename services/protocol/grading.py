"""Requests to the reward service and its verdicts."""
from __future__ import annotations

from typing import Literal

from .codec import message


@message("grade_item")
class GradeItem:
    """One response to grade. Math: `answer`; code: `tests` in the APPS/TACO convention."""
    task: Literal["math", "code"]
    response: str
    answer: str = ""
    tests: dict | None = None


@message("grade")
class GradeRequest:
    items: list[GradeItem]
    # Seconds the caller will wait; the service answers within it (timeouts become verdicts).
    deadline_s: float = 60.0


@message("verdict")
class Verdict:
    reward: float
    correct: bool
    details: dict


@message("grade_reply")
class GradeReply:
    verdicts: list[Verdict]
