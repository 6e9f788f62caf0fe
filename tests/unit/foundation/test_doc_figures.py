"""Every measured figure in README.md and docs/*.md is backed by a committed result it cites.

Why: figures copied into prose by hand drift from the runs that produced them (docs/controller.md
once gave 1,460 admissions/s while the committed result said 2,029). This test reads the docs
the way a reviewer would and fails on a figure nobody can trace.

The convention (also in docs/architecture.md, "Benchmarks and the figures in these docs"):

- A **citation** is an HTML comment on its own line, invisible when rendered:
  `<!-- figures: benchmarks/results/controller.json -->` (several files: separated by spaces
  or commas). It covers the lines after it up to the next heading or the next citation. Each
  cited path is relative to the checkout and must exist: a benchmark's result
  (`python -m benchmarks NAME --record` writes `benchmarks/results/NAME.json`, tables included) or
  another committed file (a YAML of datasheet values, a JSON of a paper's published figures).
  `file.json#prefix` narrows a JSON to its top-level keys starting with `prefix`
  (`benchmarks/results/async_vs_sync.json#eta0_`): cite as narrowly as the file allows.
- A **figure** is a measured quantity: a number followed by a unit of time (ns, µs, us, ms,
  s, sec, seconds, CPU seconds, min, minutes, h, hours), a rate (`/s`, `/h`, `per second`, or
  up to two words before them: `admissions/s`, `tokens/s`, `steps/h`, `GB/s`), a ratio
  (`1.72x`, `3×`: no space before the x), a percentage (`63.2%`) or a size (KB, MB, GB, TB,
  KiB, MiB, GiB); ranges share the unit (`55–80 s`, `1.4-3.8x`); a `K` or `M` right after the
  number multiplies it (`3.6K tokens/s`). In a table, a cell that starts with a number is a
  figure even without a unit when its column's header, or its row's first cell, names a unit
  or a measured quantity (`admissions/s`, `p99 ms`, `measured`, `time`, `speed-up`, ...); the
  first column is a label.
- **Not figures**: anything in code (fenced blocks, `inline code`: write settings, defaults,
  limits, targets and commands there, e.g. "SIGKILL after `15 s`"), HTML comments, link
  targets, configuration tables (a header cell `default`, or a first header cell `key`,
  `setting`, `option` or `variable`), and numbers without a unit (counts, versions, section
  numbers, ports, years, model sizes such as 1.5B).
- A cited figure **matches** a value of a cited file when it equals that value rounded to the
  precision the doc shows: `2,029` matches 2029.3, `0.45` matches 0.446, and an integer's
  trailing zeros are read as rounding (`9,900` matches 9898.7, `160K` matches 155,000–164,999).
  A percentage may also be a fraction (`44%` matches 0.444), a time or size may be in the
  next unit up or down (`0.45 ms` matches 0.000446, `396 KB` matches 395589), and signs are
  ignored (prose says "slower" or "−"). JSON values are all numbers of the file except its
  `machine` and `date`, including numbers inside strings of its `tables`; other files give
  every number in their text.
- An uncited figure fails, and so does a cited one that no cited file holds.

Limits, on purpose: a figure is looked up among all values its citation names, not under one
key, so cite narrowly (`#prefix`); a number without a unit in prose ("35.8 vs 11.2
steps/h": the 35.8) is not seen, so give each figure its unit.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])

CITATION = re.compile(r"^\s*<!--\s*figures:\s*(?P<paths>.+?)\s*-->\s*$")
HEADING = re.compile(r"^\s{0,3}#{1,6}\s")
FENCE = re.compile(r"^\s*(```|~~~)")

_NUM = r"(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"
_TIME = r"ns|µs|us|ms|s|sec|seconds?|min|minutes?|h|hours?|CPU seconds"
_SIZE = r"KB|MB|GB|TB|KiB|MiB|GiB"
_RATE = r"(?:[A-Za-z][A-Za-z-]*\s?){0,2}/(?:s|h)\b|per\s(?:second|s)\b"
# sign? NUM [K|M] (range NUM [K|M])* then a unit; never inside a word, a version or a date.
FIGURE = re.compile(
    rf"(?<![\w.,/^-])(?P<sign>[-−+±])?(?P<nums>{_NUM}[KM]?(?:\s?[–-]\s?{_NUM}[KM]?)*)"
    rf"(?![\d.,]\d)(?P<unit>%|[x×](?![\w×])|\s?(?:{_SIZE}|{_TIME})(?![\w/])|\s?{_RATE})")
LEADING = re.compile(rf"^[\s*~≈±+−-]*(?P<nums>{_NUM}[KM]?(?:\s?[–-]\s?{_NUM}[KM]?)*)(?![\w.,:/]*\d)(?!\s?(?:%|[x×]|[A-Za-z/]))")
NUMBER = re.compile(rf"(?<![\w.])(?P<n>{_NUM})(?P<mult>[KM])?(?![\w.]*\d)")
MEASURED_HEADER = re.compile(
    rf"(?:^|[\s(/])(?:{_TIME}|{_SIZE}|%|x)(?:$|[\s)/,])|/s\b|/h\b|per s\b"
    r"|\b(?:measured|simulated|predicted|time|throughput|speed-?up|latency|rate|efficiency|error|gain)\b",
    re.IGNORECASE)
CONFIG_FIRST_HEADERS = ("key", "setting", "option", "variable")
INLINE_CODE = re.compile(r"`[^`]*`")
COMMENT = re.compile(r"<!--.*?-->")
LINK_TARGET = re.compile(r"\]\([^)]*\)")


@dataclass(frozen=True)
class Figure:
    doc: str
    line: int
    text: str             # as written, unit and range included
    number: str           # the one number of `text` this figure is
    value: float          # absolute value, K/M applied
    precision: float      # the rounding step the doc shows
    percent: bool
    scalable: bool        # a time or size: may be written in the neighbouring unit


def _value_and_precision(token: str) -> tuple[float, float]:
    mult = {"K": 1e3, "M": 1e6}.get(token[-1], 1.0)
    digits = token.rstrip("KM").replace(",", "")
    if "." in digits:
        precision = 10.0 ** -len(digits.split(".")[1])
    else:
        stripped = digits.rstrip("0")
        precision = 10.0 ** (len(digits) - len(stripped)) if stripped else 1.0
    return float(digits) * mult, precision * mult


def _figures_in(text: str, doc: str, line: int) -> list[Figure]:
    out = []
    for m in FIGURE.finditer(text):
        unit = m.group("unit").strip()
        scalable = re.fullmatch(rf"{_TIME}|{_SIZE}", unit) is not None
        for token in re.split(r"\s?[–-]\s?", m.group("nums")):
            value, precision = _value_and_precision(token)
            out.append(Figure(doc, line, m.group(0).strip(), token, value, precision, unit == "%", scalable))
    return out


def _table_cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _leading_numbers(cell: str, doc: str, line: int, percent: bool) -> list[Figure]:
    """The number (or range) a measured cell starts with, unit or not (`| 1,460 |`, `| ~16–27 |`);
    numbers inside a cell's text (`disk sync: 4 → 8 nodes`) count only with a unit."""
    m = LEADING.match(cell)
    if not m:
        return []
    out = []
    for token in re.split(r"\s?[–-]\s?", m.group("nums")):
        value, precision = _value_and_precision(token)
        out.append(Figure(doc, line, m.group("nums"), token, value, precision, percent, not percent))
    return out


