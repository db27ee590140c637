"""Exposed communication: the transfer itself, each rank's wait for its peers, and COMM_BOUND.

A rank's ``comm`` phase (:mod:`traceml.sdk.collectives`) is the time its training thread had
nothing to do but wait for collectives: for DDP, from the entry of the step's last gradient
bucket to the completion of the last bucket; for a collective called by hand, its whole call.
A collective completes on every rank at about the same moment (its result needs every rank's
input), so the rank that arrives last spends only the transfer in it, and a rank that arrived
earlier spends the transfer plus its wait for the last one. Per window step, across the ranks
that measured ``comm`` on it:

* the transfer is the least ``comm`` of any rank (the last to arrive);
* a rank's wait is its ``comm`` minus that.

Each figure is then the median over those steps (``analysis.comm``). Only the ranks' own
durations are compared, never their clocks. With one rank the transfer is its ``comm``.

COMM_BOUND: the median transfer is at least COMM_BOUND_PCT of the typical step: the
communication itself holds every step back, not a slow peer (a peer's slowness is a straggler,
and shows here as the others' wait). Two limits: a medians-per-step figure misses a collective
that runs only every few steps (it shows as spikes, if at all), and on NCCL ``comm`` ends when
the work is enqueued (docs/telemetry.md), so the transfer is not seen there yet.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from traceml.analysis import thresholds as th
from traceml.analysis.document import CommSplit
from traceml.analysis.findings import MEDIAN, Finding
from traceml.analysis.phases import Profile
from traceml.analysis.stats import ms
from traceml.analysis.step_time import severity

COMM_BOUND = "COMM_BOUND"


def split(profiles: Mapping[int, Profile]) -> CommSplit | None:
    """The transfer and each rank's wait per step (see the module docstring), ms.

    Args:
        profiles: each window rank's profile; its ``parts["comm"]`` holds one value per step
            of the clock (µs, None: not measured), the same steps on every rank.

    Returns:
        The split over the steps on which every rank measured ``comm``; None when there is no
        such step (no collective recorded, or a rank without the phase).
    """
    ranks = sorted(profiles)
    if not ranks or any("comm" not in profiles[r].parts for r in ranks):
        return None
    us = np.array(
        [[np.nan if v is None else v for v in profiles[r].parts["comm"]] for r in ranks],
        dtype=np.float64,
    ).reshape(len(ranks), -1)  # ranks x steps
    us = us[:, ~np.isnan(us).any(axis=0)]
    if not us.shape[1]:
        return None
    least = us.min(axis=0)
    return CommSplit(
        statistic=MEDIAN,
        steps=int(us.shape[1]),
        transfer_ms=ms(np.median(least)),
        comm_ms={str(r): ms(np.median(row)) for r, row in zip(ranks, us, strict=True)},
        wait_ms={str(r): ms(np.median(row - least)) for r, row in zip(ranks, us, strict=True)},
    )


def bound(comm: CommSplit | None, step_ms: float | None) -> Finding | None:
    """COMM_BOUND when the transfer of :func:`split` is at least COMM_BOUND_PCT of the typical
    step ``step_ms`` (ms); its ``impact_ms`` is the transfer per step. None otherwise."""
    if comm is None or not step_ms:
        return None
    share = round(100.0 * comm.transfer_ms / step_ms, 1)
    if share < th.COMM_BOUND_PCT:
        return None
    wait = max(comm.wait_ms.values())
    ranks = sorted(int(r) for r in comm.comm_ms)
    waiting = (
        f"; waiting for a slower peer adds at most {wait:.1f} ms on top" if len(ranks) > 1 else ""
    )
    return Finding(
        COMM_BOUND,
        severity(comm.transfer_ms, step_ms),
        f"Communication holds every step: the collectives' transfer takes "
        f"{comm.transfer_ms:.1f} ms per step ({share:.0f}% of the typical {step_ms:.1f} ms "
        f"step; medians per step of the least time any rank spent in them), time the compute "
        f"does not hide{waiting} (threshold COMM_BOUND_PCT = {th.COMM_BOUND_PCT:g}%).",
        "Send less, less often, or hide it: overlap the gradient all-reduce with backward "
        "(DDP bucket_cap_mb: smaller buckets start sooner, gradient_as_bucket_view=True), "
        "all-reduce less often (no_sync() with gradient accumulation, a larger batch per "
        "step), compress gradients (bf16/fp16 compression hooks, PowerSGD), and check the "
        "topology: NCCL over NVLink or InfiniBand, not TCP sockets between hosts.",
        evidence={
            "statistic": MEDIAN,
            "transfer_ms": comm.transfer_ms,
            "transfer_share_pct": share,
            "threshold_pct": th.COMM_BOUND_PCT,
            "step_time_ms": round(step_ms, 3),
            "steps": comm.steps,
            "per_rank_comm_ms": comm.comm_ms,
            "per_rank_wait_ms": comm.wait_ms,
        },
        ranks=ranks,
        impact_ms=comm.transfer_ms,
    )
