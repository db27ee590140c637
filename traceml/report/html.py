"""``final_summary.html``: one self-contained page (inline CSS and SVG; no script, no network).

Sections, in reading order: the verdict (what, why, next, evidence), the other findings, step
time per rank over the run, the phase breakdown per rank, memory over the run, per-node system
figures, and the rank end states. Rendered from the summary document alone, so ``traceml view
SUMMARY.json --html OUT`` gives the same page.
"""

from __future__ import annotations

import datetime
from html import escape

from traceml.analysis.document import PARTS
from traceml.core import phases
from traceml.report import grid, svg
from traceml.report.fmt import (
    MIB,
    NA,
    featured_ranks,
    gpu_temp,
    gpu_util,
    mib,
    missing_text,
    num,
    rank_rows,
)

#: Colour of each part of the step in the phase chart.
PART_COLORS = {p.name: p.color for p in phases.PARTS}
_PART_LABELS = {p.name: p.label for p in phases.PARTS}
#: Most ranks drawn as lines in one chart (the palette's size).
MAX_LINES = len(svg.PALETTE)

_CSS = """
:root{--ink:#1d2530;--muted:#5b6573;--line:#e3e7ed;--bg:#f6f8fb;--card:#fff;
--info:#2f6fb0;--warning:#b86e00;--critical:#c0392b;--ok:#2e7d4f}
*{box-sizing:border-box}
body{margin:0;background:var(--bg);color:var(--ink);
font:14px/1.5 -apple-system,"Segoe UI",Roboto,"Helvetica Neue",Arial,"Liberation Sans",sans-serif}
main{max-width:920px;margin:0 auto;padding:24px 20px 48px}
header{display:flex;justify-content:space-between;align-items:flex-end;gap:16px;
border-bottom:1px solid var(--line);padding-bottom:12px;margin-bottom:20px}
header h1{font-size:20px;margin:0;font-weight:650}
header h1 span{color:var(--muted);font-weight:400}
.meta{color:var(--muted);font-size:12.5px;text-align:right}
.meta b{color:var(--ink);font-weight:600}
section{background:var(--card);border:1px solid var(--line);border-radius:10px;
padding:16px 20px;margin-bottom:16px}
h2{font-size:15px;margin:0 0 10px;font-weight:650}
h2 small{color:var(--muted);font-weight:400;font-size:12.5px;margin-left:6px}
.verdict{border-left:6px solid var(--sev)}
.verdict .kind{font-size:22px;font-weight:700;letter-spacing:.2px;margin:2px 0 8px}
.verdict dl{display:grid;grid-template-columns:64px 1fr;gap:6px 12px;margin:0}
.verdict dt{font-weight:650;color:var(--muted);font-size:12px;text-transform:uppercase;
padding-top:2px}
.verdict dd{margin:0}
.badge{display:inline-block;border-radius:999px;padding:1px 9px;font-size:11.5px;
font-weight:650;color:#fff;background:var(--sev);vertical-align:middle;margin-left:8px}
.sev-info{--sev:var(--info)}.sev-warning{--sev:var(--warning)}.sev-critical{--sev:var(--critical)}
.sev-ok{--sev:var(--ok)}
table{border-collapse:collapse;width:100%;font-size:12.5px;font-variant-numeric:tabular-nums}
th,td{padding:5px 8px;border-bottom:1px solid var(--line);text-align:right;white-space:nowrap}
th{color:var(--muted);font-weight:600;font-size:11.5px;text-transform:uppercase;letter-spacing:.3px}
td.l,th.l{text-align:left}
td.l:last-child{white-space:normal}
td.wrap{white-space:normal;text-align:left}
tr.hl td{background:#fff6f4}
.evidence{margin-top:12px}
.evidence td{text-align:left}
.evidence td:first-child{color:var(--muted);width:180px}
ul.findings{list-style:none;margin:0;padding:0}
ul.findings li{padding:8px 0;border-bottom:1px solid var(--line)}
ul.findings li:last-child{border-bottom:0}
ul.findings .k{font-weight:650}
ul.findings .badge{margin:0 8px 0 0}
ul.findings .act{color:var(--muted);font-size:12.5px}
.note{color:var(--muted);font-size:12.5px;margin:6px 0 0}
.bar{display:inline-block;width:64px;height:8px;background:var(--line);border-radius:4px;
vertical-align:middle;margin-left:6px;overflow:hidden}
.bar i{display:block;height:100%;background:var(--info)}
svg.chart{display:block;max-width:100%;height:auto}
details summary{cursor:pointer;color:var(--muted);font-size:12.5px}
footer{color:var(--muted);font-size:12px;text-align:center}
"""


