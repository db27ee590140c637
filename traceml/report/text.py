"""``final_summary.txt``: the summary for a human, verdict first, at most 80 columns wide.

Order: a one-line header (run, topology, window, clock), the verdict (what, why, next), the
other findings, then compact tables: step time per rank, throughput and MFU, time outside the
steps, memory, processes, nodes, rank ends.
Everything comes from the summary document, so ``traceml view`` renders a saved JSON the same.
"""

from __future__ import annotations

import textwrap

from traceml.analysis.findings import ranks_text
from traceml.core import phases
from traceml.report.fmt import (
    end_text,
    gpu_temp,
    gpu_util,
    mib,
    missing_text,
    num,
    rank_rows,
)

#: Width of the report (an 80-column terminal).
WIDTH = 80
_LABEL = 10  # width of the VERDICT/WHY/NEXT column


def _wrap(label: str, text: str) -> list[str]:
    return textwrap.wrap(
        text,
        WIDTH,
        initial_indent=f"{label:<{_LABEL}}",
        subsequent_indent=" " * _LABEL,
        break_on_hyphens=False,
    )


def _table(headers: list[str], rows: list[list[str]], left: int = 0) -> list[str]:
    """Columns right-aligned except the first ``left`` ones; widths from the content."""
    widths = [max(len(str(c)) for c in col) for col in zip(headers, *rows, strict=True)]

    def line(cells) -> str:
        return "  ".join(
            f"{c:<{w}}" if i < left else f"{c:>{w}}"
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ).rstrip()

    return [line(headers)] + [line(r) for r in rows]


def header(summary: dict) -> list[str]:
    """Two lines: the run's name, then topology, window and clock."""
    run = summary["run"]
    window = summary["analysis"]["window"]
    nodes = len(run["nodes"])
    parts = [
        f"{run['world_size']} rank{'s' * (run['world_size'] != 1)} on {nodes} "
        f"node{'s' * (nodes != 1)}"
    ]
    if window["steps"]:
        parts += [
            f"window: steps {window['first_step']}-{window['last_step']} ({window['steps']})",
            f"{summary['analysis']['clock']['name'].upper()} clock",
        ]
    else:
        parts.append("no step data")
    if summary.get("live"):
        parts.append("live")
    title = f"TraceML summary · run '{run['run_name']}'"
    return [title if len(title) <= WIDTH else title[: WIDTH - 1] + "…", " · ".join(parts)]


def _verdict(summary: dict) -> list[str]:
    p = summary["primary_diagnosis"]
    who = []
    if p["nodes"] and p["kind"] == "NODE_STRAGGLER":
        who.append("node " + ", ".join(map(str, p["nodes"])))
    elif p["ranks"] and (p["kind"].endswith("STRAGGLER") or p["kind"] == "RANK_HUNG"):
        who.append(
            ("rank " if len(p["ranks"]) == 1 else "ranks ") + ", ".join(map(str, p["ranks"][:8]))
        )
    title = f"{p['kind']} [{p['severity']}]" + (f" · {who[0]}" if who else "")
    return _wrap("VERDICT", title) + _wrap("WHY", p["summary"]) + _wrap("NEXT", p["action"])


def _findings(summary: dict) -> list[str]:
    lines = []
    for items in summary["findings"].values():
        for f in items:
            lines += textwrap.wrap(
                f"[{f['severity']}] {f['kind']}: {f['summary']}",
                WIDTH,
                initial_indent="  ",
                subsequent_indent="    ",
            )
    return ["", "Other findings"] + lines if lines else []


def _step_table(summary: dict) -> list[str]:
    shown, left_out = rank_rows(summary)
    if not any(r["step_time_ms"] for r in shown):
        return []
    rows = []
    for r in shown:
        st = r["step_time_ms"] or {}
        ph = r["phase_median_ms"]
        rows.append(
            [
                str(r["rank"]),
                num(r["node_rank"], 0),
                str(r["records_received"]),
                num(st.get("median")),
                num(st.get("p95")),
            ]
            + [num(ph[p.name]) for p in phases.PARTS]
        )
    clock = summary["analysis"]["clock"]["name"].upper()
    lines = ["", f"Step time per rank (ms, medians over the window; {clock} clock)"]
    lines += _table(
        ["rank", "node", "steps", "step", "p95"] + [p.short for p in phases.PARTS],
        rows,
    )
    typ = summary["analysis"]["typical"]
    share = typ["phase_share_pct"]
    lines += textwrap.wrap(
        "typical share of the step: "
        + ", ".join(
            f"{k.replace('_wait', '')} {num(v, 0)}%" for k, v in share.items() if v is not None
        ),
        WIDTH,
        subsequent_indent="  ",
    )
    if left_out:
        lines.append(f"... {left_out} more ranks in final_summary.json")
    return lines


def _sig(value: float | None) -> str:
    """3 significant digits (a CPU model's 1.02e-08 TFLOP/s is not 0.000); ``-`` for None."""
    return "-" if value is None else f"{value:.3g}"


