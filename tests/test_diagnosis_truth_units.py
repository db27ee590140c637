"""Diagnosis truth on hand-built runs: outside-step time, one statistic per claim, spikes,
onsets and drift, straggler cost (the real-torchrun versions: test_diagnosis_truth.py)."""

from __future__ import annotations

import time

import pytest
from rundata_factory import MIB as MIB_
from rundata_factory import gpu_sample, rank, rss_samples, run_of, step, system_sample
from rundata_factory import steps as same_steps

from traceml.analysis.outside import split_gap
from traceml.analysis.summary import build_summary
from traceml.report.text import render_text
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
    assert steps[1].dataloader_next_ns == 7_000_000
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
    text = render_text(s)
    assert "rank  wall %  pauses  median    max  every  first" in text
    assert "   0      39       3   400.0  400.0     15    0.0" in text
    assert max(len(line) for line in text.splitlines()) <= 80


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


def test_straggler_from_step_32_has_its_onset_and_cost():
    def steps(r):
        late = 30 * MS if r == 1 else 0
        return [step(i, forward=10 * MS + (late if i >= 32 else 0)) for i in range(80)]

    s = build_summary(run_of([rank(0, steps(0)), rank(1, steps(1))]))
    p = s["primary_diagnosis"]
    assert (p["kind"], p["ranks"]) == ("COMPUTE_STRAGGLER", [1])
    assert [f["kind"] for f in s["findings"]["step_time"]] == []  # no SLOWDOWN beside it
    ev = p["evidence"]
    assert (ev["onset_step"], ev["before_ms"], ev["after_ms"]) == (32, 0.0, 30.0)
    assert "from step 32" in p["summary"]
    assert (ev["wait_ms_per_step"], ev["cost_steps"]) == (30.0, 48)
    assert ev["gpu_hours"] == round(2 * 30.0 * 48 / 3.6e6, 6)
    scores = {r["rank"]: r["relative_score"] for r in s["ranks"]}
    assert scores[0]["forward"] == 1.0 and scores[1]["forward"] == 0.25
    assert scores[1]["backward"] == 1.0


def test_straggler_from_the_start_has_no_onset():
    def steps(r):
        return [step(i, forward=10 * MS + (30 * MS if r == 1 else 0)) for i in range(60)]

    ev = build_summary(run_of([rank(0, steps(0)), rank(1, steps(1))]))["primary_diagnosis"]
    assert ev["evidence"]["onset_step"] is None
    assert ev["evidence"]["cost_steps"] == 55


def test_job_slowdown_and_drift():
    def steps(extra):
        return [step(i, residual=500 + extra(i)) for i in range(200)]

    jump = build_summary(run_of([rank(0, steps(lambda i: 20 * MS if i >= 120 else 0))]))
    p = jump["primary_diagnosis"]
    assert (p["kind"], p["evidence"]["onset_step"]) == ("SLOWDOWN", 120)
    assert (p["evidence"]["before_ms"], p["evidence"]["after_ms"]) == (33.5, 53.5)

    creep = build_summary(run_of([rank(0, steps(lambda i: 100 * i))]))  # +0.1 ms per step
    p = creep["primary_diagnosis"]
    assert p["kind"] == "STEP_TIME_DRIFT"
    assert p["evidence"]["rate_ms_per_1000_steps"] == pytest.approx(100.0, rel=0.01)


def test_drift_needs_drift_min_steps_in_the_window():
    """A line that rises by half the step over too short a window is no STEP_TIME_DRIFT."""
    from traceml.analysis import thresholds as th

    def kinds(window_steps: int) -> list[str]:
        n = th.WARMUP_STEPS + window_steps
        run = run_of([rank(0, [step(i, residual=20 * MS + MS * i) for i in range(n)])])
        return [f["kind"] for f in build_summary(run)["findings"]["step_time"]]

    assert "STEP_TIME_DRIFT" not in kinds(th.DRIFT_MIN_STEPS - 1)
    assert "STEP_TIME_DRIFT" in kinds(th.DRIFT_MIN_STEPS)