def _e(value) -> str:
    return escape(str(value))


def _badge(severity: str, text: str | None = None) -> str:
    return f'<span class="badge sev-{_e(severity)}">{_e(text or severity)}</span>'


def _table(
    headers: list[str],
    rows: list[list[str]],
    highlight: list[bool] | None = None,
    left: tuple[int, ...] = (0,),
) -> str:
    """A table of already escaped cells; columns in ``left`` align left, the rest right."""

    def cls(i: int) -> str:
        return ' class="l"' if i in left else ""

    head = "".join(f"<th{cls(i)}>{_e(h)}</th>" for i, h in enumerate(headers))
    body = []
    for n, row in enumerate(rows):
        hl = ' class="hl"' if highlight and highlight[n] else ""
        body.append(
            f"<tr{hl}>" + "".join(f"<td{cls(i)}>{c}</td>" for i, c in enumerate(row)) + "</tr>"
        )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def _bar(pct: float | None) -> str:
    if pct is None:
        return NA
    width = max(0.0, min(100.0, pct))
    return f'{pct:.0f}<span class="bar"><i style="width:{width:.0f}%"></i></span>'


def _header(summary: dict) -> str:
    run = summary["run"]
    window = summary["analysis"]["window"]
    clock = summary["analysis"]["clock"]
    when = datetime.datetime.fromtimestamp(
        summary["generated_unix_s"], tz=datetime.timezone.utc
    ).strftime("%Y-%m-%d %H:%M UTC")
    state = "live" if summary.get("live") else "complete" if run["complete"] else "partial"
    steps = (
        f"steps <b>{window['first_step']}–{window['last_step']}</b> ({window['steps']})"
        if window["steps"]
        else "no step window"
    )
    return (
        f"<header><h1>TraceML <span>· {_e(run['run_name'])}</span></h1>"
        f'<div class="meta"><b>{run["world_size"]}</b> ranks on <b>{len(run["nodes"])}</b> '
        f'node(s) · {steps} · <b title="{_e(clock["reason"])}">{_e(clock["name"].upper())}</b> '
        f"clock · {_badge('ok' if state == 'complete' else 'warning', state)}<br>{when}</div>"
        "</header>"
    )


def _evidence(evidence: dict) -> str:
    rows = []
    for key, value in evidence.items():
        if isinstance(value, (dict, list)):
            continue  # per-rank detail: in the tables below and in the JSON
        shown = num(value, 2) if isinstance(value, float) else value
        rows.append(f"<tr><td>{_e(key.replace('_', ' '))}</td><td>{_e(shown)}</td></tr>")
    return f'<table class="evidence">{"".join(rows)}</table>' if rows else ""


def _verdict(summary: dict) -> str:
    p = summary["primary_diagnosis"]
    who = ""
    if p["kind"] == "NODE_STRAGGLER" and p["nodes"]:
        who = " · node " + ", ".join(map(str, p["nodes"]))
    elif (p["kind"].endswith("STRAGGLER") or p["kind"] == "RANK_HUNG") and p["ranks"]:
        who = " · rank " + ", ".join(map(str, p["ranks"][:8]))
    partial = ""
    if summary["run"]["missing_ranks"]:
        partial = f'<p class="note">Partial summary: {_e(missing_text(summary))}.</p>'
    return (
        f'<section class="verdict sev-{_e(p["severity"])}"><h2>Verdict</h2>'
        f'<div class="kind">{_e(p["kind"])}{_e(who)}{_badge(p["severity"])}</div>'
        f"<dl><dt>Why</dt><dd>{_e(p['summary'])}</dd>"
        f"<dt>Next</dt><dd>{_e(p['action'])}</dd></dl>"
        f"{_evidence(p['evidence'])}{partial}</section>"
    )


