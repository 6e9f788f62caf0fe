"""Axes of the run report that cannot mislead: the helpers `launcher/report.py` draws with.

Matplotlib fits every axis to its data. For a flat series that magnifies noise into a trend (a
reward between -0.984 and -1.0 filled a whole panel) and, for values near 1, moves the value
into an offset label (`1e-6+1`) no reader decodes. So: no offset notation anywhere
(`NO_OFFSET`, applied while the figure is built); a floor on the span of each y-axis, centred on
the data and kept inside the values it can take; the value itself printed on the panel; a single
point labelled with its number; and a panel with nothing to draw says why.
"""
from __future__ import annotations

import math
import textwrap

NO_OFFSET = {"axes.formatter.useoffset": False}
NOTE_COLOR = "dimgray"


def fmt(v: float) -> str:
    """A value as a reader wants it on a panel: 4 significant digits, scientific only when tiny."""
    if v == 0 or not math.isfinite(v):
        return f"{v:g}"
    return f"{v:.3e}" if abs(v) < 1e-3 else f"{v:,.4g}"


def span_floor(ax, values: list[float], min_span: float, bounds: tuple[float, float] | None = None) -> None:
    """Let the y-axis span at least `min_span`, centred on the data; with `bounds` (the values
    the series can take), the window is moved inside them (padded by 5% of the span)."""
    vals = [v for v in values if v is not None and math.isfinite(v)]
    if not vals:
        return
    lo, hi = min(vals), max(vals)
    pad = 0.05 * max(hi - lo, min_span)
    if hi - lo + 2 * pad < min_span:
        mid = (lo + hi) / 2
        lo_w, hi_w = mid - min_span / 2, mid + min_span / 2
        if bounds is not None:
            shift = max(0.0, bounds[0] - pad - lo_w) - max(0.0, hi_w - bounds[1] - pad)
            lo_w, hi_w = lo_w + shift, hi_w + shift
        ax.set_ylim(lo_w, hi_w)
    else:
        ax.set_ylim(lo - pad, hi + pad)


def log_span_floor(ax, values: list[float], decades: float = 2.0) -> None:
    """A log y-axis spanning at least `decades` decades around the positive values."""
    vals = [v for v in values if v is not None and v > 0 and math.isfinite(v)]
    if not vals:
        return
    lo, hi = math.log10(min(vals)), math.log10(max(vals))
    if hi - lo < decades:
        mid = (lo + hi) / 2
        lo, hi = mid - decades / 2, mid + decades / 2
    ax.set_ylim(10 ** (lo - 0.1), 10 ** (hi + 0.1))


def print_value(ax, text: str, loc: str = "upper left") -> None:
    """A panel's figure in words, in a corner box (the axis alone may not say it)."""
    x, ha = (0.02, "left") if "left" in loc else (0.98, "right")
    y, va = (0.97, "top") if "upper" in loc else (0.03, "bottom")
    ax.text(x, y, text, transform=ax.transAxes, ha=ha, va=va, fontsize=9,
            bbox={"boxstyle": "round", "facecolor": "white", "edgecolor": "lightgray", "alpha": 0.9})


def label_points(ax, x: list, y: list, color: str, most: int = 3, text=None, at: list | None = None,
                 row: int = 0) -> None:
    """Write the value beside each point of a series of at most `most` points: one dot on an
    axis is read by its label, not by its ticks. `text` formats (default `fmt`), `at` gives
    where the points are drawn if not at their values, `row` moves the label down a line."""
    if not 0 < len(x) <= most:
        return
    for xi, yi, drawn in zip(x, y, at or y, strict=True):
        ax.annotate((text or fmt)(yi), (xi, drawn), textcoords="offset points", xytext=(6, 6 - 12 * row),
                    fontsize=9, color=color)


def note_why(ax, why: str, y: float = 0.5) -> None:
    """Say in the panel why it is empty (or what it lacks)."""
    ax.text(0.5, y, "\n".join(textwrap.wrap(why, 60)), transform=ax.transAxes, ha="center", va="center",
            color=NOTE_COLOR, fontsize=10, style="italic")


def mark_resumes(ax, xs: list[float], labels: list[str] | None = None, linestyle: str = "--",
                 color: str = "black", y: float = 1.0) -> None:
    """A dashed vertical line where the run was resumed (time axes only), labelled "resumed" or
    by what resumed it (`labels`, one per x: an automatic continuation names its cause); other
    marks (a server joining or leaving) in another `linestyle`/`color`, labelled lower (`y`)."""
    for x, label in zip(xs, labels or ["resumed"] * len(xs), strict=True):
        ax.axvline(x, color=color, linestyle=linestyle, linewidth=1, alpha=0.7)
        ax.annotate(label, (x, y), xycoords=("data", "axes fraction"), xytext=(3, -3),
                    textcoords="offset points", fontsize=8, va="top", color=color)