def test_compare_interval_is_seeded_and_decides_the_gate():
    import random

    from traceml.report.compare import DEFAULT_GATE_PCT, change_interval, regressions_beyond

    rng = random.Random(1)
    a = [[20 + rng.gauss(0, 2) for _ in range(200)] for _ in range(2)]
    same = [[20 + rng.gauss(0, 2) for _ in range(200)] for _ in range(2)]
    slower = [[v * 1.1 for v in rank_steps] for rank_steps in a]
    low, high = change_interval(a, same)
    assert low < 0 < high and high - low < 8
    assert change_interval(a, same) == (low, high)  # seeded: the same interval every time
    low, high = change_interval(a, slower)
    assert 5 < low < 10 < high < 15
    assert change_interval(a, [[], []]) is None

    def doc(change_pct, ci):
        row = {
            "name": "step_time_ms",
            "key": True,
            "status": "regressed",
            "delta": 1.0,
            "change_pct": change_pct,
            "change_ci_pct": ci,
        }
        return {"metrics": [row]}

    assert regressions_beyond(doc(6.0, [-1.0, 13.0]), DEFAULT_GATE_PCT) == []  # noise
    assert regressions_beyond(doc(4.0, [2.0, 6.0]), DEFAULT_GATE_PCT) == []  # small
    assert len(regressions_beyond(doc(9.0, [2.0, 16.0]), DEFAULT_GATE_PCT)) == 1


def test_every_finding_of_the_hand_built_runs_is_consistent():
    """Every finding of every section, here and in the golden runs (memory, system and
    health findings among them), states its statistic and agrees with it."""
    from consistency import KIND_STATISTIC, all_findings, check_consistent
    from test_summary_golden import SCENARIOS

    from traceml.analysis.findings import KINDS

    def straggler(i, r):
        return step(i, forward=10 * MS + (30 * MS if r == 1 and i >= 32 else 0))

    # a loop without a DataLoader pausing 400 ms every 15 steps: a median of 2 ms of input
    # wait must not be sold as a 40 % share (the "0.5 ms per step (73 %)")
    no_loader = [
        step(i, input_wait=2 * MS + (400 * MS if i % 15 == 0 else 0), dataloader_next_us=None)
        for i in range(60)
    ]

    span_us = range(1000 * MS, 4000 * MS, 100 * MS)  # samples every 100 ms over the steps
    runs = {
        "eval": _eval_run(),
        "checkpoint": _ckpt_run(),
        "warmup": _ckpt_run(ckpt_ms=0, warmup=15),
        "straggler": run_of([rank(r, [straggler(i, r) for i in range(80)]) for r in (0, 1)]),
        "input": run_of([rank(r, same_steps(40, input_wait=20 * MS)) for r in (0, 1)]),
        "no_loader_pauses": run_of([rank(r, no_loader) for r in (0, 1)]),
        # idle GPUs on a host whose RAM is nearly full
        # rank 1 leaks 8 MiB a step; the node's RAM grows faster still (its loader workers)
        "host_leak": run_of(
            [
                rank(
                    r,
                    same_steps(100),
                    process_samples=rss_samples(
                        r, 100, lambda x, r=r: 400 * MIB_ + 8 * MIB_ * x * r
                    ),
                )
                for r in (0, 1)
            ],
            system={
                0: [system_sample(1000 * MS + k * 100 * MS, ram=0.3 + k * 0.001) for k in range(33)]
            },
        ),
        "host_pressure": run_of(
            [rank(r, same_steps(40), uuid=f"GPU-0-{r}") for r in (0, 1)],
            system={0: [system_sample(t, ram=0.97) for t in span_us]},
            gpus={0: [gpu_sample(t, g, 5.0) for t in span_us for g in (0, 1)]},
        ),
    }
    kinds, checked = {}, set()
    for name, run in runs.items():
        s = build_summary(run)
        kinds[name] = [f["kind"] for f in [s["primary_diagnosis"]] + s["findings"]["step_time"]]
        for f in all_findings(s):
            check_consistent(f, name)
            checked.add(f["kind"])
    for name, make in SCENARIOS.items():
        run, live = make()
        for f in all_findings(build_summary(run, live=live)):
            check_consistent(f, name)
            checked.add(f["kind"])
    # the memory and system kinds the hand-built runs have, each checked at least once
    assert set(KIND_STATISTIC) - set(KINDS["health"]) <= checked, checked  # every one
    assert {"RANK_CRASHED", "RANK_TERMINATED", "INSUFFICIENT_DATA"} <= checked, checked
    assert kinds["no_loader_pauses"] == ["STEP_SPIKES"]  # input-wait spikes, not INPUT_BOUND
    assert kinds["input"] == ["INPUT_BOUND"]