def _findings(summary: dict) -> str:
    items = []
    for section, findings in summary["findings"].items():
        for f in findings:
            items.append(
                f'<li>{_badge(f["severity"])}<span class="k">{_e(f["kind"])}</span> '
                f"<small>({_e(section.replace('_', ' '))})</small><br>{_e(f['summary'])}"
                f'<div class="act">Next: {_e(f["action"])}</div></li>'
            )
    if not items:
        return ""
    return f'<section><h2>Other findings</h2><ul class="findings">{"".join(items)}</ul></section>'


def _chart_ranks(summary: dict) -> list[dict]:
    """Ranks drawn as lines: those the verdict names and its typical rank first, then by rank."""
    shown, _ = rank_rows(summary)
    first = featured_ranks(summary)
    return sorted(shown, key=lambda r: (r["rank"] not in first, r["rank"]))[:MAX_LINES]


def _step_chart(summary: dict) -> str:
    ranks = [r for r in _chart_ranks(summary) if r["series"]["step"]]
    if not ranks:
        return (
            '<section><h2>Step time per rank</h2><p class="note">No step data was '
            "recorded.</p></section>"
        )
    window = summary["analysis"]["window"]
    shade = (window["first_step"], window["last_step"]) if window["steps"] else None
    chart = svg.line_chart(
        [
            svg.Series(
                f"rank {r['rank']}",
                r["series"]["step"],
                r["series"]["step_ms"],
                svg.PALETTE[i % len(svg.PALETTE)],
            )
            for i, r in enumerate(ranks)
        ],
        y_label="step time (ms)",
        x_label="step",
        shade=shade,
        shade_label="analysis window",
    )
    more = len(summary["ranks"]) - len(ranks)
    note = f'<p class="note">{more} more ranks not drawn (see the JSON).</p>' if more > 0 else ""
    return (
        "<section><h2>Step time per rank <small>over the run; shaded: the analysis window"
        f"</small></h2>{chart}{note}</section>"
    )


def _measured(xs: list, ys: list) -> tuple[list, list]:
    """The points of ``xs``, ``ys`` whose y is not None."""
    kept = [(x, y) for x, y in zip(xs, ys, strict=True) if y is not None]
    return [x for x, _ in kept], [y for _, y in kept]


def _scale_charts(summary: dict) -> str:
    """Above :data:`~traceml.report.grid.SCALE_RANKS` ranks, in place of one line per rank:
    the rank x step heatmap of step time and the band over the ranks with the slowest ranks
    as lines (:mod:`traceml.report.grid`, as the dashboard draws them), from each rank's
    charted series."""
    g = grid.from_series(
        {r["rank"]: (r["series"]["step"], r["series"]["step_ms"]) for r in summary["ranks"]}
    )
    if not g.columns:
        return _step_chart(summary)
    slowest = g.slowest()
    heat = svg.heatmap(g, label_ranks=slowest, unit="ms")
    steps, band = g.column_steps(), g.band()
    lines = [
        ("max", band["max"], "#9aa4b2"),
        ("median", band["median"], "#1d2530"),
        ("min", band["min"], "#9aa4b2"),
    ]
    lines += [
        (f"rank {r}", g.row(r), svg.PALETTE[(i + 2) % len(svg.PALETTE)])
        for i, r in enumerate(slowest)
    ]
    chart = svg.line_chart(
        [svg.Series(label, *_measured(steps, ys), color) for label, ys, color in lines],
        y_label="step time (ms)",
        x_label="step",
    )
    each = f"mean of {g.bin_steps} steps" if g.bin_steps > 1 else "one step"
    return (
        f"<section><h2>Step time by rank and step <small>{len(g.ranks)} ranks, rows in rank "
        f"order, each row the slowest of its ranks; a column: {each}; labelled: the "
        f"{len(slowest)} slowest ranks</small></h2>{heat}</section>"
        "<section><h2>Spread over ranks <small>step time: min, median and max over the "
        f"ranks, and the {len(slowest)} slowest ranks</small></h2>{chart}</section>"
    )