def figures_of(doc: Path, root: Path = ROOT) -> list[tuple[Figure, tuple[list[str], int] | None]]:
    """Every figure of a doc with the citation covering it (paths, line) or None."""
    rel = str(doc.relative_to(root))
    lines = doc.read_text().splitlines()
    out, citation, fenced = [], None, False
    header: list[str] | None = None          # the current table's header cells
    skip_table = False
    for i, raw in enumerate(lines, start=1):
        if FENCE.match(raw):
            fenced = not fenced
            continue
        if fenced:
            continue
        cite = CITATION.match(raw)
        if cite:
            citation = ([p for p in re.split(r"[\s,]+", cite.group("paths")) if p], i)
            continue
        if HEADING.match(raw):
            citation = None
        text = LINK_TARGET.sub("]", INLINE_CODE.sub(" ", COMMENT.sub(" ", raw)))
        if raw.lstrip().startswith("|"):
            cells = _table_cells(text)
            if header is None:
                header = [c.lower() for c in cells]
                skip_table = "default" in header or header[0] in CONFIG_FIRST_HEADERS
                continue
            if all(re.fullmatch(r":?-+:?", c) for c in cells if c) or skip_table:
                continue
            row_measured = MEASURED_HEADER.search(cells[0]) is not None
            for col, cell in enumerate(cells):
                found = _figures_in(cell, rel, i)
                column = header[col] if col < len(header) else ""
                if col > 0 and (row_measured or MEASURED_HEADER.search(column)):
                    found += _leading_numbers(cell, rel, i, percent="%" in column)
                out += [(f, citation) for f in found]
            continue
        header, skip_table = None, False
        out += [(f, citation) for f in _figures_in(text, rel, i)]
    return out


