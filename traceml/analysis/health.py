"""Run health: how each rank ended, ranks and nodes that failed or never reported, lost data.

A rank's end state comes from two witnesses: the node launcher (torchrun's view: exit code,
signal, terminated because another rank failed) and the rank's own finish marker (which sees
an exception it raised but not a ``sys.exit(7)`` or a crash). A failure seen by the launcher
wins.
"""

from __future__ import annotations

import time

from traceml.analysis.findings import Finding, ranks_text
from traceml.analysis.rundata import RankData, RunData
from traceml.core.ends import is_interrupted

#: End states, as in ``ranks[].end.state``.
COMPLETED = "completed"
FAILED = "failed"
SIGNALED = "signaled"
TERMINATED = "terminated"
RUNNING = "running"  # no end known yet (live summary) or given up on at finalization
NEVER_REPORTED = "never_reported"


def end_state(rd: RankData, missing: set[int], *, live: bool = False) -> dict:
    """How ``rd`` ended: ``{"state", "exit_code", "signal", "reason"}``.

    Args:
        rd: the rank.
        missing: ranks finalization gave up waiting for.
        live: the run is still going (a rank without an end is running, not silent).
    """
    end = rd.end or {}
    finish = rd.finish or {}
    # torchrun stopped as a whole (SIGTERM to the launcher) leaves no record of its ranks: the
    # launcher can only say "terminated" (interrupted, when it got the signal), which must not
    # hide a rank's own completed finish: that rank had ended before the stop.
    if (
        end.get("end_state") == TERMINATED
        and end.get("exit_code") is None
        and (end.get("signal") is None or is_interrupted(end.get("reason")))
        and finish.get("end_state") == COMPLETED
    ):
        return {"state": COMPLETED, "exit_code": None, "signal": None, "reason": finish.get("reason")}
    if end.get("end_state") not in (None, COMPLETED):
        state = end["end_state"]  # the launcher saw a failure
    elif finish:
        state = finish["end_state"]  # the rank's own view (an exception it raised)
    elif end:
        state = end["end_state"]
    else:
        state = RUNNING if live or rd.rank in missing else NEVER_REPORTED
    return {
        "state": state,
        "exit_code": end.get("exit_code"),
        "signal": end.get("signal"),
        "reason": end.get("reason") or finish.get("reason"),
    }


def last_seen_us(rd: RankData) -> float:
    """When ``rd`` was last seen alive, Unix µs: its finish marker's arrival, else its last
    process sample (the node sampler's, about one a second while the process lives), else the
    end of its last stored step; +inf when nothing is known. A rank that failed because another
    one had (a collective's peer vanished) was seen alive after that one, so the crashed ranks
    sorted by it name the first failure first."""
    if rd.finish and rd.finish.get("received_unix_us"):
        return rd.finish["received_unix_us"]
    if rd.process_samples:
        return rd.process_samples[-1]["unix_us"]
    start = (rd.identity or {}).get("start_unix_us")
    if rd.steps and start is not None:
        return start + rd.steps[-1]["end_us"]
    return float("inf")


def run_status(ranks: list[dict], missing: list[int], *, live: bool) -> str:
    """``run.status``: ``running`` (live), ``failed`` (a rank failed or died of a signal),
    ``interrupted`` (ranks stopped by their launcher's SIGTERM/SIGINT, none failed),
    ``incomplete`` (ranks missing, never reported, or stopped without a known cause), else
    ``completed``."""
    if live:
        return RUNNING
    states = [r["end"]["state"] for r in ranks]
    if FAILED in states or SIGNALED in states:
        return FAILED
    if any(r["end"]["state"] == TERMINATED and is_interrupted(r["end"]["reason"]) for r in ranks):
        return "interrupted"
    if missing or any(state != COMPLETED for state in states):
        return "incomplete"
    return COMPLETED


