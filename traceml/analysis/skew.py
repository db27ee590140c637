"""Arrival skew: who arrives last at the ranks' collectives, and how long the others wait.

Each step a rank sends its *arrival* (:data:`traceml.core.phases.ARRIVAL_FIELDS`): of the
collectives the step waited in, the one it entered last (for DDP the last gradient bucket,
whose all-reduce is the wait at the end of backward), as its entry time, its process group and
its sequence number in that group. The ranks of a group issue its collectives in the same
order, so the same (group, sequence number) is the same collective on every rank.

Node 0 reads each arrival on its own clock: the rank's ``start_unix_us`` (its wall clock at
``init()``) plus the arrival's offset from it, plus its node's clock offset from node 0's
(:class:`~traceml.core.records.NodeClock`, estimated by the node's launcher over its session,
:mod:`traceml.core.clock`). Per window step whose ranks all arrived at the same collective:

* the rank that arrived last, and its lateness after the median of the others' arrivals;
* each rank's wait for it: the last arrival minus its own.

``analysis.skew`` gives per rank the share of the collectives it arrived last at, its median
lateness when it did, and its median wait. A rank *holds up* a collective when it arrives last
by at least the floor: the straggler floor (the same as the phase stragglers':
STRAGGLER_GAP_PCT of the typical step and STRAGGLER_MIN_GAP_MS), and twice the largest clock
error bound of the nodes compared (a lateness the clocks cannot vouch for counts for nothing).
LATE_ARRIVAL names the rank that held up the most collectives, when it held up at least
LATE_ARRIVAL_PCT of them and at least twice as many as any other rank (in a balanced run
someone is always last, by noise: never by the floor). Its cost is the others' wait at the
collectives it held up, in GPU-hours. It is withheld, whatever the figures (``withheld`` says
why), on NCCL (an arrival is when the host enqueued the collective, and a host running ahead of
its GPU enqueues early: the completion is not timed yet), when a node's launcher sent no
offset (ranks without ``traceml run`` on more than one node: the figures read each clock as
sent), and when ranks of one node rank are on different hosts (a launch without torchrun's
node ranks). Two limits: the collectives of a step other than its arrival are not compared,
and one offset per node (the latest stored) is applied to the whole window, so a clock that
drifts without NTP moves the earlier arrivals by its drift, which the bound does not include.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from traceml.analysis import thresholds as th
from traceml.analysis.document import ArrivalSkew
from traceml.analysis.findings import MEDIAN, Finding
from traceml.analysis.rundata import RunData
from traceml.analysis.stats import ms
from traceml.analysis.step_time import severity
from traceml.analysis.window import Window
from traceml.core.records import NodeClock

LATE_ARRIVAL = "LATE_ARRIVAL"
_US_PER_HOUR = 3_600_000_000


@dataclass(frozen=True)
class Arrivals:
    """The compared collectives on node 0's clock (:func:`arrivals`).

    Attributes:
        ranks: the ranks compared, ascending.
        us: ranks x collectives: each rank's arrival, µs on node 0's clock from the earliest
            rank's start.
        mismatched: window steps left out because their ranks were at different collectives.
        without: window ranks that sent no arrival on any window step (left out).
        error_us: the largest error bound of the compared nodes' offsets, µs; 0 when every
            rank is on one host; None when the clocks are unknown.
        offsets_ms: each compared node's offset, ms.
        withheld: why no LATE_ARRIVAL is raised whatever the figures say, or "".
    """

    ranks: list[int]
    us: np.ndarray
    mismatched: int
    without: list[int]
    error_us: float | None
    offsets_ms: dict[str, float]
    withheld: str


def arrivals(run: RunData, window: Window, node_of: dict[int, int | None]) -> Arrivals | None:
    """The window's arrivals on node 0's clock (see the module docstring); None with fewer
    than two ranks with arrivals, or no step on which they all arrived at one collective."""
    clocks = {c.node_rank: c for c in run.node_clocks}
    ranks, rows, keys, without = [], [], [], []
    for r in window.ranks:
        identity = run.ranks[r].identity
        steps = window.steps[r]
        if identity is None or identity.start_unix_us is None:
            continue
        if all(v is None for v in steps["arrive_us"]):
            without.append(r)
            continue
        ranks.append(r)
        rows.append([np.nan if v is None else float(v) for v in steps["arrive_us"]])
        keys.append(list(zip(steps["arrive_group"], steps["arrive_seq"], strict=True)))
    if len(ranks) < 2:
        return None
    identities = {r: run.ranks[r].identity for r in ranks}
    hosts: dict[int | None, set[str | None]] = {}
    for r, identity in identities.items():
        hosts.setdefault(node_of.get(r), set()).add(identity.hostname if identity else None)
    known = [clocks[n] for n in hosts if n in clocks]
    error_us: float | None = None
    withheld = ""
    if len(hosts) == 1 and len(next(iter(hosts.values()))) == 1:
        error_us = 0.0
    elif any(len(names) > 1 for names in hosts.values()):
        withheld = "ranks of one node rank on different hosts: their clocks are unknown"
    elif len(known) < len(hosts):
        withheld = "a node's launcher sent no clock offset: the figures read its clock as sent"
    else:
        error_us = float(max(c.error_us for c in known))
    if any(identity and identity.backend == "nccl" for identity in identities.values()):
        withheld = (
            "NCCL: an arrival is when the host enqueued the collective, which a host running "
            "ahead of its GPU makes early (its completion is not timed yet)"
        )
    starts = {r: identity.start_unix_us for r, identity in identities.items() if identity}
    start = min(starts.values())
    base = np.empty(len(ranks), dtype=np.float64)
    for i, r in enumerate(ranks):
        node = node_of.get(r)
        shift = clocks[node].offset_us if error_us and node in clocks else 0
        base[i] = starts[r] - start + shift
    us = np.array(rows, dtype=np.float64) + base[:, None]
    arrived = ~np.isnan(us).any(axis=0)  # every rank waited in a collective on the step
    same = np.array([len(set(column)) == 1 for column in zip(*keys, strict=True)], dtype=bool)
    keep = arrived & same
    if not keep.any():
        return None
    return Arrivals(
        ranks=ranks,
        us=us[:, keep],
        mismatched=int((arrived & ~same).sum()),
        without=without,
        error_us=error_us,
        offsets_ms={str(c.node_rank): ms(c.offset_us) for c in sorted(known, key=_node)},
        withheld=withheld,
    )


def _node(c: NodeClock) -> int:
    return c.node_rank


@dataclass(frozen=True)
class Late:
    """Who arrived last at each compared collective (:func:`skew`).

    Attributes:
        doc: ``analysis.skew``, the summary's account of these figures.
        ranks: the ranks compared, ascending.
        last: per collective, the index (into ``ranks``) of the rank that arrived last.
        late_us: per collective, the last arrival after the others' median, µs.
        waits: ranks x collectives: each rank's wait for the last arrival, µs.
    """

    doc: ArrivalSkew
    ranks: list[int]
    last: np.ndarray
    late_us: np.ndarray
    waits: np.ndarray


def skew(run: RunData, window: Window, node_of: dict[int, int | None]) -> Late | None:
    """Who arrived last at the window's collectives, with ``analysis.skew`` (see the module
    docstring) for the summary and :func:`late_arrival`; None when nothing could be
    compared."""
    found = arrivals(run, window, node_of)
    if found is None:
        return None
    ranks, us = found.ranks, found.us
    last = us.argmax(axis=0)
    latest = us.max(axis=0)
    late = latest - np.median(np.sort(us, axis=0)[:-1], axis=0)  # after the others' median
    waits = latest - us  # ranks x collectives
    n = us.shape[1]
    counts = np.bincount(last, minlength=len(ranks))
    doc = ArrivalSkew(
        statistic=MEDIAN,
        collectives=n,
        mismatched=found.mismatched,
        ranks_without=found.without,
        last_pct={str(r): round(100.0 * float(counts[i]) / n, 1) for i, r in enumerate(ranks)},
        late_ms={str(r): ms(np.median(late[last == i])) for i, r in enumerate(ranks) if counts[i]},
        wait_ms={str(r): ms(np.median(waits[i])) for i, r in enumerate(ranks)},
        clock_offsets_ms=found.offsets_ms,
        clock_error_ms=None if found.error_us is None else ms(found.error_us),
        withheld=found.withheld or None,
    )
    return Late(doc, ranks, last, late, waits)


def late_arrival(
    found: Late | None,
    step_ms: float | None,
    world_size: int,
    steps_per_index: float = 1.0,
) -> Finding | None:
    """LATE_ARRIVAL (see the module docstring) from :func:`skew`'s result, with the typical
    step ``step_ms`` (ms): the rank that held up the most collectives (arrived last by at least
    the floor), when it held up at least LATE_ARRIVAL_PCT of them and at least twice as many
    as any other rank. ``impact_ms`` is the others' median wait at those collectives times
    that share. None otherwise, and whenever ``analysis.skew`` says why not (``withheld``)."""
    if found is None or not step_ms:
        return None
    doc = found.doc
    if doc.withheld or doc.clock_error_ms is None:
        return None
    floor_ms = max(
        th.STRAGGLER_MIN_GAP_MS, step_ms * th.STRAGGLER_GAP_PCT / 100.0, 2 * doc.clock_error_ms
    )
    held = found.late_us >= floor_ms * 1000.0
    counts = np.bincount(found.last[held], minlength=len(found.ranks))
    worst = int(counts.argmax())
    n = len(found.late_us)
    share = round(100.0 * float(counts[worst]) / n, 1)
    if share < th.LATE_ARRIVAL_PCT or counts[worst] < 2 * np.sort(counts)[-2]:
        return None
    rank, at = found.ranks[worst], held & (found.last == worst)
    others = len(found.ranks) - 1
    others_us = found.waits[:, at].sum(axis=0)  # the others' summed wait at each
    late = ms(np.median(found.late_us[at]))
    wait_ms = ms(np.median(others_us) / others)
    cost_steps = round(int(at.sum()) * steps_per_index)
    gpu_hours = round(float(others_us.sum()) * steps_per_index / _US_PER_HOUR, 6)
    clocks = (
        f"; clocks aligned across nodes within ±{doc.clock_error_ms:.3g} ms"
        if len(doc.clock_offsets_ms) > 1
        else ""
    )
    impact_ms = round(wait_ms * share / 100.0, 3)
    return Finding(
        LATE_ARRIVAL,
        severity(impact_ms, step_ms),
        f"Rank {rank} held up {share:.0f}% of the {n} collectives compared (each step's last "
        f"one), arriving last {late:.1f} ms after the others' median; the other {others} "
        f"rank{'s' if others != 1 else ''} waited {wait_ms:.1f} ms a step for it there "
        f"(medians per step), {gpu_hours:.4g} GPU-hours over {cost_steps} steps (world size "
        f"{world_size}){clocks}.",
        f"Find what rank {rank} does before its collectives that the others do not: the "
        "phase table and any straggler finding name the slower phase (input, forward, "
        "backward, optimizer); then uneven batches (sequence lengths, padding), a slower GPU "
        "or host, CPU contention on its node, or work only it does (logging, evaluation, "
        "checkpoints on rank 0).",
        evidence={
            "statistic": MEDIAN,
            "slow_rank": rank,
            "held_pct": share,
            "threshold_pct": th.LATE_ARRIVAL_PCT,
            "last_pct": doc.last_pct[str(rank)],
            "late_ms": late,
            "floor_ms": round(floor_ms, 3),
            "others_wait_ms": wait_ms,
            "collectives": n,
            "clock_error_ms": doc.clock_error_ms,
            "cost_steps": cost_steps,
            "gpu_hours": gpu_hours,
        },
        ranks=[rank],
        impact_ms=impact_ms,
    )