def values_of(path: Path, key_prefix: str = "") -> list[float]:
    """The numbers a cited file holds (see the module docstring); with a key prefix, only those
    under the JSON's top-level keys starting with it."""
    if path.suffix != ".json":
        return [_value_and_precision(m.group("n") + (m.group("mult") or ""))[0]
                for m in NUMBER.finditer(path.read_text())]
    data = json.loads(path.read_text())
    if key_prefix:
        data = {k: v for k, v in data.items() if k.startswith(key_prefix)}
    out: list[float] = []

    def walk(v, in_table: bool) -> None:
        if isinstance(v, bool) or v is None:
            return
        if isinstance(v, int | float):
            if math.isfinite(v):
                out.append(float(v))
        elif isinstance(v, str) and in_table:
            out.extend(_value_and_precision(m.group("n") + (m.group("mult") or ""))[0]
                       for m in NUMBER.finditer(v))
        elif isinstance(v, dict):
            for k, x in v.items():
                if not (v is data and k in ("machine", "date")):
                    walk(x, in_table or k == "tables")
        elif isinstance(v, list):
            for x in v:
                walk(x, in_table)

    walk(data, False)
    return out


def matches(f: Figure, values: list[float]) -> bool:
    scales = [1.0, 100.0] if f.percent else [1.0, 1e3, 1e-3] if f.scalable else [1.0]
    tolerance = f.precision / 2 * (1 + 1e-9)
    return any(abs(abs(v) * s - f.value) <= tolerance for v in values for s in scales)


def problems_of(doc: Path, root: Path = ROOT) -> list[str]:
    problems, cache, uncited = [], {}, set()
    for f, citation in figures_of(doc, root):
        where = f"{f.doc}:{f.line}"
        if citation is None:
            if (f.line, f.text) in uncited:      # the second number of a range
                continue
            uncited.add((f.line, f.text))
            problems.append(f"{where}: measured figure {f.text!r} cites no result")
            continue
        paths, at = citation
        missing = [p for p in paths if not (root / p.split("#")[0]).is_file()]
        if missing:
            problems.append(f"{where}: the citation at line {at} names {', '.join(missing)}, "
                            f"which does not exist in the checkout")
            continue
        values = [v for p in paths
                  for v in cache.setdefault(p, values_of(root / p.split("#")[0], p.partition("#")[2]))]
        if not matches(f, values):
            which = f"{f.number} of {f.text!r}" if f.number != f.text else repr(f.text)
            problems.append(f"{where}: {which} is not in {', '.join(paths)} (cited at line {at})")
    return problems