def findings(run: RunData, ranks: list[dict], *, live: bool) -> list[Finding]:
    """Health findings over the summary's ``ranks`` (each with ``end``) and the run.

    Kinds: RANK_CRASHED, RANK_HUNG, RUN_INTERRUPTED, RANK_TERMINATED (ranks stopped after
    another failed; hung and interrupted ranks are left out), RANK_MISSING, RANK_NEVER_REPORTED,
    NODE_FAILED, RANK_WITHOUT_STEPS, TELEMETRY_DROPPED, GPU_TIMING_UNRESOLVED, RESTARTED,
    AGGREGATOR_RESTARTED.
    """
    out: list[Finding] = []
    by_state: dict[str, list[dict]] = {}
    for r in ranks:
        by_state.setdefault(r["end"]["state"], []).append(r)

    crashed = sorted(
        by_state.get(FAILED, []) + by_state.get(SIGNALED, []),
        key=lambda r: (last_seen_us(run.ranks[r["rank"]]), r["rank"]),
    )
    if crashed:
        first = crashed[0]["end"]
        how = (
            f"signal {first['signal']}"
            if first["signal"] is not None
            else f"exit code {first['exit_code']}"
            if first["exit_code"] is not None
            else "an exception"
        )
        reason = f" ({first['reason']})" if first["reason"] else ""
        out.append(
            Finding(
                "RANK_CRASHED",
                "critical",
                f"{ranks_text([r['rank'] for r in crashed]).capitalize()} failed; rank "
                f"{crashed[0]['rank']} ended with {how}{reason}.",
                "Read the failed rank's traceback in nodes/node_<r>/training.stderr.log; a "
                "signal 9 (SIGKILL) is often the host's out-of-memory killer.",
                evidence={"ranks": [{"rank": r["rank"], **r["end"]} for r in crashed]},
                ranks=[r["rank"] for r in crashed],
                nodes=sorted({r["node_rank"] for r in crashed if r["node_rank"] is not None}),
            )
        )
    hung = run.stall["ranks"] if run.stall else []
    if hung:
        out.append(_hang_finding(run.stall))
    hung_ranks = {e["rank"] for e in hung}
    interrupted = [
        r
        for r in by_state.get(TERMINATED, [])
        if r["rank"] not in hung_ranks and is_interrupted(r["end"]["reason"])
    ]
    if interrupted:
        signals = sorted({r["end"]["signal"] for r in interrupted if r["end"]["signal"]})
        out.append(
            Finding(
                "RUN_INTERRUPTED",
                "warning",
                f"The run was interrupted: {ranks_text([r['rank'] for r in interrupted])} "
                f"stopped when the launcher got signal {', '.join(map(str, signals)) or '?'} "
                "(scancel, preemption or Ctrl-C); the figures cover the steps before it.",
                "Nothing failed; resubmit or resume from the last checkpoint.",
                evidence={
                    "ranks": [
                        {"rank": r["rank"], "signal": r["end"]["signal"],
                         "steps_completed": r["steps_completed"]}
                        for r in interrupted
                    ]
                },
                ranks=[r["rank"] for r in interrupted],
            )
        )
    terminated = [
        r
        for r in by_state.get(TERMINATED, [])
        if r["rank"] not in hung_ranks and r not in interrupted
    ]
    if terminated:
        out.append(
            Finding(
                "RANK_TERMINATED",
                "warning",
                f"{ranks_text([r['rank'] for r in terminated]).capitalize()} "
                f"{'was' if len(terminated) == 1 else 'were'} stopped by torchrun after another "
                "rank failed or the launcher was interrupted.",
                "These ranks are collateral; fix the rank that failed first.",
                evidence={"ranks": [r["rank"] for r in terminated]},
                ranks=[r["rank"] for r in terminated],
            )
        )
    missing = sorted(run.missing)
    if missing and not live:
        out.append(
            Finding(
                "RANK_MISSING",
                "critical",
                f"Partial summary: {ranks_text(missing)} never finished within the "
                "finalization budget; their data may be incomplete.",
                "Look for a hung rank (a collective waiting forever) in its training log; "
                "raise --finalize-timeout-sec on slow shared filesystems.",
                evidence={"missing_ranks": missing},
                ranks=missing,
            )
        )
    silent = [r["rank"] for r in by_state.get(NEVER_REPORTED, [])]
    if silent:
        out.append(
            Finding(
                "RANK_NEVER_REPORTED",
                "warning",
                f"{ranks_text(silent).capitalize()} never reported: no identity, no finish "
                "marker, no end state from a launcher.",
                "Check that every node ran `traceml run` with the same --run-name and could "
                "reach the aggregator (see its launcher's stderr).",
                evidence={"ranks": silent},
                ranks=silent,
            )
        )
    failed_nodes = {n: e for n, e in run.node_exits.items() if e["exit_code"] != 0}
    if failed_nodes:
        out.append(
            Finding(
                "NODE_FAILED",
                "critical",
                "torchrun on node "
                + ", ".join(
                    f"{n} ({e.get('hostname') or '?'}) exited with {e['exit_code']}"
                    for n, e in sorted(failed_nodes.items())
                )
                + ".",
                "See the rank findings above and the node's training.stderr.log.",
                evidence={"exit_codes": {str(n): e["exit_code"] for n, e in failed_nodes.items()}},
                nodes=sorted(failed_nodes),
            )
        )
    return out + _data_findings(run, ranks)


