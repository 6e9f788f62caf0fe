"""The report's words beside its plots: what the run says about its own learning (the verdict,
the warnings, why it stopped) and what the model wrote (the last `samples` records).

Read from metrics.jsonl and summary.json like the rest of the report, so `tandem report` shows
them for a running, a finished or a cluster run alike.
"""
from __future__ import annotations

import html

from .learning import stopped_of, warnings_of

SAMPLE_RECORDS = 2   # the last records of samples the page shows (each `trainer.samples.n` rows)


def samples_of(records: list[dict], last: int = SAMPLE_RECORDS) -> list[dict]:
    """The last `last` `samples` records (the trainer writes one every `trainer.samples.every` steps)."""
    return [r for r in records if r.get("event") == "samples" and r.get("samples")][-last:]


def version_text(row: dict) -> str:
    lo, hi = row.get("version_min"), row.get("version_max")
    return f"v{lo}" if lo == hi else f"v{lo}–v{hi}"


def learning_lines(records: list[dict], summary: dict) -> list[str]:
    """The verdict, why the run stopped, and each kind of warning once (its last message, how often)."""
    lines = [summary["verdict"]] if summary.get("verdict") else []
    stopped = summary.get("stopped") or stopped_of(records)
    if stopped:
        lines.append(f"stopped early: {stopped}")
    last: dict[str, dict] = {}
    times: dict[str, int] = {}
    for w in warnings_of(records):
        last[w["kind"]] = w
        times[w["kind"]] = times.get(w["kind"], 0) + 1
    for kind, w in last.items():
        again = f" ({times[kind]} times, the last at step {w['step']})" if times[kind] > 1 else ""
        lines.append(f"warning{again}: {w['message']}")
    return lines


def learning_html(records: list[dict], summary: dict) -> str:
    lines = learning_lines(records, summary)
    if not lines:
        return ""
    return "<ul class='learning'>" + "".join(f"<li>{html.escape(line, quote=False)}</li>" for line in lines) + "</ul>"


def samples_html(records: list[dict]) -> str:
    """The last sample records as tables (prompt and response as written, whitespace kept), or a
    line saying why there are none."""
    found = samples_of(records)
    if not found:
        return ("<h2>Samples</h2><p class='notes'>no samples recorded (trainer.samples.every is 0, or the run "
                "has not reached a step that records them)</p>")
    parts = ["<h2>Samples</h2>"]
    for rec in reversed(found):
        rows = "".join(
            f"<tr><td>{html.escape(str(r.get('group_id')))}/{r.get('sample_idx')}</td>"
            f"<td>{r.get('reward', 0):+g}</td><td>{html.escape(version_text(r))}</td>"
            f"<td><pre>{html.escape(r.get('prompt', ''))}</pre></td><td><pre>{html.escape(r.get('response', ''))}</pre>"
            f"</td></tr>" for r in rec["samples"])
        parts.append(f"<h3>step {rec.get('step')}</h3><table class='samples'><tr><th>sample</th><th>reward</th>"
                     f"<th>version</th><th>prompt</th><th>response</th></tr>{rows}</table>")
    return "".join(parts)


STYLE = (".samples td,.samples th{border:1px solid #ccc;vertical-align:top;padding:4px}"
         ".samples{border-collapse:collapse}.samples pre{white-space:pre-wrap;max-width:40em;margin:0}"
         ".learning{font-weight:bold}")
