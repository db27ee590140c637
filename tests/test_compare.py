"""`traceml compare`: two real runs (input-bound vs fixed) and the verdict rules."""

from __future__ import annotations

import copy
import json

import pytest
from conftest import run_traceml
from planted import DELAY_MS

from traceml.report.compare import (
    EQUIVALENT_PCT,
    INCONCLUSIVE_EXIT_CODE,
    REGRESSION_EXIT_CODE,
    compare,
    render_compare_text,
)


@pytest.fixture
def runs(planted):
    return planted("input"), planted("balanced")


def _compare(a, b, out_dir, fail_on_regression: float):
    return run_traceml(
        [
            "compare",
            str(a),
            str(b),
            "--out-dir",
            str(out_dir),
            "--fail-on-regression",
            str(fail_on_regression),
        ],
        cwd=out_dir,
    )


# The two runs' step times are compared: they are made with the machine to itself (a run made
# while four workers load two cores stretches its compute by as much as the planted 20 ms).
@pytest.mark.alone
@pytest.mark.torchrun
@pytest.mark.slow
def test_input_bound_vs_fixed_is_an_improvement(runs, tmp_path):
    slow, fixed = runs
    proc = _compare(slow.run_dir / "final_summary.json", fixed.run_dir, tmp_path, 5)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads((tmp_path / "compare.json").read_text())
    assert (tmp_path / "compare.txt").read_text() == proc.stdout
    assert doc["verdict"] == "IMPROVEMENT"
    assert doc["diagnosis_change"] == {"a": "INPUT_BOUND", "b": "COMPUTE_BOUND", "changed": True}
    step = next(m for m in doc["metrics"] if m["name"] == "step_time_ms")
    a_ms = slow.summary["analysis"]["typical"]["step_time_ms"]
    b_ms = fixed.summary["analysis"]["typical"]["step_time_ms"]
    assert (step["a"], step["b"], step["status"]) == (a_ms, b_ms, "improved")
    assert step["delta"] == pytest.approx(b_ms - a_ms, abs=1e-3)
    # the planted 20 ms of input wait per step is what went away
    assert -1.4 * DELAY_MS <= step["delta"] <= -0.7 * DELAY_MS
    wait = next(m for m in doc["metrics"] if m["name"] == "input_wait_ms")
    assert wait["status"] == "improved" and wait["delta"] <= -0.7 * DELAY_MS
    assert proc.stdout.splitlines()[2].split() == ["VERDICT", "IMPROVEMENT"]
    assert max(len(line) for line in proc.stdout.splitlines()) <= 80


@pytest.mark.alone
@pytest.mark.torchrun
@pytest.mark.slow
def test_fail_on_regression_exit_code(runs, tmp_path):
    slow, fixed = runs
    proc = _compare(fixed.run_dir, slow.run_dir, tmp_path, 10)
    assert proc.returncode == REGRESSION_EXIT_CODE == 3
    assert "regression beyond 10%: step_time_ms +" in proc.stderr
    doc = json.loads((tmp_path / "compare.json").read_text())
    assert doc["verdict"] == "REGRESSION"
    # a threshold above the regression passes
    step_pct = next(m for m in doc["metrics"] if m["name"] == "step_time_ms")["change_pct"]
    proc = _compare(fixed.run_dir, slow.run_dir, tmp_path, step_pct + 1)
    assert proc.returncode == 0, proc.stderr