def _hang_finding(stall: dict) -> Finding:
    """RANK_HUNG from the aggregator's stall record (:mod:`traceml.analysis.hang`)."""
    entries = stall["ranks"]
    stalled = [e["rank"] for e in entries]
    since = min(e["last_progress_unix_s"] for e in entries)
    when = time.strftime("%H:%M:%S UTC", time.gmtime(since))
    where = "; ".join(
        f"rank {e['rank']} after {e['steps_completed']} steps, in {e['phase']}, silent "
        f"{e['silent_s']:.0f} s{'' if e['alive'] else ', no sign of life'}"
        for e in entries
    )
    suspect = stall["suspects"]
    if suspect:
        look = (
            f"Look at {ranks_text(suspect)} first: the others wait for it. Its stack "
            "(py-spy dump --pid, or faulthandler) shows where it is stuck."
        )
    else:
        look = (
            "Every stalled rank stopped at the same place: a collective that cannot complete "
            "(the network, or ranks calling different collectives); see each rank's stack."
        )
    return Finding(
        "RANK_HUNG",
        "critical",
        f"{ranks_text(stalled).capitalize()} stopped making progress at {when} ({where}).",
        look,
        evidence={
            "ranks": entries,
            "suspects": suspect,
            "hang_timeout_s": stall["hang_timeout_s"],
            "detected_unix_s": stall["detected_unix_s"],
        },
        ranks=suspect or stalled,
    )


def _data_findings(run: RunData, ranks: list[dict]) -> list[Finding]:
    """RANK_WITHOUT_STEPS, TELEMETRY_DROPPED, GPU_TIMING_UNRESOLVED, RESTARTED,
    AGGREGATOR_RESTARTED."""
    out: list[Finding] = []
    if run.aggregator_restarts:
        gaps = [r["gap_s"] for r in run.aggregator_restarts]
        out.append(
            Finding(
                "AGGREGATOR_RESTARTED",
                "info",
                f"The aggregator died and was restarted {len(gaps)} time(s) on the run's store "
                f"({run.aggregator_restarts[-1]['reason']}; {sum(gaps):.1f} s without one); "
                "the ranks resent what it had not stored.",
                "Nothing to do if no telemetry was lost; see aggregator/process.stderr.log.",
                evidence={"restarts": run.aggregator_restarts},
            )
        )
    stepped = [r for r in ranks if r["records_received"]]
    stepless = [r["rank"] for r in ranks if not r["records_received"]]
    if stepped and stepless:
        out.append(
            Finding(
                "RANK_WITHOUT_STEPS",
                "warning",
                f"{ranks_text(stepless).capitalize()} stored no step while other ranks did; "
                "the step-time analysis leaves them out.",
                "Make sure every rank calls traceml.init() and traceml.trace_step().",
                evidence={"ranks": stepless},
                ranks=stepless,
            )
        )
    dropped = {
        r["rank"]: r
        for r in ranks
        if (r["records_dropped"] or 0) > 0
        or (r["steps_completed"] or 0) > (r["records_received"] or 0)
    }
    if dropped:
        out.append(
            Finding(
                "TELEMETRY_DROPPED",
                "warning",
                f"{ranks_text(list(dropped)).capitalize()} lost telemetry: "
                + ", ".join(
                    f"rank {r}: {d['steps_completed'] - d['records_received']} of "
                    f"{d['steps_completed']} steps not stored, {d['records_dropped'] or 0} "
                    "records dropped"
                    for r, d in sorted(dropped.items())
                )
                + "; the figures cover what was stored.",
                "Raise TRACEML_BUFFER_MAX_RECORDS, or check the network path to the aggregator.",
                evidence={
                    str(r): {
                        "steps_completed": d["steps_completed"],
                        "records_received": d["records_received"],
                        "records_dropped": d["records_dropped"],
                    }
                    for r, d in sorted(dropped.items())
                },
                ranks=list(dropped),
            )
        )
    unresolved = {r["rank"]: r["steps_gpu_unresolved"] for r in ranks if r["steps_gpu_unresolved"]}
    if unresolved:
        out.append(
            Finding(
                "GPU_TIMING_UNRESOLVED",
                "info",
                f"{ranks_text(list(unresolved)).capitalize()} had steps whose CUDA event "
                "timings never completed; those steps carry CPU timings only.",
                "Usually the last steps before an abrupt exit; nothing to do unless it is many.",
                evidence={"steps_per_rank": {str(r): n for r, n in unresolved.items()}},
                ranks=list(unresolved),
            )
        )
    restarted = {r: rd.earlier_attempts for r, rd in run.ranks.items() if rd.earlier_attempts}
    if restarted:
        attempts = len({k for a in restarted.values() for k in a})
        out.append(
            Finding(
                "RESTARTED",
                "warning",
                f"torchrun restarted the workers: {attempts} earlier attempt(s) stored steps; "
                "the analysis covers the latest attempt only.",
                "Find why the earlier attempt failed in the training logs.",
                evidence={
                    "earlier_attempt_steps": {
                        str(r): {str(k): v for k, v in sorted(a.items())}
                        for r, a in sorted(restarted.items())
                    }
                },
                ranks=sorted(restarted),
            )
        )
    return out
