"""Run health: how each rank ended, ranks and nodes that failed or never reported, lost data.

A rank's end state comes from two witnesses: the node launcher (torchrun's view: exit code,
signal, terminated because another rank failed) and the rank's own finish marker (which sees
an exception it raised but not a ``sys.exit(7)`` or a crash). A failure seen by the launcher
wins.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, TypedDict

from traceml.analysis.document import (
    INCOMPLETE,
    INTERRUPTED,
    NEVER_REPORTED,
    RUNNING,
    RankSummary,
)
from traceml.analysis.findings import EVENTS, Finding, numbered_text, ranks_text
from traceml.analysis.hang import (
    CollectiveHang,
    collective_hang,
    collective_text,
    silent_s,
    sits_at,
)
from traceml.analysis.rundata import RankData, RunData
from traceml.analysis.schema import plain
from traceml.core.ends import (
    CANNOT_RENDEZVOUS_PREFIX,
    COMPLETED,
    FAILED,
    NOT_STARTED,
    SIGNALED,
    TERMINATED,
    interrupting_node,
    is_interrupted,
    launcher_text,
)


class EndState(TypedDict):
    """How a rank ended (:func:`end_state`): the fields of
    :class:`~traceml.analysis.document.RankEnd`."""

    state: str
    exit_code: int | None
    signal: int | None
    reason: str | None


class NotExited(TypedDict):
    """A rank that completed its steps and did not exit (:func:`not_exited`)."""

    rank: int
    attempt: int
    steps_completed: int
    #: From the end of its last step (or its peers' exit) to its end, s.
    did_not_exit_s: float
    #: The ranks that exited.
    exited_ranks: list[int]
    #: The last of their finish markers' arrival, Unix s; None when not stored.
    exited_unix_s: float | None


def end_state(rd: RankData, missing: set[int], *, live: bool = False) -> EndState:
    """How ``rd`` ended: ``{"state", "exit_code", "signal", "reason"}`` (the fields of
    :class:`~traceml.analysis.document.RankEnd`).

    Args:
        rd: the rank.
        missing: ranks finalization gave up waiting for (``running`` when anything of
            theirs came, else ``never_reported``).
        live: the run is still going (a rank without an end is running, not silent).
    """
    end, finish = rd.end, rd.finish
    # torchrun stopped as a whole (SIGTERM to the launcher) leaves no record of its ranks: the
    # launcher can only say "terminated" (interrupted, when it got the signal), which must not
    # hide a rank's own completed finish: that rank had ended before the stop.
    if (
        end
        and end.end_state == TERMINATED
        and end.exit_code is None
        and (end.signal is None or is_interrupted(end.reason))
        and finish
        and finish.end_state == COMPLETED
    ):
        return {
            "state": COMPLETED,
            "exit_code": None,
            "signal": None,
            "reason": finish.reason,
        }
    if end and end.end_state != COMPLETED:
        state = end.end_state  # the launcher saw a failure
    elif finish:
        state = finish.end_state  # the rank's own view (an exception it raised)
    elif end:
        state = end.end_state
    else:  # running, given up on, or a rank nobody ever heard of (its node never connected)
        heard = rd.identity or rd.counts or rd.process_samples or rd.steps_stored
        state = RUNNING if live or rd.rank in missing and heard else NEVER_REPORTED
    return {
        "state": state,
        "exit_code": end.exit_code if end else None,
        "signal": end.signal if end else None,
        "reason": (end.reason if end else None) or (finish.reason if finish else None),
    }


def last_seen_us(rd: RankData) -> float:
    """When ``rd`` was last seen alive, Unix µs: its finish marker's arrival, else its last
    process sample (the node sampler's, about one a second while the process lives), else the
    end of its last stored step; +inf when nothing is known. A rank that failed because another
    one had (a collective's peer vanished) was seen alive after that one, so the crashed ranks
    sorted by it name the first failure first."""
    seen: float
    if rd.finish and rd.finish.received_unix_us:
        seen = rd.finish.received_unix_us
    elif rd.process_samples:
        seen = rd.process_samples[-1]["unix_us"]
    elif rd.steps and rd.identity and (start := rd.identity.start_unix_us) is not None:
        seen = start + rd.steps["end_us"][-1]
    else:
        seen = float("inf")
    return seen


def run_status(ranks: list[RankSummary], missing: list[int], *, live: bool) -> str:
    """``run.status``: ``running`` (live), ``failed`` (a rank failed, died of a signal, or
    never started: its torchrun failed first), ``interrupted`` (ranks stopped by their
    launcher's SIGTERM/SIGINT, or never started when it came, none failed), ``incomplete``
    (ranks missing, never reported, or stopped without a known cause), else ``completed``."""
    if live:
        return RUNNING
    states = [r.end.state for r in ranks]
    stopped = [r for r in ranks if r.end.state in (TERMINATED, NOT_STARTED)]
    if FAILED in states or SIGNALED in states:
        return FAILED
    if any(r.end.state == NOT_STARTED and not is_interrupted(r.end.reason) for r in stopped):
        return FAILED  # torchrun failed before it started them
    if any(is_interrupted(r.end.reason) for r in stopped):
        return INTERRUPTED
    if missing or any(state != COMPLETED for state in states):
        return INCOMPLETE
    return COMPLETED


@dataclass(frozen=True)
class Facts:
    """What the health rules look at: the run, the summary's ``ranks`` (each with its
    ``end``), whether the run is still going, when the summary is built (Unix s), and the
    ranks by end state."""

    run: RunData
    ranks: list[RankSummary]
    live: bool
    now_unix_s: float

    def in_state(self, *states: str) -> list[RankSummary]:
        """The ranks that ended in one of ``states``, in ``ranks`` order within a state."""
        return [r for state in states for r in self.ranks if r.end.state == state]

    def hung(self) -> set[int]:
        """The ranks of the aggregator's stall record (:mod:`traceml.analysis.hang`), and the
        ranks that completed their steps but did not exit (:func:`not_exited`)."""
        stalled = {e.rank for e in self.run.stall.ranks} if self.run.stall else set()
        return stalled | {e["rank"] for e in not_exited(self)}

    def interrupted(self) -> list[RankSummary]:
        """Terminated ranks, not hung, that their launcher's SIGTERM/SIGINT stopped, and ranks
        it stopped before torchrun started them."""
        hung = self.hung()
        return [
            r
            for r in self.in_state(TERMINATED, NOT_STARTED)
            if r.rank not in hung and is_interrupted(r.end.reason)
        ]

    def never_started(self) -> list[RankSummary]:
        """Ranks torchrun never started because it failed or exited first (not those its
        launcher's signal stopped before: :meth:`interrupted`)."""
        return [r for r in self.in_state(NOT_STARTED) if not is_interrupted(r.end.reason)]


def findings(
    run: RunData, ranks: list[RankSummary], *, live: bool, now_unix_s: float
) -> list[Finding]:
    """Health findings over the summary's ``ranks`` (each with ``end``) and the run, one per
    rule of :data:`RULES` that applies; ``now_unix_s``: when the summary is built (Unix s).

    Kinds: RANK_CRASHED, RANK_HUNG, RUN_INTERRUPTED, RANK_TERMINATED (ranks stopped after
    another failed; hung and interrupted ranks are left out), RANK_MISSING, RANK_NEVER_REPORTED,
    NODE_FAILED, NODE_LOST, AGGREGATOR_RESTARTED, AGGREGATOR_LOST, RANK_WITHOUT_STEPS,
    TELEMETRY_DROPPED, GPU_TIMING_UNRESOLVED, RESTARTED, TELEMETRY_REFUSED,
    SCRIPT_PROCESS_GROUP.
    """
    facts = Facts(run, ranks, live, now_unix_s)
    found = [f for f in (rule(facts) for rule in RULES) if f is not None]
    for f in found:  # every health finding reports events: statistic first, as elsewhere
        f.evidence = {"statistic": EVENTS, **f.evidence}
    return found


def _utc(unix_s: float) -> str:
    return time.strftime("%H:%M:%S UTC", time.gmtime(unix_s))


def lost_note(facts: Facts, ranks: Iterable[int]) -> str:
    """`` Node N (host) was lost at T ...`` for the nodes of ``ranks`` the aggregator lost and
    never got back (:attr:`RunData.node_losses`); "" when none was."""
    node_of = {r.rank: r.node_rank for r in facts.ranks}
    nodes = {node_of.get(r) for r in ranks}
    lost = [
        loss
        for loss in facts.run.node_losses
        if loss.resumed_unix_s is None and loss.node_rank in nodes
    ]
    return "".join(
        f" Node {loss.node_rank} was lost at {_utc(loss.lost_unix_s)}: nothing came from its "
        f"launcher for {loss.lost_after_s:g} s, and it never came back."
        for loss in lost
    )


def first_failure(crashed: list[RankSummary], seen_us: dict[int, float]) -> tuple[int | None, str]:
    """Which of the ``crashed`` ranks (sorted by ``seen_us``, then rank) failed first, by
    ``seen_us`` (rank -> :func:`last_seen_us`, Unix µs; +inf: unknown).

    Returns:
        ``(rank, "")`` when one rank failed, or one was last seen alive strictly before every
        other and every time is known; else ``(None, why)``, ``why`` saying what keeps the
        first unknown (ranks last seen alive at the same time, or ranks without a time: they
        may have died first).
    """
    if len(crashed) == 1:
        return crashed[0].rank, ""
    unknown = [r.rank for r in crashed if seen_us[r.rank] == float("inf")]
    if unknown:
        were = "was" if len(unknown) == 1 else "were"
        return None, f"nothing tells when {ranks_text(unknown)} {were} last alive"
    earliest = seen_us[crashed[0].rank]
    tied = [r.rank for r in crashed if seen_us[r.rank] == earliest]
    if len(tied) > 1:
        return None, f"{ranks_text(tied)} were last seen alive at the same time"
    return crashed[0].rank, ""


def rank_crashed(facts: Facts) -> Finding | None:
    """RANK_CRASHED: ranks that failed or were killed by a signal, the first to fail in time
    first (:func:`last_seen_us`). When one failed first (:func:`first_failure`), the headline
    names it as the cause, with how it ended, and the others as what followed (most likely
    its knock-on: a collective's peer vanished); else it names no cause
    (``evidence.first``: that rank, else None)."""
    failed = facts.in_state(FAILED, SIGNALED)
    seen_us = {r.rank: last_seen_us(facts.run.ranks[r.rank]) for r in failed}
    crashed = sorted(failed, key=lambda r: (seen_us[r.rank], r.rank))
    if not crashed:
        return None
    first, why = first_failure(crashed, seen_us)
    killed = any(r.end.signal == signal.SIGKILL for r in crashed)
    oom = "; a signal 9 (SIGKILL) is often the host's out-of-memory killer." if killed else "."
    if first is None:
        summary = (
            f"{ranks_text([r.rank for r in crashed]).capitalize()} failed; which failed first is "
            f"not known ({why})."
        )
        advice = f"Read each failed rank's traceback in nodes/node_<r>/training.stderr.log{oom}"
    else:
        end, node = crashed[0].end, crashed[0].node_rank
        how = (
            f"signal {end.signal}"
            if end.signal is not None
            else f"exit code {end.exit_code}"
            if end.exit_code is not None
            else "an exception"
        )
        reason = f" ({end.reason})" if end.reason else ""
        where = f"nodes/node_{'<r>' if node is None else node}/training.stderr.log"
        if len(crashed) == 1:
            summary = f"Rank {first} failed; it ended with {how}{reason}."
            advice = f"Read rank {first}'s traceback in {where}{oom}"
        else:
            after = ranks_text([r.rank for r in crashed[1:]])
            summary = (
                f"Rank {first} failed first; it ended with {how}{reason}. "
                f"{after.capitalize()} failed after it, most likely of its end (a "
                "collective's peer vanished)."
            )
            advice = (
                f"Read rank {first}'s traceback in {where} first: the others' errors most "
                f"likely follow from it{oom}"
            )
    return Finding(
        "RANK_CRASHED",
        "critical",
        summary,
        advice,
        evidence={
            "first": first,
            "ranks": [{"rank": r.rank, **plain(r.end)} for r in crashed],
        },
        ranks=[r.rank for r in crashed],
        nodes=sorted({r.node_rank for r in crashed if r.node_rank is not None}),
    )


def _unix_s(us: float | None) -> float | None:
    return None if us is None else us / 1e6


def not_exited(facts: Facts) -> list[NotExited]:
    """Ranks that completed as many steps as the ranks that exited normally (finish marker
    ``completed``, same attempt), then did not exit themselves: no completed finish of their
    own, and found stalled by the hang watch, given up on by finalization (missing), or
    stopped since by their launcher's SIGTERM/SIGINT (the user's stop). None while a rank
    crashed (its peers are torn down, not lingering), nor a rank of a live run still on its
    way out.

    Returns:
        one per such rank, by rank; ``did_not_exit_s`` runs from the end of its last step, or
        its peers' exit when that is unknown, to its end: the stall record's end, its node's
        torchrun exit, else now.
    """
    completed = [
        (rd.rank, rd.restart, rd.finish)
        for rd in facts.run.ranks.values()
        if rd.finish and rd.finish.end_state == COMPLETED
    ]
    if not completed or facts.in_state(FAILED, SIGNALED):
        return []
    attempt = max(a for _, a, _ in completed)
    ended = [(r, f) for r, a, f in completed if a == attempt]
    steps = max(f.steps_completed for _, f in ended)
    arrived = [f.received_unix_us for _, f in ended if f.received_unix_us]
    exited_unix_s = _unix_s(max(arrived)) if arrived else None
    stall = facts.run.stall
    stalled = {e.rank: e for e in stall.ranks} if stall else {}
    now = facts.now_unix_s
    found: list[NotExited] = []
    for r in facts.ranks:
        rd = facts.run.ranks[r.rank]
        entry = stalled.get(r.rank)
        if (
            r.end.state not in (RUNNING, TERMINATED)
            or r.end.state == RUNNING
            and entry is None
            and r.rank not in facts.run.missing
            or r.end.state == TERMINATED
            and not is_interrupted(r.end.reason)
            or (rd.finish is not None and rd.finish.end_state == COMPLETED)
            or rd.restart != attempt
            or r.steps_completed != steps
        ):
            continue
        start_us = rd.identity.start_unix_us if rd.identity else None
        since = (
            entry.last_progress_unix_s
            if entry
            else (start_us + rd.steps["end_us"][-1]) / 1e6
            if start_us is not None and len(rd.steps) and rd.steps["end_us"][-1] is not None
            else exited_unix_s or now
        )
        node_exit = facts.run.node_exits.get(r.node_rank) if r.node_rank is not None else None
        until = (
            (stall.ended_unix_s if stall and entry else None)
            or (
                _unix_s(node_exit.received_unix_us if node_exit else None)
                if r.end.state == TERMINATED
                else None
            )
            or now
        )
        found.append(
            {
                "rank": r.rank,
                "attempt": attempt,
                "steps_completed": steps,
                "did_not_exit_s": round(max(0.0, until - since), 1),
                "exited_ranks": sorted(q for q, _ in ended),
                "exited_unix_s": None if exited_unix_s is None else round(exited_unix_s, 3),
            }
        )
    return found


def _not_exited_text(e: NotExited) -> str:
    exited = e["exited_ranks"]
    who = ranks_text(exited) + (" exited" if len(exited) == 1 else " had exited")
    if e["exited_unix_s"] is not None:
        who += (" at " if len(exited) == 1 else " by ") + _utc(e["exited_unix_s"])
    return (
        f"rank {e['rank']} completed its {e['steps_completed']} steps, then did not exit "
        f"for {e['did_not_exit_s']:.0f} s ({who})"
    )


def _stalled_text(e: dict[str, Any]) -> str:
    attempt = f" of attempt {e['attempt']}" if e.get("attempt") else ""
    life = "alive (samples still arriving)" if e["alive"] else "dead (no sign of life)"
    return (
        f"rank {e['rank']}{attempt}: {e['steps_completed']} steps done (last step "
        f"{e['last_step']}), in {e['phase']}, {life}, silent {e['silent_s']:.0f} s"
    )


def _collective_evidence(hang: CollectiveHang, until_unix_s: float) -> dict[str, Any]:
    """RANK_HUNG's ``evidence.collective``: the collective the stalled ranks wait in, for how
    long (s, up to ``until_unix_s``), and each rank that never entered it, alive or not, where
    its main thread sat and its stack (lines, outermost first; None: not reported)."""
    return {
        "op": hang.op,
        "group": hang.group,
        "seq": hang.seq,
        "waiting": list(hang.waiting),
        "waited_s": hang.waited_s(until_unix_s),
        "never_entered": [
            {
                "rank": e.rank,
                "alive": e.alive,
                "inside": e.collective.to_json() if e.collective else None,
                "at": sits_at(e),
                "stack": e.stack.split("\n") if e.stack else None,
            }
            for e in hang.absent
        ],
    }


def rank_hung(facts: Facts) -> Finding | None:
    """RANK_HUNG: ranks that stopped making progress, from the aggregator's stall record
    (:mod:`traceml.analysis.hang`), naming the suspects the others wait for (each stalled
    rank's state is the one it was found stalled in), the collective the stalled ranks wait in
    and the ranks that never entered it with where they sit (when the ranks reported them:
    ``evidence.collective``, else None), and ranks that completed their steps but did not exit
    (:func:`not_exited`; named even before a stall record has them)."""
    stall = facts.run.stall
    ended = stall.ended_unix_s if stall else None
    entries = [
        {**e.to_json(), "silent_s": silent_s(ended, e, facts.now_unix_s)}
        for e in (stall.ranks if stall else ())
    ]
    lingering = not_exited(facts)
    if not entries and not lingering:
        return None
    lingered = {e["rank"] for e in lingering}
    told = [_not_exited_text(e) for e in lingering] + [
        _stalled_text(e) for e in entries if e["rank"] not in lingered
    ]
    text = "; ".join(told)
    if entries:
        stalled = [e["rank"] for e in entries]
        when = _utc(min(e["last_progress_unix_s"] for e in entries))
        text = f"{ranks_text(stalled).capitalize()} stopped making progress at {when}: {text}."
    else:
        stalled = sorted(lingered)
        text = text[0].upper() + text[1:] + "."
    suspect = sorted(set(stall.suspects if stall else ()) | lingered)
    hang = collective_hang(stall.ranks) if stall else None
    in_collective = None
    if hang is not None and stall is not None:
        until = stall.ended_unix_s or facts.now_unix_s
        in_collective = _collective_evidence(hang, until)
        waits = collective_text(hang, until)
        text += f" {waits[0].upper()}{waits[1:]}."
    if hang is not None and suspect and set(suspect) <= {e.rank for e in hang.absent}:
        where = "; ".join(
            f"rank {e.rank}'s main thread sits at {sits_at(e)}" for e in hang.absent if e.stack
        )
        look = (
            f"Look at {ranks_text(suspect)} first: the others wait for it in {hang.name}, "
            f"which it never entered{f' ({where})' if where else ''}. Its full stack is in "
            "evidence.collective.never_entered."
        )
    elif suspect:
        look = (
            f"Look at {ranks_text(suspect)} first: the others wait for it, or it does not "
            "exit. Its stack (py-spy dump --pid, or faulthandler) shows where it is stuck."
        )
    else:
        look = (
            "Every stalled rank stopped at the same place and none differs, so none is named: "
            "a collective that cannot complete (the network, or ranks calling different "
            "collectives); see each rank's stack."
        )
    return Finding(
        "RANK_HUNG",
        "critical",
        text + lost_note(facts, stalled),
        look,
        evidence={
            "ranks": entries,
            "suspects": suspect,
            "not_exited": lingering,
            "hang_timeout_s": stall.hang_timeout_s if stall else None,
            "detected_unix_s": stall.detected_unix_s if stall else None,
            "collective": in_collective,
        },
        ranks=suspect,
    )


def hang_first(
    primary: Finding, others: list[Finding], health: list[Finding], steps: int
) -> tuple[Finding, list[Finding], list[Finding]]:
    """Make RANK_HUNG the primary diagnosis when the hang lost more wall time than the
    step-time verdict costs over the run (its ``impact_ms`` x ``steps``): the verdict then
    becomes the first of the step-time findings and RANK_HUNG leaves the health findings.

    Args:
        primary: the step-time verdict; others: the other step-time findings.
        health: the health findings; steps: the most steps a rank completed.

    Returns:
        ``(primary, step-time findings, health findings)``, unchanged when no hang cost more.
    """
    hung = next((f for f in health if f.kind == "RANK_HUNG"), None)
    if hung is None:
        return primary, others, health
    lost_s = max(
        [e["silent_s"] for e in hung.evidence["ranks"]]
        + [e["did_not_exit_s"] for e in hung.evidence["not_exited"]]
    )
    verdict_s = (primary.impact_ms or 0.0) * steps / 1000.0
    if lost_s < verdict_s:
        return primary, others, health
    hung.evidence["lost_s"] = lost_s
    hung.evidence["verdict_before"] = {"kind": primary.kind, "lost_s": round(verdict_s, 1)}
    hung.summary += (
        f" The hang lost {lost_s:.0f} s of wall time, more than {primary.kind} cost over "
        f"{steps} steps ({verdict_s:.0f} s)."
    )
    return hung, [primary] + others, [f for f in health if f is not hung]


def launchers_text(nodes: list[int | None]) -> str:
    """Whose launchers got a stop signal, from :func:`~traceml.core.ends.interrupting_node`
    of each rank: ``node 1's launcher``, ``the launchers of nodes 0, 1`` (at most 8 named,
    then a count); ``the launcher`` when a rank's node is not known."""
    if None in nodes or not nodes:
        return launcher_text(None)
    known = sorted({n for n in nodes if n is not None})
    if len(known) == 1:
        return launcher_text(known[0])
    return f"the launchers of {numbered_text('node', known)}"


def run_interrupted(facts: Facts) -> Finding | None:
    """RUN_INTERRUPTED: ranks their launcher stopped on SIGTERM/SIGINT (scancel, preemption,
    Ctrl-C) while nothing had failed; hung ranks are left to RANK_HUNG."""
    interrupted = facts.interrupted()
    if not interrupted:
        return None
    launchers = launchers_text(
        [interrupting_node(r.end.reason or "", r.node_rank) for r in interrupted]
    )
    signals = sorted({r.end.signal for r in interrupted if r.end.signal})
    failed = facts.in_state(FAILED, SIGNALED)
    return Finding(
        "RUN_INTERRUPTED",
        "warning",
        f"The run was interrupted: {ranks_text([r.rank for r in interrupted])} "
        f"stopped when {launchers} got signal {', '.join(map(str, signals)) or '?'} "
        "(scancel, preemption or Ctrl-C); the figures cover the steps before it.",
        "Resume from the last checkpoint once the failure above is fixed."
        if failed
        else "Nothing failed; resubmit or resume from the last checkpoint.",
        evidence={
            "ranks": [
                {"rank": r.rank, "signal": r.end.signal, "steps_completed": r.steps_completed}
                for r in interrupted
            ]
        },
        ranks=[r.rank for r in interrupted],
        nodes=sorted({r.node_rank for r in interrupted if r.node_rank is not None}),
    )


def rank_terminated(facts: Facts) -> Finding | None:
    """RANK_TERMINATED: ranks torchrun stopped (collateral of another failure); hung and
    interrupted ranks have their own findings."""
    left_out = facts.hung() | {r.rank for r in facts.interrupted()}
    terminated = [r.rank for r in facts.in_state(TERMINATED) if r.rank not in left_out]
    if not terminated:
        return None
    return Finding(
        "RANK_TERMINATED",
        "warning",
        f"{ranks_text(terminated).capitalize()} "
        f"{'was' if len(terminated) == 1 else 'were'} stopped by torchrun after another "
        "rank failed or the launcher was interrupted.",
        "These ranks are collateral; fix the rank that failed first.",
        evidence={"ranks": terminated},
        ranks=terminated,
    )


def rank_missing(facts: Facts) -> Finding | None:
    """RANK_MISSING: ranks finalization gave up waiting for (never in a live summary), but
    those nobody ever heard of: RANK_NEVER_REPORTED names them."""
    silent = {r.rank for r in facts.in_state(NEVER_REPORTED)}
    missing = sorted(set(facts.run.missing) - silent)
    if not missing or facts.live:
        return None
    return Finding(
        "RANK_MISSING",
        "critical",
        f"Partial summary: {ranks_text(missing)} never finished within the "
        "finalization budget; their data may be incomplete." + lost_note(facts, missing),
        "Look for a hung rank (a collective waiting forever) in its training log; "
        "raise --finalize-timeout-sec on slow shared filesystems.",
        evidence={"missing_ranks": missing},
        ranks=missing,
    )


def rank_never_reported(facts: Facts) -> Finding | None:
    """RANK_NEVER_REPORTED: ranks of the world nobody heard of."""
    silent = [r.rank for r in facts.in_state(NEVER_REPORTED)]
    if not silent:
        return None
    return Finding(
        "RANK_NEVER_REPORTED",
        "warning",
        f"{ranks_text(silent).capitalize()} never reported: no identity, no finish "
        "marker, no end state from a launcher." + lost_note(facts, silent),
        "Check that every node ran `traceml run` with the same --run-name and could "
        "reach the aggregator (see its launcher's stderr).",
        evidence={"ranks": silent},
        ranks=silent,
    )


def node_failed(facts: Facts) -> Finding | None:
    """NODE_FAILED: nodes whose torchrun exited with a non-zero code, but those a signal to
    the run stopped (every rank of the node that did not complete was interrupted: scancel,
    Ctrl-C; RUN_INTERRUPTED says so); a node whose torchrun failed before it started its
    ranks (they are ``not_started``) is said with its error (the ranks' reason)."""
    interrupted = {r.rank for r in facts.interrupted()}
    unfinished: dict[int | None, list[int]] = {}  # node -> its ranks that did not complete
    for r in facts.ranks:
        if r.end.state != COMPLETED:
            unfinished.setdefault(r.node_rank, []).append(r.rank)
    failed = {
        n: e
        for n, e in facts.run.node_exits.items()
        if e.exit_code != 0 and not (unfinished.get(n) and interrupted.issuperset(unfinished[n]))
    }
    if not failed:
        return None
    not_started: dict[int, list[RankSummary]] = {}  # node -> its ranks torchrun never started
    for r in facts.never_started():
        if r.node_rank is not None:
            not_started.setdefault(r.node_rank, []).append(r)
    # nodes that ended alike, by how: (exit code, why no rank started) -> (nodes, those ranks)
    alike: dict[tuple[int, str | None], tuple[list[str], list[int]]] = {}
    for n, e in sorted(failed.items()):
        ranks = not_started.get(n, [])
        how = (e.exit_code, ranks[0].end.reason if ranks else None)
        nodes, never = alike.setdefault(how, ([], []))
        nodes.append(f"{n} ({e.hostname or '?'})")
        never += [r.rank for r in ranks]
    said = []
    for (code, reason), (nodes, never) in alike.items():
        text = f"{', '.join(nodes)} exited with {code}"
        if reason:
            text += f" before it started {ranks_text(never)} ({reason})"
        said.append(text)
    reasons = [r.end.reason or "" for ranks in not_started.values() for r in ranks]
    if not reasons:
        advice = "See the rank findings above and the node's training.stderr.log."
    elif all(reason.startswith(CANNOT_RENDEZVOUS_PREFIX) for reason in reasons):
        advice = (  # node 0 stopped every node: a claim it refused (the reason says why)
            "Start every node with the same --nnodes, --master-addr, --master-port and "
            "--run-name, each with its own --node-rank (the reason names the node at fault)."
        )
    else:
        advice = (
            "torchrun fails in its rendezvous when its --master-port is in use (pick a free "
            "one) or node 0 cannot be reached (check --master-addr and --nnodes on every "
            "node); its error is in its output (the node's training.stderr.log when saved)."
        )
    never = sorted(r.rank for n in failed for r in not_started.get(n, []))
    return Finding(
        "NODE_FAILED",
        "critical",
        f"torchrun on node{'s' if len(failed) > 1 else ''} " + "; ".join(said) + ".",
        advice,
        evidence={
            "exit_codes": {str(n): e.exit_code for n, e in failed.items()},
            "not_started": never,
        },
        ranks=never,
        nodes=sorted(failed),
    )


def why_too_few_steps_first(
    primary: Finding, others: list[Finding], health: list[Finding]
) -> tuple[Finding, list[Finding], list[Finding]]:
    """When the ranks reported too few steps for a diagnosis (the step-time verdict is
    INSUFFICIENT_DATA for want of steps: none, or fewer than ``MIN_WINDOW_STEPS`` common to
    every rank) and a health finding says why, make it the primary diagnosis, the first of:
    NODE_FAILED naming ranks torchrun never started (its error), RANK_CRASHED (ranks that
    died early: an import error, say), RUN_INTERRUPTED (stopped early). The run then lacks
    steps for that reason, not for want of instrumentation or of a longer run.

    Returns:
        ``(primary, step-time findings, health findings)``, unchanged otherwise.
    """
    if primary.evidence.get("missing") != ["steps"]:
        return primary, others, health
    why = [f for f in health if f.kind == "NODE_FAILED" and f.evidence["not_started"]]
    why += [f for kind in ("RANK_CRASHED", "RUN_INTERRUPTED") for f in health if f.kind == kind]
    if not why:
        return primary, others, health
    return why[0], [primary] + others, [f for f in health if f is not why[0]]


def node_lost(facts: Facts) -> Finding | None:
    """NODE_LOST: nodes whose launcher the aggregator heard nothing from within the bound
    (:attr:`RunData.node_losses`: its session stream broke, or it stalled), or whose session
    broke and who reported no exit before the summary: critical while one never came back,
    else a warning (it was heard again and its telemetry resent). The silence is said once
    when every loss came after the same (the bound), else for each."""
    losses = facts.run.node_losses
    if not losses:
        return None
    one_silence = len({loss.lost_after_s for loss in losses}) == 1
    told = []
    for loss in losses:
        host = f" ({loss.hostname})" if loss.hostname else ""
        text = f"node {loss.node_rank}{host} at {_utc(loss.lost_unix_s)}"
        if not one_silence:
            text += f" ({loss.lost_after_s:g} s silent)"
        resumed = loss.resumed_unix_s
        if resumed is not None:
            text += f", back {resumed - loss.lost_unix_s:.0f} s later"
        told.append(text)
    gone = sorted({loss.node_rank for loss in losses if loss.resumed_unix_s is None})
    if gone:
        advice = (
            f"Node {', '.join(map(str, gone))} never came back: its host died or was cut off "
            "from node 0, or its launcher was killed or stalled; its ranks' ends after that "
            "time are unknown. See that node's launcher stderr and the host's logs."
        )
    else:
        advice = (
            "Every lost node came back and resent its telemetry; if this recurs, look at the "
            "network between the nodes and node 0."
        )
    return Finding(
        "NODE_LOST",
        "critical" if gone else "warning",
        f"The aggregator lost {'; '.join(told)}"
        + (
            f": nothing came from the node's launcher for {losses[0].lost_after_s:g} s."
            if one_silence
            else ": nothing came from the node's launcher for that long."
        ),
        advice,
        evidence={"node_losses": [loss.to_json() for loss in losses]},
        nodes=sorted({loss.node_rank for loss in losses}),
    )


def aggregator_restarted(facts: Facts) -> Finding | None:
    """AGGREGATOR_RESTARTED: node 0's aggregator died and was restarted on the run's store
    (:attr:`RunData.aggregator_restarts`)."""
    restarts = facts.run.aggregator_restarts
    if not restarts:
        return None
    gaps = [r.gap_s for r in restarts]
    return Finding(
        "AGGREGATOR_RESTARTED",
        "info",
        f"The aggregator died and was restarted {len(gaps)} time(s) on the run's store "
        f"({restarts[-1].reason}; {sum(gaps):.1f} s without one); "
        "the ranks resent what it had not stored.",
        "Nothing to do if no telemetry was lost; see aggregator/process.stderr.log.",
        evidence={"restarts": [r.to_json() for r in restarts]},
    )


def aggregator_lost(facts: Facts) -> Finding | None:
    """AGGREGATOR_LOST: node 0's aggregator stopped storing for good: it died and was not
    restarted (no restart allowed, or none left; the summary was written from the store), or
    its store stopped committing (a full disk), so the summary covers only the steps stored
    until then (:attr:`RunData.aggregator_loss`)."""
    loss = facts.run.aggregator_loss
    if loss is None:
        return None
    stored = {r.rank: r.records_received for r in facts.ranks}
    told = ", ".join(f"rank {rank}: {n}" for rank, n in stored.items())
    return Finding(
        "AGGREGATOR_LOST",
        "warning",
        f"Node 0's aggregator stopped storing at {_utc(loss.lost_unix_s)} ({loss.reason}): "
        f"this summary covers only the steps stored until then ({told}); the telemetry sent "
        "after it was not stored.",
        "Read the verdict as one of the run's first part only. See aggregator/process.stderr.log "
        "for the cause: a full disk needs room in the run directory's; for an aggregator that "
        "died, --aggregator-max-restarts lets the launcher restart it on the run's store.",
        evidence={
            "aggregator_loss": loss.to_json(),
            "steps_stored": {str(rank): n for rank, n in stored.items()},
        },
    )


def rank_without_steps(facts: Facts) -> Finding | None:
    """RANK_WITHOUT_STEPS: ranks that stored no step while others did."""
    stepless = [r.rank for r in facts.ranks if not r.records_received]
    if not stepless or len(stepless) == len(facts.ranks):
        return None
    return Finding(
        "RANK_WITHOUT_STEPS",
        "warning",
        f"{ranks_text(stepless).capitalize()} stored no step while other ranks did; "
        "the step-time analysis leaves them out.",
        "Make sure every rank calls traceml.init() and traceml.trace_step().",
        evidence={"ranks": stepless},
        ranks=stepless,
    )


def telemetry_dropped(facts: Facts) -> Finding | None:
    """TELEMETRY_DROPPED: ranks that dropped records or completed more steps than stored."""
    dropped = {
        r.rank: r
        for r in facts.ranks
        if (r.records_dropped or 0) > 0 or (r.steps_completed or 0) > (r.records_received or 0)
    }
    if not dropped:
        return None
    return Finding(
        "TELEMETRY_DROPPED",
        "warning",
        f"{ranks_text(list(dropped)).capitalize()} lost telemetry: "
        + ", ".join(
            f"rank {r}: {d.steps_completed - d.records_received} of "
            f"{d.steps_completed} steps not stored, {d.records_dropped or 0} "
            "records dropped"
            for r, d in sorted(dropped.items())
        )
        + "; the figures cover what was stored.",
        "Raise TRACEML_BUFFER_MAX_RECORDS, or check the network path to the aggregator.",
        evidence={
            str(r): {
                "steps_completed": d.steps_completed,
                "records_received": d.records_received,
                "records_dropped": d.records_dropped,
            }
            for r, d in sorted(dropped.items())
        },
        ranks=list(dropped),
    )


def gpu_timing_unresolved(facts: Facts) -> Finding | None:
    """GPU_TIMING_UNRESOLVED: steps whose CUDA events never completed (CPU timings only)."""
    unresolved = {r.rank: r.steps_gpu_unresolved for r in facts.ranks if r.steps_gpu_unresolved}
    if not unresolved:
        return None
    return Finding(
        "GPU_TIMING_UNRESOLVED",
        "info",
        f"{ranks_text(list(unresolved)).capitalize()} had steps whose CUDA event "
        "timings never completed; those steps carry CPU timings only.",
        "Usually the last steps before an abrupt exit; nothing to do unless it is many.",
        evidence={"steps_per_rank": {str(r): n for r, n in unresolved.items()}},
        ranks=list(unresolved),
    )


def restarted(facts: Facts) -> Finding | None:
    """RESTARTED: earlier torchrun attempts stored steps (the analysis covers the latest)."""
    earlier = {r: rd.earlier_attempts for r, rd in facts.run.ranks.items() if rd.earlier_attempts}
    if not earlier:
        return None
    attempts = len({k for a in earlier.values() for k in a})
    return Finding(
        "RESTARTED",
        "warning",
        f"torchrun restarted the workers: {attempts} earlier attempt(s) stored steps; "
        "the analysis covers the latest attempt only.",
        "Find why the earlier attempt failed in the training logs.",
        evidence={
            "earlier_attempt_steps": {
                str(r): {str(k): v for k, v in sorted(a.items())}
                for r, a in sorted(earlier.items())
            }
        },
        ranks=sorted(earlier),
    )


#: The refusal kind of the torchrun process whose script built its own process group
#: (traceml_aggregator/script_world.py): expected, so told by SCRIPT_PROCESS_GROUP.
SCRIPT_PARENT = "script_parent"


def telemetry_refused(facts: Facts) -> Finding | None:
    """TELEMETRY_REFUSED: calls the aggregator refused (nothing of them stored), by kind, each
    with its first refusal's reason, so a summary short of data says why (the script's parent,
    :data:`SCRIPT_PARENT`, is told by SCRIPT_PROCESS_GROUP instead)."""
    rejected = {k: n for k, n in facts.run.rejected.items() if k != SCRIPT_PARENT}
    if not rejected:
        return None
    total = sum(rejected.values())
    reasons = facts.run.rejected_reasons
    kinds = "; ".join(
        f"{n} {kind}" + (f" (the first: {reasons[kind]})" if kind in reasons else "")
        for kind, n in sorted(rejected.items())
    )
    return Finding(
        "TELEMETRY_REFUSED",
        "warning",
        f"The aggregator refused {total} call{'s' * (total != 1)} and stored nothing of "
        f"{'them' if total != 1 else 'it'}: {kinds}.",
        "Each reason names the sender and what did not fit the run (its token, its run name, "
        "its rank or world size); docs/wire.md lists every kind.",
        evidence={
            "rejected": dict(sorted(rejected.items())),
            "reasons": dict(sorted(reasons.items())),
        },
    )


def script_process_group(facts: Facts) -> Finding | None:
    """SCRIPT_PROCESS_GROUP: the run's world is a process group the script built itself
    (processes it started, e.g. ``torch.multiprocessing.spawn``), not torchrun's."""
    world = facts.run.script_world
    if not world:
        return None
    size, node, launched = world.world_size, world.node_rank, world.launched_world_size
    return Finding(
        "SCRIPT_PROCESS_GROUP",
        "info",
        f"The run's world came from the script's own process group: {size} ranks on node "
        f"{node}, in processes the script started itself, where torchrun started {launched}; "
        "the summary holds them as the run's ranks."
        + (
            f" Torchrun's own process, which started them, reports nothing itself "
            f"({facts.run.rejected[SCRIPT_PARENT]} calls refused as {SCRIPT_PARENT}: "
            f"{facts.run.rejected_reasons.get(SCRIPT_PARENT, '')})."
            if SCRIPT_PARENT in facts.run.rejected
            else ""
        ),
        f"Nothing to do. To have torchrun start every rank instead, run {size} processes per "
        "node with traceml run (--nproc-per-node) and no process start in the script.",
        evidence={"world_size": size, "node_rank": node, "launched_world_size": launched},
        ranks=list(range(size)),
        nodes=[node],
    )


#: The health rules, in the order their findings are listed.
RULES = (
    rank_crashed,
    rank_hung,
    run_interrupted,
    rank_terminated,
    rank_missing,
    rank_never_reported,
    node_failed,
    node_lost,
    aggregator_restarted,
    aggregator_lost,
    rank_without_steps,
    telemetry_dropped,
    gpu_timing_unresolved,
    restarted,
    telemetry_refused,
    script_process_group,
)