def test_unreadable_input_is_a_usage_error(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    proc = run_traceml(["compare", str(bad), str(tmp_path / "none.json")], cwd=tmp_path)
    assert proc.returncode == 2
    assert (
        proc.stderr.strip()
        == f"traceml: error: {bad}: not a TraceML summary (no primary_diagnosis)"
    )


# --- verdict rules on a minimal summary -----------------------------------------------------
def _summary(step_ms=40.0, peak=None, util=None, kind="COMPUTE_BOUND") -> dict:
    parts = {
        "input_wait": 1.0,
        "h2d": None,
        "forward": 10.0,
        "backward": 20.0,
        "optimizer": 2.0,
        "residual": 1.0,
    }
    return {
        "run": {"run_name": "x", "world_size": 2, "missing_ranks": []},
        "primary_diagnosis": {
            "kind": kind,
            "severity": "info",
            "ranks": [0, 1],
            "nodes": [0],
            "evidence": {},
            "impact_ms": None,
        },
        "findings": {"step_time": []},
        "analysis": {
            "clock": {"name": "gpu" if util is not None else "cpu"},
            "window": {"steps": 30},
            "typical": {
                "step_time_ms": step_ms,
                "phase_median_ms": dict(parts),
                "phase_share_pct": dict(parts),
            },
        },
        "ranks": [
            {
                "rank": 0,
                "end": {"state": "completed"},
                "step_time_ms": {"p95": step_ms * 1.1} if step_ms else None,
                "memory": {"peak_allocated_bytes": peak},
            }
        ],
        "nodes": [
            {"system": {"gpus": [{"util_percent_median": util}] if util is not None else []}}
        ],
    }


@pytest.mark.parametrize(
    "b, verdict",
    [
        (_summary(40.0 * (1 + EQUIVALENT_PCT / 200)), "EQUIVALENT"),
        (_summary(30.0), "IMPROVEMENT"),
        (_summary(50.0), "REGRESSION"),
        (_summary(None, kind="INSUFFICIENT_DATA"), "INCONCLUSIVE"),
    ],
)
def test_cpu_only_verdicts(b, verdict):
    assert compare(_summary(), b)["verdict"] == verdict


def test_mixed_when_step_time_improves_but_memory_grows():
    a = _summary(40.0, peak=4 << 30, util=60.0)
    b = _summary(30.0, peak=6 << 30, util=62.0)
    doc = compare(a, b)
    assert doc["verdict"] == "MIXED"
    status = {m["name"]: m["status"] for m in doc["metrics"]}
    assert (status["step_time_ms"], status["peak_allocated_bytes"], status["gpu_util_pct"]) == (
        "improved",
        "regressed",
        "unchanged",
    )
    text = render_compare_text(doc)
    assert "regressed: peak_allocated_bytes" in text
    assert max(len(line) for line in text.splitlines()) <= 80


def test_small_parts_are_judged_against_the_step():
    b = copy.deepcopy(_summary())
    b["analysis"]["typical"]["phase_median_ms"]["input_wait"] = 1.5  # +50 % of itself
    doc = compare(_summary(), b)
    wait = next(m for m in doc["metrics"] if m["name"] == "input_wait_ms")
    assert (wait["delta_pct"], wait["status"]) == (50.0, "unchanged")
    assert doc["verdict"] == "EQUIVALENT"


def _crashed(doc: dict) -> dict:
    doc = copy.deepcopy(doc)
    doc["ranks"][0]["end"] = {"state": "failed"}
    return doc


def test_a_crashed_or_partial_candidate_is_inconclusive_not_an_improvement():
    # faster only because it died early
    fast_crash = _crashed(_summary(10.0))
    assert compare(_summary(), fast_crash)["verdict"] == "INCONCLUSIVE"
    assert "did not complete on ranks [0]" in compare(_summary(), fast_crash)["summary"]
    partial = _summary(10.0)
    partial["run"]["missing_ranks"] = [1]
    assert compare(_summary(), partial)["verdict"] == "INCONCLUSIVE"


def test_an_inconclusive_compare_fails_the_gate(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(dict(_summary(), schema_version=1)))
    b.write_text(json.dumps(dict(_crashed(_summary(10.0)), schema_version=1)))
    proc = _compare(a, b, tmp_path, 10)
    assert proc.returncode == INCONCLUSIVE_EXIT_CODE == 4
    assert proc.stderr.startswith("traceml: error: cannot judge the candidate:")
