"""Inline SVG charts for the HTML report: line charts, stacked horizontal bars, heatmaps.

Plain strings, no dependencies, no scripts: the charts render in any browser and in a saved
file without network access. Coordinates are in SVG user units (CSS pixels at 100% zoom).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from html import escape

import numpy as np

from traceml.report import grid

#: Colours of successive series (Tableau 10, readable on white and distinguishable).
PALETTE = (
    "#4e79a7",
    "#f28e2b",
    "#e15759",
    "#76b7b2",
    "#59a14f",
    "#edc948",
    "#b07aa1",
    "#ff9da7",
    "#9c755f",
    "#bab0ac",
)
_FONT = "font-family:inherit;font-size:11px;fill:#5b6573"


@dataclass(frozen=True)
class Series:
    """One line of a chart: ``xs`` and ``ys`` of equal length."""

    label: str
    xs: list[float]
    ys: list[float]
    color: str


def nice_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """Round tick values (steps of 1, 2, 2.5 or 5 × 10^k) from at most ``lo`` to at least
    ``hi``: the first and last ticks bound the axis."""
    span = hi - lo
    if span <= 0:
        span = abs(hi) or 1.0
    raw = span / count
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first = math.floor(lo / step) * step
    count = max(1, math.ceil((hi - first) / step - 1e-9))
    return [round(first + i * step, 10) for i in range(count + 1)]


def _label(value: float) -> str:
    return f"{value:g}" if abs(value) < 1e5 else f"{value:.2g}"


def _text(x: float, y: float, content: str, anchor: str = "start", extra: str = "") -> str:
    """A text element; ``content`` is escaped here."""
    return (
        f'<text x="{x:.1f}" y="{y:.1f}" text-anchor="{anchor}" style="{_FONT}"{extra}>'
        f"{escape(content)}</text>"
    )


def _line(x1: float, x2: float, y1: float, y2: float, color: str) -> str:
    return f'<line x1="{x1:.1f}" x2="{x2:.1f}" y1="{y1:.1f}" y2="{y2:.1f}" stroke="{color}"/>'


def _rect(x: float, y: float, w: float, h: float, color: str, title: str = "") -> str:
    tip = f"<title>{escape(title)}</title>" if title else ""
    size = f'width="{w:.1f}" height="{h:.1f}"'
    return f'<rect x="{x:.1f}" y="{y:.1f}" {size} fill="{color}">{tip}</rect>'


def _open(width: int, height: int, label: str) -> str:
    return (
        f'<svg class="chart" viewBox="0 0 {width} {height}" width="{width}" height="{height}" '
        f'role="img" aria-label="{escape(label)}">'
    )


def line_chart(
    series: list[Series],
    *,
    y_label: str,
    x_label: str,
    width: int = 860,
    height: int = 260,
    shade: tuple[float, float] | None = None,
    shade_label: str = "",
) -> str:
    """A line chart with axes, grid, legend and an optional shaded x range.

    Args:
        series: the lines (empty series are skipped).
        y_label: the y axis title, with its unit.
        x_label: the x axis title.
        shade: x range to shade (e.g. the analysis window), or None.
    """
    series = [s for s in series if s.xs]
    if not series:
        return ""
    left, right, top, bottom = 56, 16, 14, 40
    legend_rows = math.ceil(len(series) / 6)
    height += 18 * legend_rows
    plot_w, plot_h = width - left - right, height - top - bottom - 18 * legend_rows
    x_lo = min(min(s.xs) for s in series)
    x_hi = max(max(s.xs) for s in series)
    y_hi = max(max(s.ys) for s in series)
    x_ticks = nice_ticks(x_lo, x_hi if x_hi > x_lo else x_lo + 1, 8)
    y_ticks = nice_ticks(0.0, y_hi if y_hi > 0 else 1.0, 5)
    x0, x1, y1 = x_ticks[0], x_ticks[-1], y_ticks[-1]
    bottom_y = top + plot_h

    def px(x: float) -> float:
        return left + (x - x0) / (x1 - x0) * plot_w

    def py(y: float) -> float:
        return bottom_y - y / y1 * plot_h

    out = [_open(width, height, f"{y_label} by {x_label}")]
    if shade is not None:
        a, b = max(shade[0], x0), min(shade[1], x1)
        out.append(_rect(px(a), top, max(0.0, px(b) - px(a)), plot_h, "#eef3fa"))
        if shade_label:
            out.append(_text(px(a) + 4, top + 12, shade_label))
    for t in y_ticks:
        out.append(_line(left, left + plot_w, py(t), py(t), "#e3e7ed"))
        out.append(_text(left - 6, py(t) + 4, _label(t), "end"))
    for t in x_ticks:
        out.append(_text(px(t), bottom_y + 16, _label(t), "middle"))
    out.append(_line(left, left + plot_w, bottom_y, bottom_y, "#9aa4b2"))
    out.append(_text(left + plot_w / 2, bottom_y + 32, x_label, "middle"))
    out.append(
        _text(
            0,
            0,
            y_label,
            "middle",
            f' transform="translate(14 {top + plot_h / 2:.1f}) rotate(-90)"',
        )
    )
    for s in series:
        points = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in zip(s.xs, s.ys, strict=True))
        out.append(
            f'<polyline points="{points}" fill="none" stroke="{s.color}" stroke-width="1.6" '
            'stroke-linejoin="round"/>'
        )
    for i, s in enumerate(series):
        lx, ly = left + (i % 6) * 130, bottom_y + 48 + (i // 6) * 18
        out.append(_rect(lx, ly - 9, 14, 4, s.color))
        out.append(_text(lx + 20, ly - 4, s.label))
    out.append("</svg>")
    return "".join(out)


def stacked_bars(
    rows: list[tuple[str, list[float | None]]],
    parts: list[tuple[str, str]],
    *,
    unit: str,
    width: int = 860,
) -> str:
    """Horizontal stacked bars, one per row, on a shared scale.

    Args:
        rows: ``(row label, values)``; values line up with ``parts``; None counts as 0.
        parts: ``(part label, colour)`` of each segment.
        unit: unit of the values, for the axis.
    """
    if not rows:
        return ""
    left, right, bar_h, gap, top = 76, 16, 18, 8, 26
    plot_w = width - left - right
    total = max(sum(v or 0.0 for v in values) for _, values in rows) or 1.0
    ticks = nice_ticks(0.0, total, 6)
    scale = plot_w / ticks[-1]
    axis_y = top + len(rows) * (bar_h + gap)
    out = [_open(width, axis_y + 30, f"step parts per rank, {unit}")]
    for i, (label, color) in enumerate(parts):
        out.append(_rect(left + i * 120, 4, 12, 12, color))
        out.append(_text(left + i * 120 + 17, 14, label))
    for t in ticks:
        x = left + t * scale
        out.append(_line(x, x, top - 4, axis_y, "#e3e7ed"))
        out.append(_text(x, axis_y + 14, _label(t), "middle"))
    out.append(_text(left + plot_w / 2, axis_y + 28, unit, "middle"))
    for r, (label, values) in enumerate(rows):
        y = top + r * (bar_h + gap)
        out.append(_text(left - 8, y + bar_h - 5, label, "end"))
        x = float(left)
        for (part, color), value in zip(parts, values, strict=True):
            if value:
                out.append(
                    _rect(x, y, value * scale, bar_h, color, f"{label} {part}: {value:.2f} {unit}")
                )
                x += value * scale
    out.append("</svg>")
    return "".join(out)


def heatmap(
    g: grid.Grid,
    *,
    label_ranks: list[int],
    unit: str,
    width: int = 860,
    max_rows: int = 256,
    classes: int = 32,
) -> str:
    """The rank x step heatmap of ``g`` (:mod:`traceml.report.grid`): one row of rectangles
    per pixel row, each the slowest (highest level) of its ranks when there are more ranks
    than ``max_rows``, in ``classes`` colours of :data:`~traceml.report.grid.COLORS` (equal
    neighbours merged into one rectangle); the ranks of ``label_ranks`` labelled at their rows
    (those that would overlap a label placed before skipped), steps below, the scale's legend
    (``unit``) above. Each row is a ``<g data-ranks="FIRST-LAST">``."""
    if not g.ranks or not g.columns:
        return ""
    left, right, top, bottom = 84, 16, 28, 30
    levels = np.frombuffer(g.levels(), np.uint8).reshape(len(g.ranks), g.columns)
    rows = min(len(g.ranks), max_rows)
    starts = [y * len(g.ranks) // rows for y in range(rows)]
    pixels = np.maximum.reduceat(levels, starts, axis=0)
    plot_w = width - left - right
    plot_h = min(384, max(120, rows * 3))
    cell_w, row_h = plot_w / g.columns, plot_h / rows
    lo, hi = g.scale()
    colours = [grid.NO_DATA_COLOR] + [grid.colour(c / (classes - 1)) for c in range(classes)]

    def cls(level: int) -> int:
        return 0 if not level else 1 + round((level - 1) / (grid.LEVELS - 1) * (classes - 1))

    out = [_open(width, top + plot_h + bottom, f"{unit} by rank and step")]
    for c in range(classes):
        out.append(_rect(left + 60 + c * 4, 8, 4, 10, colours[1 + c]))
    out.append(_text(left + 54, 17, f"{lo:.1f} {unit}", "end"))
    out.append(_text(left + 66 + classes * 4, 17, f"{hi:.1f} {unit} or more"))
    for y in range(rows):
        first, last = starts[y], (starts[y + 1] if y + 1 < rows else len(g.ranks)) - 1
        out.append(f'<g data-ranks="{g.ranks[first]}-{g.ranks[last]}">')
        row = [cls(v) for v in pixels[y]]
        c = 0
        while c < g.columns:
            end = c
            while end + 1 < g.columns and row[end + 1] == row[c]:
                end += 1
            out.append(
                _rect(
                    left + c * cell_w,
                    top + y * row_h,
                    (end - c + 1) * cell_w,
                    row_h,
                    colours[row[c]],
                )
            )
            c = end + 1
        out.append("</g>")
    placed: list[float] = []
    for rank in label_ranks:
        y = top + (g.ranks.index(rank) + 0.5) * plot_h / len(g.ranks)
        if all(abs(y - other) >= 11 for other in placed):
            out.append(_text(left - 6, y + 4, f"rank {rank} ▸", "end", f' data-rank="{rank}"'))
            placed.append(y)
    steps = g.column_steps()
    for t in range(5):
        c = round(t * (g.columns - 1) / 4)
        out.append(
            _text(left + (c + 0.5) * cell_w, top + plot_h + 16, f"step {steps[c]}", "middle")
        )
    out.append("</svg>")
    return "".join(out)
