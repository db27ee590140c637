"""Automatic phases on the CPU clock, against planted durations (tests/scripts/planted_phases.py).

Two ranks under ``traceml run``; every step the dataset sleeps 30 ms, the forward 20 ms and
the optimizer wrapper 5 ms. Rank 1 feeds the same batches through a plain iterator instead of
a DataLoader: its input wait must be measured all the same, and its DataLoader time absent.

On a loaded machine a sleep ends late (a 5 ms sleep took 6-7 ms here with other test suites
running), so the planted durations are the ones the script timed around its own sleeps; each
phase TraceML measures must contain its planted part, step by step, and its median must be
within 15 % of the planted median. The planted medians themselves are never below the nominal
sleeps.
"""

from __future__ import annotations

import json
import statistics

import pytest
from conftest import SCRIPTS, free_port, load_summary, query, run_traceml
from helpers.jobs import run_args

pytestmark = [pytest.mark.slow, pytest.mark.torchrun, pytest.mark.alone]

STEPS = 25
NOMINAL_US = {"input": 30_000, "forward": 20_000, "optimizer": 5_000}
FIELDS = {"input": "input_wait_us", "forward": "forward_us", "optimizer": "optimizer_us"}
TOLERANCE = 0.15


def within(measured: float, planted: float) -> bool:
    return abs(measured - planted) <= TOLERANCE * planted


@pytest.fixture(scope="module")
def planted_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("planted")
    result = run_traceml(
        run_args(
            tmp,
            SCRIPTS / "planted_phases.py",
            "planted",
            free_port(),
            "--",
            "--steps",
            str(STEPS),
            "--iterator-rank",
            "1",
            "--truth-dir",
            str(tmp),
        ),
        cwd=tmp,
    )
    assert result.returncode == 0, result.stderr
    return tmp / "logs" / "planted"


def planted_us(run_dir, rank: int) -> dict[str, list[int]]:
    """What the script timed around its own planted parts, µs (rounded down like the wire)."""
    truth = json.loads((run_dir.parent.parent / f"truth_{rank}.json").read_text())
    return {part: [ns // 1000 for ns in values] for part, values in truth.items()}


def steps_of(run_dir, rank: int) -> list[dict]:
    columns = (
        "step",
        "step_us",
        "input_wait_us",
        "dataloader_next_us",
        "h2d_us",
        "forward_us",
        "backward_us",
        "optimizer_us",
    )
    rows = query(
        run_dir,
        f"SELECT {', '.join(columns)} FROM steps WHERE rank = ? AND restart = 0 ORDER BY step",
        (rank,),
    )
    return [dict(zip(columns, row, strict=True)) for row in rows]


@pytest.mark.slow
@pytest.mark.parametrize("rank", [0, 1])
def test_each_phase_contains_its_planted_part(planted_run, rank):
    steps = steps_of(planted_run, rank)
    assert [s["step"] for s in steps] == list(range(STEPS))
    planted = planted_us(planted_run, rank)
    assert {part: len(v) for part, v in planted.items()} == dict.fromkeys(FIELDS, STEPS)
    assert steps[0]["input_wait_us"] is None  # nothing came before the first step
    for part, field in FIELDS.items():
        for step in steps[1:] if part == "input" else steps:
            # TraceML's window encloses the planted code (1 µs for rounding).
            assert step[field] >= planted[part][step["step"]] - 1, (part, step)
    assert all(s["backward_us"] is not None for s in steps)


@pytest.mark.slow
@pytest.mark.parametrize("rank", [0, 1])
def test_planted_medians_within_15_percent(planted_run, rank):
    steps = steps_of(planted_run, rank)
    planted = planted_us(planted_run, rank)
    for part, field in FIELDS.items():
        measured = [s[field] for s in steps if s[field] is not None]
        truth = planted[part][1:] if part == "input" else planted[part]
        assert statistics.median(truth) >= NOMINAL_US[part]  # a sleep never ends early
        assert within(statistics.median(measured), statistics.median(truth)), (part, measured)
    if rank == 0:
        loader = statistics.median(s["dataloader_next_us"] for s in steps[1:])
        assert within(loader, statistics.median(planted["input"]))
    else:  # a plain iterator: input wait without DataLoader evidence
        assert all(s["dataloader_next_us"] is None for s in steps)


@pytest.mark.slow
@pytest.mark.parametrize("rank", [0, 1])
def test_residual_small_and_never_negative(planted_run, rank):
    later = steps_of(planted_run, rank)[1:]
    residuals = [
        s["step_us"] - s["input_wait_us"] - s["forward_us"] - s["backward_us"] - s["optimizer_us"]
        for s in later
    ]
    # Phases are disjoint parts of the step: the rest is loss, zero_grad and loop overhead.
    assert min(residuals) >= 0, residuals
    assert statistics.median(residuals) < 3_000, residuals


@pytest.mark.slow
def test_unmeasured_signals_are_null_on_cpu(planted_run):
    nulls = query(
        planted_run,
        "SELECT COUNT(*), COUNT(h2d_us), COUNT(gpu_step_us), COUNT(gpu_forward_us), "
        "COUNT(peak_allocated_bytes), COUNT(peak_reserved_bytes) FROM steps",
    )
    assert nulls == [(2 * STEPS, 0, 0, 0, 0, 0)]
    identities = query(planted_run, "SELECT rank, device, gpu_uuid FROM ranks ORDER BY rank")
    assert identities == [(0, "cpu", ""), (1, "cpu", "")]
    finish = query(planted_run, "SELECT rank, steps_gpu_unresolved FROM rank_finish ORDER BY rank")
    assert finish == [(0, 0), (1, 0)]


@pytest.mark.slow
def test_summary_reports_the_planted_medians(planted_run):
    summary = load_summary(planted_run)
    for rank in summary["ranks"]:
        planted = planted_us(planted_run, rank["rank"])
        phases = rank["phase_median_ms"]
        for part, name in (
            ("input", "input_wait"),
            ("forward", "forward"),
            ("optimizer", "optimizer"),
        ):
            assert within(phases[name] * 1000, statistics.median(planted[part])), (name, phases)
        assert phases["h2d"] is None