HOW_TO_FIX = """

How to fix (the rules: this test's docstring, or docs/architecture.md "Benchmarks and the figures
in these docs"):
- "cites no result": put `<!-- figures: benchmarks/results/NAME.json -->` on its own line before
  the figure, in its section, naming a committed file that holds it (`python -m benchmarks NAME
  --record` writes benchmarks/results/NAME.json, printed tables included); or describe it without the
  number; or, if it is a setting, default, limit or target rather than a measurement, write it in
  code (SIGKILL after `15 s`).
- "is not in": quote the cited file's value at the precision you show, cite the file that holds
  it, or rerun the benchmark with --record (on a quiet machine) and commit its result.
"""


@pytest.mark.parametrize("doc", DOCS, ids=[str(d.relative_to(ROOT)) for d in DOCS])
def test_every_figure_is_cited_and_matches_its_result(doc):
    problems = problems_of(doc)
    assert not problems, f"{len(problems)} figure(s) in {doc.relative_to(ROOT)}:\n" + "\n".join(problems) + HOW_TO_FIX


# The checker itself, on small documents: it must be able to fail.

def _check(tmp_path, text: str, result: dict | None = None) -> list[str]:
    if result is not None:
        (tmp_path / "r.json").write_text(json.dumps(result))
    doc = tmp_path / "doc.md"
    doc.write_text(text)
    return problems_of(doc, root=tmp_path)


def test_a_figure_matching_its_result_passes(tmp_path):
    text = ("<!-- figures: r.json -->\n| server | admissions/s | p50 ms |\n|---|---|---|\n"
            "| controller | 2,029 | 0.45 |\n| scaling | disk sync: 4 → 8 nodes |\n\nAbout 9,900 admissions/s, 1.7x, 44% padding, 396 KB.\n")
    result = {"a": 2029.3, "p50_ms": 0.446, "b": 9898.7, "r": 1.72, "w": 0.444, "bytes": 395589,
              "machine": {"cpus": 2}}
    assert _check(tmp_path, text, result) == []


def test_a_stale_figure_fails_naming_the_file(tmp_path):
    text = "<!-- figures: r.json -->\n| server | admissions/s |\n|---|---|\n| controller | 1,460 |\n"
    problems = _check(tmp_path, text, {"a": 2029.3})
    assert len(problems) == 1 and "'1,460' is not in r.json" in problems[0] and "doc.md:4" in problems[0]


def test_an_uncited_figure_fails_and_settings_in_code_do_not(tmp_path):
    text = ("# T\n\nA run took 486 s and reached 61.8%.\n\nSIGKILL after `15 s`; 200 steps; "
            "Python 3.11; SGLang 0.5.23; port 5555; 2026.\n\n```\n12 s\n```\n"
            "| key | default |\n|---|---|\n| `x` | 10 s |\n")
    problems = _check(tmp_path, text)
    assert [p.split(":")[1] for p in problems] == ["3", "3"]
    assert "'486 s' cites no result" in problems[0]


def test_a_citation_ends_at_the_next_heading_and_must_exist(tmp_path):
    text = "<!-- figures: r.json -->\n2 s\n\n## Next\n\n3 s\n<!-- figures: nope.json -->\n4 s\n"
    problems = _check(tmp_path, text, {"t": 2.0})
    assert len(problems) == 2
    assert "doc.md:6" in problems[0] and "cites no result" in problems[0]
    assert "nope.json, which does not exist" in problems[1]


def test_a_key_prefix_narrows_the_cited_values(tmp_path):
    result = {"eta0_s": 1.81, "eta4_s": 1.05}
    assert _check(tmp_path, "<!-- figures: r.json#eta0_ -->\n1.81 s\n", result) == []
    problems = _check(tmp_path, "<!-- figures: r.json#eta0_ -->\n1.05 s\n", result)
    assert len(problems) == 1 and "not in r.json#eta0_" in problems[0]
