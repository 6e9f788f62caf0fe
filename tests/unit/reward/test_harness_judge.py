"""The sandbox's comparison of a program's output with the expected output, token by token
(reward/harness_judge.py, the rule of the `tandem` tests convention; issue 61's lenient cases)."""
from __future__ import annotations

import pytest

from tandem.reward.harness_judge import _tokens_match

WRONG = [   # (printed, expected): each passed before as a number equal to the expected one
    ("7", "007"), ("007", "7"), ("+7", "7"), ("07 1", "7 1"), ("-07", "-7"),
    ("\uff17.\uff15", "7.5"), ("\u0667.\u0665", "7.5"), ("7_0.5", "70.5"), ("infinity", "inf"), ("Infinity", "inf"),
    ("NaN", "nan"), ("+7.5", "7.5"), ("7.5e", "7.5"), ("\uff17", "7.0"),
]
RIGHT = [   # the same numbers written as a judge accepts them
    ("7", "7"), ("007", "007"), ("7.50", "7.5"), ("7.5000001", "7.5"), (".5", "0.5"), ("5.", "5.0"),
    ("7.5e0", "7.5"), ("7.5E+00", "7.5"), ("7", "7.0"), ("-0.5", "-0.5"), ("1 2\n3", "1 2 3"),
]


@pytest.mark.parametrize("printed,expected", WRONG)
def test_a_number_written_otherwise_is_wrong(printed, expected):
    assert not _tokens_match(printed, expected)


@pytest.mark.parametrize("printed,expected", RIGHT)
def test_a_decimal_within_the_tolerance_is_right(printed, expected):
    assert _tokens_match(printed, expected)


def test_an_integer_is_not_read_with_a_tolerance():
    assert not _tokens_match("7.0", "7") and not _tokens_match("123456790", "123456789")
