"""The summary document (``final_summary.json``) built from :class:`RunData`.

Units: every duration is in milliseconds (``*_ms``), every size in bytes (``*_bytes``). A
figure that was never measured is ``null``, never 0.
"""

from __future__ import annotations

import time

from traceml_aggregator.analysis.stats import describe, median
from traceml_aggregator.rundata import RankData, RunData

#: Version of the summary document's layout; see docs/final_summary.schema.json.
SCHEMA_VERSION = 1

#: Phases of a step, as (summary name, StepRecord field in µs).
PHASES = (
    ("input_wait", "input_wait_us"),
    ("h2d", "h2d_us"),
    ("forward", "forward_us"),
    ("backward", "backward_us"),
    ("optimizer", "optimizer_us"),
)


def _ms(us: float | None) -> float | None:
    return None if us is None else us / 1000.0


def residual_us(step: dict) -> int | None:
    """Step time minus the phases measured in that step (µs); None without any phase."""
    measured = [step[field] for _, field in PHASES if step.get(field) is not None]
    if not measured:
        return None
    return step["step_us"] - sum(measured)


def end_state(rd: RankData, missing: set[int]) -> dict:
    """How a rank ended: the launcher's view (exit code, signal) wins over the rank's own
    finish marker, which cannot see a ``sys.exit(7)`` or a crash."""
    end = rd.end or {}
    finish = rd.finish or {}
    if end.get("end_state") not in (None, "completed"):
        state = end["end_state"]  # the launcher saw a failure
    elif finish:
        state = finish["end_state"]  # the rank's own view (an exception it raised)
    elif end:
        state = end["end_state"]
    else:
        state = "running" if rd.rank in missing else "never_reported"
    return {
        "state": state,
        "exit_code": end.get("exit_code"),
        "signal": end.get("signal"),
        "reason": end.get("reason") or finish.get("reason"),
    }


def rank_summary(rd: RankData, missing: set[int]) -> dict:
    """Per-rank figures: identity, end state, step count, step-time and phase statistics."""
    steps = rd.steps
    ident = rd.identity or {}
    finish = rd.finish or {}
    step_ms = describe(_ms(s["step_us"]) for s in steps)
    phases = {name: _ms(median(s[field] for s in steps)) for name, field in PHASES}
    phases["dataloader_next"] = _ms(median(s["dataloader_next_us"] for s in steps))
    phases["residual"] = _ms(median(residual_us(s) for s in steps))
    return {
        "rank": rd.rank,
        "restart": rd.restart,
        "node_rank": ident.get("node_rank", (rd.end or {}).get("node_rank")),
        "local_rank": ident.get("local_rank", (rd.end or {}).get("local_rank")),
        "hostname": ident.get("hostname"),
        "end": end_state(rd, missing),
        "steps_completed": finish.get("steps_completed", len(steps)) if finish else len(steps),
        "records_received": len(steps),
        "records_dropped": finish.get("records_dropped") if finish else None,
        "step_time_ms": step_ms,
        "phase_median_ms": phases,
        "earlier_attempts": {str(k): v for k, v in sorted(rd.earlier_attempts.items())},
    }


def build_summary(run: RunData) -> dict:
    """The whole summary document for ``run``."""
    missing = set(run.missing)
    ranks = [rank_summary(rd, missing) for rd in run.ranks.values()]
    nodes = sorted({r["node_rank"] for r in ranks if r["node_rank"] is not None})
    return {
        "schema_version": SCHEMA_VERSION,
        "generated_unix_s": round(time.time(), 3),
        "run": {
            "run_name": run.run_name,
            "world_size": run.world_size,
            "nodes": nodes,
            "complete": not missing,
            "missing_ranks": sorted(missing),
        },
        "node_exits": [
            {"node_rank": n, "exit_code": e["exit_code"], "hostname": e["hostname"]}
            for n, e in sorted(run.node_exits.items())
        ],
        "ranks": ranks,
    }