def _throughput(summary: dict) -> list[str]:
    """Samples/s, tokens/s and MFU (``analysis.throughput``, ``ranks[].throughput``), when
    any rank counted samples or FLOPs."""
    shown, _ = rank_rows(summary)
    rows = [
        [
            str(r["rank"]),
            num(t["samples_per_s"]),
            num(t["tokens_per_s"], 0),
            _sig(t["mfu"]["achieved_tflops"]),
            _sig(t["mfu"]["mfu_pct"]),
            t["mfu"]["dtype"] or "-",
            num(t["mfu"]["peak_tflops"], 1),
        ]
        for r in shown
        for t in [r.get("throughput")]
        if t and (t["samples_per_s"] is not None or t["mfu"]["forward_flops"] is not None)
    ]
    if not rows:
        return []
    job = summary["analysis"]["throughput"]
    figures = [f"{num(job['samples_per_s'])} samples/s"]
    if job["tokens_per_s"] is not None:
        figures.append(f"{num(job['tokens_per_s'], 0)} tokens/s")
    if job["mfu_pct"] is not None:
        figures.append(
            f"MFU {_sig(job['mfu_pct'])}% ({_sig(job['achieved_tflops'])} of "
            f"{_sig(job['peak_tflops'])} TFLOPS)"
        )
    else:
        figures.append(f"MFU n/a ({job['mfu_unavailable_reason']})")
    lines = ["", "Throughput (window totals over wall time; job: sum over ranks)"]
    lines += textwrap.wrap(
        "job: " + ", ".join(figures), WIDTH, initial_indent="  ", subsequent_indent="    "
    )
    return lines + _table(
        ["rank", "samples/s", "tokens/s", "TFLOP/s", "MFU %", "dtype", "peak"], rows
    )


def _outside_table(summary: dict) -> list[str]:
    """Time outside the steps per rank (``ranks[].outside_steps``), when any rank paused."""
    shown, _ = rank_rows(summary)
    rows = [
        [
            str(r["rank"]),
            num(o["share_of_wall_pct"], 0),
            str(o["gaps"]),
            num(o["gap_median_ms"]),
            num(o["gap_max_ms"]),
            num(o["period_steps"], 0),
            num(o["first_gap_ms"]),
        ]
        for r in shown
        for o in [r.get("outside_steps")]
        if o and o["gaps"]
    ]
    if not rows:
        return []
    return [
        "",
        "Time outside the steps (not DataLoader wait; % of wall time, pauses in ms;",
        "first: the gap before step 1, start-up, left out of the share)",
    ] + _table(["rank", "wall %", "pauses", "median", "max", "every", "first"], rows)


def _memory_table(summary: dict) -> list[str]:
    shown, _ = rank_rows(summary)
    rows = [
        [
            str(r["rank"]),
            mib(m["peak_allocated_bytes"]),
            mib(m["peak_reserved_bytes"]),
            mib(m["gpu_total_bytes"]),
            num(m["pressure_pct"], 0),
            (m["trend"] or {}).get("name", "-"),
        ]
        for r in shown
        for m in [r["memory"]]
        if m["peak_allocated_bytes"] is not None
    ]
    if not rows:
        return []
    return ["", "GPU memory per rank (MiB)"] + _table(
        ["rank", "peak alloc", "peak reserved", "gpu total", "used %", "trend"], rows
    )


def _process_table(summary: dict) -> list[str]:
    shown, _ = rank_rows(summary)
    rows = [
        [str(r["rank"]), num(p["cpu_percent_median"], 0), mib(p["rss_bytes_max"])]
        for r in shown
        for p in [r["process"]]
        if p["samples"]
    ]
    if not rows:
        return []
    return ["", "Processes (CPU % of one core, median; RSS MiB, max)"] + _table(
        ["rank", "cpu %", "rss"], rows
    )


def _node_table(summary: dict) -> list[str]:
    rows = []
    for n in summary["nodes"]:
        sys_ = n["system"]
        rows.append(
            [
                str(n["node_rank"]),
                (n["hostname"] or "-")[:16],
                str(len(n["ranks"])),
                num(n["exit_code"], 0),
                num(n["step_time_ms_median"]),
                num((sys_["cpu_percent"] or {}).get("median"), 0),
                num(sys_["ram_used_pct_max"], 0),
                num(gpu_util(n), 0),
                num(gpu_temp(n), 0),
            ]
        )
    if not rows:
        return []
    lines = ["", "Nodes (cpu % median, ram % max, gpu util % median, gpu °C max)"]
    lines += _table(
        ["node", "host", "ranks", "exit", "step ms", "cpu %", "ram %", "gpu %", "gpu °C"],
        rows,
        left=2,
    )
    reasons = {n["system"]["unavailable_reason"] for n in summary["nodes"]} - {None}
    lines += [f"  ({reason})" for reason in sorted(reasons)]
    return lines


def _ends(summary: dict) -> list[str]:
    ranks = summary["ranks"]
    done = [r["rank"] for r in ranks if r["end"]["state"] == "completed"]
    lines = ["", "Rank end states"]
    if done:
        lines.append(f"  completed: {len(done)} of {len(ranks)} ranks")
    alike: dict[str, list[int]] = {}  # ranks that ended alike, by how
    for r in ranks:
        if r["end"]["state"] != "completed":
            alike.setdefault(end_text(r["end"]), []).append(r["rank"])
    for end, same in list(alike.items())[:16]:
        lines += textwrap.wrap(
            f"{ranks_text(same)}: {end}", WIDTH, initial_indent="  ", subsequent_indent="    "
        )
    if len(alike) > 16:
        more = sum(len(same) for same in list(alike.values())[16:])
        lines.append(f"  ... {more} more ranks in final_summary.json")
    return lines


def render_text(summary: dict) -> str:
    """The text report of a summary document (see :mod:`traceml.analysis.summary`)."""
    run = summary["run"]
    lines = header(summary) + ["=" * WIDTH]
    if run["missing_ranks"]:
        lines += _wrap("PARTIAL", missing_text(summary))
    lines += _verdict(summary)
    lines += _findings(summary)
    lines += _step_table(summary)
    lines += _throughput(summary)
    lines += _outside_table(summary)
    lines += _memory_table(summary)
    lines += _process_table(summary)
    lines += _node_table(summary)
    lines += _ends(summary)
    return "\n".join(lines) + "\n"