def _phase_chart(summary: dict) -> str:
    shown, left_out = rank_rows(summary)
    shown = [r for r in shown if r["step_time_ms"]]
    if not shown:
        return ""
    clock = summary["analysis"]["clock"]["name"].upper()
    chart = svg.stacked_bars(
        [(f"rank {r['rank']}", [r["phase_median_ms"][p] for p in PARTS]) for r in shown],
        [(_PART_LABELS[p], PART_COLORS[p]) for p in PARTS],
        unit=f"ms per step (median, {clock} clock)",
    )
    named = set(summary["primary_diagnosis"]["ranks"])
    rows, hl = [], []
    for r in shown:
        st = r["step_time_ms"]
        ph = r["phase_median_ms"]
        rows.append(
            [
                _e(r["rank"]),
                _e(num(r["node_rank"], 0)),
                _e(r["records_received"]),
                num(st["median"]),
                num(st["p95"]),
            ]
            + [num(ph[p]) for p in PARTS]
        )
        hl.append(r["rank"] in named and len(named) < len(summary["ranks"]))
    table = _table(
        ["rank", "node", "steps", "step", "p95"] + [_PART_LABELS[p] for p in PARTS],
        rows,
        hl,
    )
    more = f'<p class="note">{left_out} more ranks in the JSON.</p>' if left_out else ""
    return (
        "<section><h2>Phase breakdown per rank <small>median ms per step over the analysis "
        f"window</small></h2>{chart}{table}{more}</section>"
    )


def _memory_chart(summary: dict) -> str:
    ranks = [r for r in _chart_ranks(summary) if r["series"]["memory_step"]]
    if not ranks:
        reasons = {r["memory"]["unavailable_reason"] for r in summary["ranks"]} - {None}
        why = "; ".join(sorted(reasons)) or "no CUDA memory readings"
        return (
            "<section><h2>Memory over the run</h2>"
            f'<p class="note">Nothing to chart: {_e(why)}.</p></section>'
        )
    chart = svg.line_chart(
        [
            svg.Series(
                f"rank {r['rank']}",
                r["series"]["memory_step"],
                [b / MIB for b in r["series"]["peak_allocated_bytes"]],
                svg.PALETTE[i % len(svg.PALETTE)],
            )
            for i, r in enumerate(ranks)
        ],
        y_label="peak allocated (MiB)",
        x_label="step",
    )
    rows = [
        [
            _e(r["rank"]),
            mib(m["peak_allocated_bytes"]),
            mib(m["peak_reserved_bytes"]),
            mib(m["gpu_total_bytes"]),
            _bar(m["pressure_pct"]),
            _e((m["trend"] or {}).get("name", NA)),
        ]
        for r in rank_rows(summary)[0]
        for m in [r["memory"]]
    ]
    table = _table(
        ["rank", "peak alloc MiB", "peak reserved MiB", "GPU total MiB", "used %", "trend"], rows
    )
    return (
        "<section><h2>Memory over the run <small>CUDA caching allocator, peak allocated per "
        f"reading</small></h2>{chart}{table}</section>"
    )


