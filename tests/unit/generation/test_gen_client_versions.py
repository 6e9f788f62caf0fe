"""The generation client's reading of SGLang 0.5.23 replies, without a server: per-token versions
from `weight_versions` spans (validated) and the seed mode from `/server_info`. The client over
real HTTP is in tests/integration/generation/test_gen_client_contract.py.
"""
from __future__ import annotations

import pytest

from tandem.rollout.client.generate import seed_mode_from_server_info, token_versions


def test_token_versions_from_spans():
    meta = {"weight_version": "3", "weight_versions": [{"version": "1", "start": 0, "end": 2},
                                                       {"version": "3", "start": 2, "end": 5}]}
    assert token_versions(meta, 5) == [1, 1, 3, 3, 3]
    # no spans (older servers): every token gets the reply's version
    assert token_versions({"weight_version": "7"}, 3) == [7, 7, 7]
    # a reply with no tokens still names its version in one empty span
    assert token_versions({"weight_version": "2", "weight_versions": [{"version": "2", "start": 0, "end": 0}]},
                          0) == []


@pytest.mark.parametrize("spans, n, why", [
    ([{"version": "1", "start": 0, "end": 2}], 3, "cover 2 tokens but the reply has 3"),
    ([{"version": "1", "start": 0, "end": 2}, {"version": "2", "start": 3, "end": 4}], 4, "does not continue"),
    ([{"version": "1", "start": 1, "end": 3}], 2, "does not continue"),
    ([{"version": "1", "start": 0, "end": 3}, {"version": "2", "start": 3, "end": 2}], 3, "does not continue"),
    ([], 0, "non-empty list"),
    ([{"version": "1", "start": 0}], 1, "is not a"),
])
def test_token_versions_rejects_bad_spans(spans, n, why):
    with pytest.raises(ValueError, match=why):
        token_versions({"weight_versions": spans}, n)


def test_token_versions_rejects_a_final_version_that_is_not_the_last_span():
    with pytest.raises(ValueError, match="differs from the last span"):
        token_versions({"weight_version": "2", "weight_versions": [{"version": "1", "start": 0, "end": 1}]}, 1)


def test_seed_mode_from_server_info():
    assert seed_mode_from_server_info({"version": "tandem-embedded-0.5.23"}) == "stream"
    assert seed_mode_from_server_info({"version": "0.5.23", "enable_deterministic_inference": True}) == "position"
    assert seed_mode_from_server_info({"version": "0.5.23", "enable_deterministic_inference": False}) == "ignored"
