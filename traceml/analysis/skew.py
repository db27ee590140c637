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
LATE_ARRIVAL_PCT of them (in a balanced run someone is always last, by noise: never by the
floor). Its cost is the others' wait at the collectives it held up, in GPU-hours. Two limits:
the collectives of a step other than its arrival are not compared, and a node whose launcher
sent no offset (ranks without ``traceml run``, on more than one node) leaves the clocks unknown:
the figures are given, the finding is not.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from traceml.analysis import thresholds as th
from traceml.analysis.document import ArrivalSkew
from traceml.analysis.findings import MEDIAN, Finding
from traceml.analysis.rundata import RunData
from traceml.analysis.step_time import severity
from traceml.analysis.window import Window

LATE_ARRIVAL = "LATE_ARRIVAL"
_US_PER_HOUR = 3_600_000_000


def _ms(us: float) -> float:
    return round(float(us) / 1000.0, 3)


def arrivals(
    run: RunData, window: Window, node_of: dict[int, int | None]
) -> tuple[list[int], np.ndarray, int, float | None, dict[str, float]] | None:
    """The window's arrivals on node 0's clock.

    Returns:
        ``(ranks, us, mismatched, error_us, offsets_ms)``: the ranks compared; their arrivals
        (ranks x steps, µs on node 0's clock, relative to the earliest); the window steps left
        out because their ranks were at different collectives; the largest error bound of the
        compared nodes' offsets (µs; 0 on one node, None when a node has no offset); each
        node's offset (ms). None with fewer than two ranks or no step to compare.
    """
    clocks = {c.node_rank: c for c in run.node_clocks}
    ranks, rows, keys = [], [], []
    for r in window.ranks:
        identity = run.ranks[r].identity
        steps = window.steps[r]
        if identity is None or identity.start_unix_us is None:
            continue
        ranks.append(r)
        rows.append([np.nan if v is None else float(v) for v in steps["arrive_us"]])
        keys.append(list(zip(steps["arrive_group"], steps["arrive_seq"], strict=True)))
    if len(ranks) < 2:
        return None
    nodes = {node_of.get(r) for r in ranks}
    known = [clocks[n] for n in nodes if n in clocks]
    if len(nodes) == 1:
        error_us: float | None = 0.0
    elif len(known) == len(nodes):
        error_us = float(max(c.error_us for c in known))
    else:
        error_us = None
    start = min(run.ranks[r].identity.start_unix_us for r in ranks)  # type: ignore[union-attr]
    base = np.empty(len(ranks), dtype=np.float64)
    for i, r in enumerate(ranks):
        node = node_of.get(r)
        shift = clocks[node].offset_us if node in clocks and len(nodes) > 1 else 0
        base[i] = run.ranks[r].identity.start_unix_us - start + shift  # type: ignore[union-attr]
    us = np.array(rows, dtype=np.float64) + base[:, None]
    arrived = ~np.isnan(us).any(axis=0)  # every rank waited in a collective on the step
    same = np.array([len(set(column)) == 1 for column in zip(*keys, strict=True)], dtype=bool)
    keep = arrived & same
    offsets = {str(c.node_rank): _ms(c.offset_us) for c in sorted(known, key=lambda c: c.node_rank)}
    if not keep.any():
        return None
    return ranks, us[:, keep], int((arrived & ~same).sum()), error_us, offsets


def skew(
    run: RunData, window: Window, node_of: dict[int, int | None]
) -> tuple[ArrivalSkew | None, Arrivals | None]:
    """``analysis.skew`` (see the module docstring), and the arrivals it came from for
    :func:`late_arrival`; ``(None, None)`` when nothing could be compared."""
    found = arrivals(run, window, node_of)
    if found is None:
        return None, None
    ranks, us, mismatched, error_us, offsets = found
    last = us.argmax(axis=0)
    latest = us.max(axis=0)
    late = latest - np.median(np.sort(us, axis=0)[:-1], axis=0)  # after the others' median
    waits = latest - us  # ranks x collectives
    n = us.shape[1]
    counts = np.bincount(last, minlength=len(ranks))
    doc = ArrivalSkew(
        statistic=MEDIAN,
        collectives=n,
        mismatched=mismatched,
        last_pct={str(r): round(100.0 * counts[i] / n, 1) for i, r in enumerate(ranks)},
        late_ms={str(r): _ms(np.median(late[last == i])) for i, r in enumerate(ranks) if counts[i]},
        wait_ms={str(r): _ms(np.median(waits[i])) for i, r in enumerate(ranks)},
        clock_offsets_ms=offsets,
        clock_error_ms=None if error_us is None else _ms(error_us),
    )
    return doc, Arrivals(ranks, last, late, waits)


@dataclass(frozen=True)
class Arrivals:
    """The compared collectives, as :func:`skew` found them.

    Attributes:
        ranks: the ranks compared, ascending.
        last: per collective, the index (into ``ranks``) of the rank that arrived last.
        late: per collective, the last arrival after the others' median, µs.
        waits: ranks x collectives: each rank's wait for the last arrival, µs.
    """

    ranks: list[int]
    last: np.ndarray
    late: np.ndarray
    waits: np.ndarray


def late_arrival(
    doc: ArrivalSkew | None,
    found: Arrivals | None,
    step_ms: float | None,
    world_size: int,
    steps_per_index: float = 1.0,
) -> Finding | None:
    """LATE_ARRIVAL (see the module docstring) from :func:`skew`'s results, with the typical
    step ``step_ms`` (ms): the rank that held up the most collectives (arrived last by at least
    the floor), when it held up at least LATE_ARRIVAL_PCT of them. ``impact_ms`` is the others'
    median wait at those collectives times that share. None otherwise."""
    if doc is None or found is None or not step_ms or doc.clock_error_ms is None:
        return None
    floor_ms = max(
        th.STRAGGLER_MIN_GAP_MS, step_ms * th.STRAGGLER_GAP_PCT / 100.0, 2 * doc.clock_error_ms
    )
    held = found.late >= floor_ms * 1000.0
    counts = np.bincount(found.last[held], minlength=len(found.ranks))
    worst = int(counts.argmax())
    n = len(found.late)
    share = round(100.0 * counts[worst] / n, 1)
    if share < th.LATE_ARRIVAL_PCT:
        return None
    rank, at = found.ranks[worst], held & (found.last == worst)
    others = len(found.ranks) - 1
    others_us = found.waits[:, at].sum(axis=0)  # the others' summed wait at each
    late = _ms(np.median(found.late[at]))
    wait_ms = _ms(np.median(others_us) / others)
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