def _nodes(summary: dict) -> str:
    rows = []
    notes = []
    for n in summary["nodes"]:
        s = n["system"]
        rows.append(
            [
                _e(n["node_rank"]),
                _e(n["hostname"] or NA),
                _e(len(n["ranks"])),
                _e(num(n["exit_code"], 0)),
                num(n["step_time_ms_median"]),
                _bar((s["cpu_percent"] or {}).get("median")),
                _bar(s["ram_used_pct_max"]),
                _bar(gpu_util(n)),
                _e(num(gpu_temp(n), 0)),
            ]
        )
        if s["unavailable_reason"]:
            notes.append(f"node {n['node_rank']}: {s['unavailable_reason']}")
        for g in s["gpus"]:
            if g["unavailable_reason"]:
                notes.append(
                    f"node {n['node_rank']} GPU {g['nvml_index']}: {g['unavailable_reason']}"
                )
    if not rows:
        return ""
    note = "".join(f'<p class="note">{_e(t)}</p>' for t in notes)
    table = _table(
        [
            "node",
            "host",
            "ranks",
            "exit",
            "step ms",
            "CPU % (median)",
            "RAM % (max)",
            "GPU util % (median)",
            "GPU °C (max)",
        ],
        rows,
        left=(0, 1),
    )
    return (
        "<section><h2>Nodes <small>system figures over the analysis window</small></h2>"
        f"{table}{_gpu_table(summary)}{note}</section>"
    )


def _gpu_table(summary: dict) -> str:
    rows = [
        [
            _e(n["node_rank"]),
            _e(g["nvml_index"]),
            _bar(g["util_percent_median"]),
            mib(g["memory_used_bytes_max"]),
            mib(g["memory_total_bytes"]),
            _e(num(g["temperature_c_max"], 0)),
            _e(num(g["power_w_median"], 0)),
        ]
        for n in summary["nodes"]
        for g in n["system"]["gpus"]
    ]
    if not rows:
        return ""
    return '<h2 style="margin-top:14px">GPUs</h2>' + _table(
        ["node", "GPU", "util % (median)", "used MiB (max)", "total MiB", "°C (max)", "W (median)"],
        rows,
    )


def _ends(summary: dict) -> str:
    rows, hl = [], []
    for r in summary["ranks"]:
        end = r["end"]
        ok = end["state"] == "completed"
        rows.append(
            [
                _e(r["rank"]),
                _e(num(r["node_rank"], 0)),
                _e(r["hostname"] or NA),
                _badge("ok" if ok else "critical", end["state"]),
                _e(num(end["exit_code"], 0)),
                _e(num(end["signal"], 0)),
                _e(r["steps_completed"]),
                _e(num(r["records_dropped"], 0)),
                _e(end["reason"] or ""),
            ]
        )
        hl.append(not ok)
    return (
        "<section><h2>Rank end states</h2>"
        + _table(
            ["rank", "node", "host", "state", "exit", "signal", "steps", "dropped", "reason"],
            rows,
            hl,
            left=(0, 2, 3, 8),
        )
        + "</section>"
    )


def _footer(summary: dict) -> str:
    limits = "".join(
        f"<tr><td>{_e(k)}</td><td>{_e(v)}</td></tr>"
        for k, v in summary["analysis"]["thresholds"].items()
    )
    return (
        f"<section><details><summary>Thresholds used (docs/reading-output.md)</summary>"
        f'<table class="evidence">{limits}</table></details>'
        f'<p class="note">Clock: {_e(summary["analysis"]["clock"]["reason"])}.</p></section>'
        f"<footer>TraceML summary · schema version {_e(summary['schema_version'])}</footer>"
    )


def render_html(summary: dict) -> str:
    """The HTML report of a summary document."""
    title = f"TraceML · {summary['run']['run_name']} · {summary['primary_diagnosis']['kind']}"
    body = "".join(
        [
            _header(summary),
            _verdict(summary),
            _findings(summary),
            _scale_charts(summary)
            if len(summary["ranks"]) > grid.SCALE_RANKS
            else _step_chart(summary),
            _phase_chart(summary),
            _memory_chart(summary),
            _nodes(summary),
            _ends(summary),
            _footer(summary),
        ]
    )
    return (
        '<!doctype html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width,initial-scale=1">'
        f"<title>{_e(title)}</title><style>{_CSS}</style></head>"
        f"<body><main>{body}</main></body></html>\n"
    )
