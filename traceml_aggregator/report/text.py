"""``final_summary.txt``: the summary for a human, readable in an 80-column terminal."""

from __future__ import annotations


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def render_text(summary: dict) -> str:
    """The text report of a summary document (see :mod:`traceml_aggregator.analysis.summary`)."""
    run = summary["run"]
    lines = [
        f"TraceML summary: run {run['run_name']!r}, world size {run['world_size']}, "
        f"nodes {len(run['nodes'])}",
    ]
    if run["missing_ranks"]:
        lines.append(f"PARTIAL: ranks {run['missing_ranks']} never finished")
    lines += [
        "",
        "Step time per rank (ms; phases are medians)",
        f"{'rank':>4} {'node':>4} {'steps':>6} {'median':>8} {'p95':>8} {'max':>8} "
        f"{'input':>7} {'fwd':>7} {'bwd':>7} {'opt':>7}",
    ]
    for r in summary["ranks"]:
        st = r["step_time_ms"] or {}
        ph = r["phase_median_ms"]
        lines.append(
            f"{r['rank']:>4} {_fmt(r['node_rank'], 0) if r['node_rank'] is not None else '-':>4} "
            f"{r['steps_completed']:>6} {_fmt(st.get('median')):>8} {_fmt(st.get('p95')):>8} "
            f"{_fmt(st.get('max')):>8} {_fmt(ph['input_wait']):>7} {_fmt(ph['forward']):>7} "
            f"{_fmt(ph['backward']):>7} {_fmt(ph['optimizer']):>7}"
        )
    lines += ["", "Rank end states"]
    for r in summary["ranks"]:
        end = r["end"]
        detail = ", ".join(
            f"{k} {end[k]}" for k in ("exit_code", "signal") if end.get(k) is not None
        )
        reason = f" ({end['reason']})" if end.get("reason") else ""
        lines.append(f"  rank {r['rank']}: {end['state']}{' ' + detail if detail else ''}{reason}")
    return "\n".join(lines) + "\n"
