"""Diagnosis truth on hand-built runs: outside-step time, one statistic per claim, spikes,
onsets and drift, straggler cost (the real-torchrun versions: test_diagnosis_truth.py)."""

from __future__ import annotations

import time

import pytest

from rundata_factory import rank, run_of, step
from traceml.analysis.outside import split_gap
from traceml.analysis.summary import build_summary
from traceml.sdk.step import StepTracer

MS = 1000  # µs


def test_only_the_iterator_that_fed_the_step_is_its_input_wait():
    steps = []
    tracer = StepTracer(steps.append, time.perf_counter_ns())
    tracer.begin()
    tracer.end()
    # between two steps: an evaluation loader (3 batches), then the training loader's batch
    for _ in range(3):
        tracer.add_dataloader(50_000_000, iterator=1)
    tracer.add_dataloader(2_000_000, iterator=2)
    tracer.add_dataloader(1_000_000, iterator=2)
    tracer.begin()
    tracer.add_dataloader(4_000_000, iterator=2)  # a micro-batch fetched inside the step
    tracer.end()
    assert steps[1].dataloader_ns == 7_000_000
    assert steps[1].input_wait_ns >= 4_000_000  # the whole gap, plus the in-step fetch


def test_split_gap():
    wait, outside = split_gap([None, 5 * MS, 900 * MS, 3 * MS], [1 * MS, 4 * MS, 4 * MS, None])
    assert wait == [1 * MS, 4 * MS, 4 * MS, 0]
    assert outside == [None, 1 * MS, 896 * MS, 3 * MS]
    # no DataLoader at all: the gap is the fetch, outside-step time is not separable
    assert split_gap([None, 5 * MS], [None, None]) == ([None, 5 * MS], [None, None])


def _eval_run(n=60, every=15, eval_ms=400):
    """Two ranks, 2 ms DataLoader wait, and an evaluation pause outside the steps every
    ``every`` steps."""

    def steps():
        out = []
        for i in range(n):
            gap = 2 * MS + (eval_ms * MS if i and i % every == 0 else 0)
            out.append(step(i, input_wait=gap, dataloader_next_us=2 * MS))
        return out

    return run_of([rank(0, steps()), rank(1, steps())])


def test_periodic_evaluation_is_outside_step_time_not_input_wait():
    s = build_summary(_eval_run())
    p = s["primary_diagnosis"]
    assert p["kind"] == "OUTSIDE_STEP_TIME"
    assert [f["kind"] for f in s["findings"]["step_time"]] == []
    ev = p["evidence"]
    # window: steps 5-59; pauses before steps 15, 30, 45
    assert (ev["gaps"], ev["gap_steps"], ev["period_steps"]) == (3, [15, 30, 45], 15)
    assert (ev["gap_median_ms"], ev["gap_max_ms"]) == (400.0, 400.0)
    in_step_ms = 2 + 10 + 20 + 2 + 0.5
    wall_ms = 55 * in_step_ms + 3 * 400
    assert ev["share_of_wall_pct"] == round(100 * 1200 / wall_ms, 1)
    assert p["impact_ms"] == pytest.approx(1200 / 55, abs=1e-3)
    r0 = s["ranks"][0]
    assert r0["phase_median_ms"]["input_wait"] == 2.0
    assert r0["step_time_ms"]["max"] == in_step_ms  # the pauses are not step time
    assert r0["outside_steps"]["first_gap_ms"] == 0.0


def _ckpt_run(n=60, every=10, ckpt_ms=150, warmup=0):
    """Rank 0 saves a checkpoint inside the step (its residual) every ``every`` steps; the
    first ``warmup`` steps have a slow forward."""

    def steps(r):
        return [
            step(
                i,
                residual=500 + (ckpt_ms * MS if r == 0 and i % every == every - 1 else 0),
                forward=10 * MS + (60 * MS if i < warmup else 0),
            )
            for i in range(n)
        ]

    return run_of([rank(0, steps(0)), rank(1, steps(1))])


def test_checkpoint_spikes_are_spikes_not_a_median():
    s = build_summary(_ckpt_run())
    p = s["primary_diagnosis"]
    assert p["kind"] == "STEP_SPIKES"
    assert p["ranks"] == [0]
    assert [f["kind"] for f in s["findings"]["step_time"]] == []
    ev = p["evidence"]
    assert (ev["part"], ev["count"], ev["period_steps"]) == ("residual", 6, 10)
    assert ev["steps"] == [9, 19, 29, 39, 49, 59]
    assert (ev["size_ms"], ev["excess_ms"], ev["median_ms"]) == (150.5, 150.0, 0.5)
    wall_ms = 55 * 33.5 + 6 * 150
    assert ev["share_of_wall_pct"] == round(100 * 900 / wall_ms, 1)
    assert "async_save" in p["action"]


def test_slow_first_steps_are_warmup_not_spikes():
    s = build_summary(_ckpt_run(ckpt_ms=0, warmup=15))
    assert s["primary_diagnosis"]["kind"] == "COMPUTE_BOUND"
    assert s["findings"]["step_time"] == []
