"""Throughput (samples/s, tokens/s) and MFU over the window, per rank and for the job.

Inputs: the ``samples``, ``tokens`` and ``flops`` step fields and the rank's FLOPs count
(:attr:`~traceml.analysis.rundata.RankData.flops`), all made by :mod:`traceml.sdk.workload`.

Every figure is a total over time (``statistic`` :data:`~traceml.analysis.findings.SUMMED`):
the window steps' samples (tokens) divided by the same steps' summed step time, which is wall
time (input wait and time outside the steps included), so a job that pauses for evaluation
has the lower throughput it really had; model FLOPs likewise over the window steps from the
counted step on (in a run too short for a warm-up the counted step 1 may be in the window,
and step 0 has no FLOPs yet). The job's figures are the ranks' sums:
right for data parallelism (DDP, FSDP: each rank trains on its own batch), an overcount where
ranks share a batch (tensor or pipeline parallelism).

MFU = achieved model FLOP/s / peak FLOP/s, in %. The peak: the rank's ``--peak-tflops`` when
given (then a CPU run has an MFU too: the user said what its peak is), else the dense figure
of :mod:`traceml.core.peaks` for the rank's GPU and dtype; without either MFU is ``null``
and ``unavailable_reason`` says why (always on CPU without the flag). The job's MFU is its
summed achieved FLOP/s over its summed peaks, ``null`` unless every window rank has both.
An MFU above 100 % is never reported: it can only come from a FLOPs count or a peak that is
wrong (a dtype misread, a wrong ``--peak-tflops``), so the MFU is ``null`` and
``unavailable_reason`` gives both figures.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from traceml.analysis.document import JobThroughput, Mfu, RankThroughput
from traceml.analysis.findings import SUMMED
from traceml.analysis.rundata import RankData, StepTable
from traceml.analysis.stats import median
from traceml.core import peaks

#: Source of a peak the user gave (``Mfu.peak_source``).
FLAG_SOURCE = "--peak-tflops"


def _rate(
    values: Sequence[int | None], step_us: Sequence[int]
) -> tuple[float | None, float | None, int]:
    """``(total per second, median per step, steps with a value)`` of ``values`` over the
    summed ``step_us`` of every step; ``(None, None, 0)`` when no step has a value.

    A step without a value adds its time and nothing else: a loader that fetches ahead
    (Accelerate's ``DataLoaderShard``) fetches no batch in the last step of an epoch and two
    in the next, and the run's samples over its wall time stay right."""
    present = [v for v in values if v is not None]
    wall_us = sum(step_us)
    if not present or not wall_us:
        return None, None, 0
    return sum(present) * 1e6 / wall_us, median(present), len(present)


def _round(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


def _significant(value: float | None, digits: int = 6) -> float | None:
    """``value`` to ``digits`` significant digits: a small CPU model's 1e-8 TFLOP/s is not 0."""
    return None if value is None else float(f"{value:.{digits}g}")


def rank_mfu(rd: RankData, steps: StepTable) -> Mfu:
    """``ranks[].throughput.mfu`` over ``steps`` (the rank's window steps)."""
    count = rd.flops
    if count is None:
        return Mfu(
            statistic=SUMMED,
            counted_step=None,
            forward_flops=None,
            flops_per_step=None,
            count_ms=None,
            dtype=None,
            device_name=None,
            achieved_tflops=None,
            peak_tflops=None,
            peak_source=None,
            mfu_pct=None,
            unavailable_reason=(
                "no FLOPs count: no training forward of a traced model from step 1 on, or "
                "FlopCounterMode knows none of its ops"
            ),
        )
    counted = steps.take([i for i, n in enumerate(steps["step"]) if n >= count.step])
    achieved, per_step, _ = _rate(counted["flops"], counted["step_us"])
    peak: float | None
    if count.peak_tflops:
        peak, source = count.peak_tflops, FLAG_SOURCE
    else:
        peak, source = peaks.lookup(count.device_name, count.dtype)
    tflops = None if achieved is None else achieved / 1e12
    reason: str | None = None
    mfu_pct = None
    if tflops is None:
        reason = "no window step carries model FLOPs (counted after the window)"
    elif peak is None:
        reason = source
    elif tflops > peak:
        reason = (
            f"achieved {_significant(tflops, 4)} TFLOP/s exceeds the peak {peak} TFLOP/s "
            f"({source}, dtype {count.dtype}): the FLOPs count or the peak is "
            "wrong, so no MFU"
        )
    else:
        mfu_pct = _significant(100.0 * tflops / peak)
    return Mfu(
        statistic=SUMMED,
        counted_step=count.step,
        forward_flops=count.forward_flops,
        flops_per_step=None if per_step is None else int(per_step),
        count_ms=round(count.count_us / 1000.0, 3),
        dtype=count.dtype,
        device_name=count.device_name,
        achieved_tflops=_significant(tflops),
        peak_tflops=peak,
        peak_source=source if peak is not None else None,
        mfu_pct=mfu_pct,
        unavailable_reason=reason,
    )


def rank_throughput(rd: RankData, steps: StepTable) -> RankThroughput:
    """``ranks[].throughput``: the rank's samples, tokens and MFU over its window ``steps``."""
    samples, samples_step, counted = _rate(steps["samples"], steps["step_us"])
    tokens, tokens_step, _ = _rate(steps["tokens"], steps["step_us"])
    return RankThroughput(
        statistic=SUMMED,
        steps=counted,
        samples_per_s=_round(samples, 3),
        tokens_per_s=_round(tokens, 3),
        samples_per_step=samples_step,
        tokens_per_step=tokens_step,
        mfu=rank_mfu(rd, steps),
    )


def job_throughput(ranks: dict[int, RankThroughput]) -> JobThroughput:
    """``analysis.throughput``: sums over the window ranks (``ranks``; see the module
    docstring); a figure some rank lacks is ``null``."""

    def total(values: Iterable[float | None]) -> float | None:
        given = list(values)
        known = [v for v in given if v is not None]
        return None if not given or len(known) < len(given) else sum(known)

    figures = list(ranks.values())
    samples = total(t.samples_per_s for t in figures)
    tokens = total(t.tokens_per_s for t in figures)
    achieved = total(t.mfu.achieved_tflops for t in figures)
    peak = total(t.mfu.peak_tflops for t in figures)
    reason = next(
        (
            f"rank {r}: {t.mfu.unavailable_reason}"
            for r, t in ranks.items()
            if t.mfu.unavailable_reason
        ),
        None,
    )
    if not figures:
        reason = "no rank in the window"
    return JobThroughput(
        statistic=SUMMED,
        samples_per_s=_round(samples, 3),
        tokens_per_s=_round(tokens, 3),
        achieved_tflops=_significant(achieved),
        peak_tflops=_significant(peak),
        mfu_pct=(
            None
            if reason or achieved is None or peak is None
            else _significant(100.0 * achieved / peak)
        ),
        mfu_unavailable_reason=reason,
    )
