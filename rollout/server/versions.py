"""Which weight version produced which output tokens of one request: `meta_info.weight_versions`.

A request held on the server across a weight update (a `retract` or `in_place` pause) carries
tokens from two or more policies. SGLang 0.5.23 records, at each version change, the old version
and how many output tokens the request had (`utils/weight_versions.py`,
`record_weight_version_events`, called from the scheduler's `record_weight_version_change`),
and replies with spans `[{version, start, end}]` covering the output tokens in order, plus
`weight_version` = the last span's version (`add_weight_versions_to_meta_info`, added by the
tokenizer manager to every finished reply). This module is the embedded server's equivalent:
the same events, the same merging rules, the same reply fields.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class VersionChange:
    old_version: str
    tokens_before: int      # output tokens the request had when the version changed


def spans(changes: list[VersionChange], current: str, num_tokens: int) -> list[dict]:
    """Contiguous spans over `num_tokens` output tokens; equal neighbours merge, empty ones drop
    (except a first span, so a reply with no tokens still names its version)."""
    out: list[dict] = []
    for version, end in [(c.old_version, c.tokens_before) for c in changes] + [(current, num_tokens)]:
        end = min(end, num_tokens)
        if out and end <= out[-1]["end"]:
            continue
        if out and out[-1]["version"] == version:
            out[-1]["end"] = end
            continue
        out.append({"version": version, "start": out[-1]["end"] if out else 0, "end": end})
    return out


def add_to_meta(meta: dict, request_spans: list[dict]) -> None:
    meta["weight_versions"] = request_spans
    meta["weight_version"] = request_spans[-1]["version"]
