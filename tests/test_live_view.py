"""`--mode cli`: the verdict so far is shown while training runs, then the final summary."""

from __future__ import annotations

import pytest
from conftest import EXAMPLES, free_port, load_summary, run_traceml

from traceml.launcher.live import render


def test_render_names_the_verdict_and_the_shares():
    lines = render(
        {"step_time_ms": 8.25, "window_steps": 40, "input_wait_pct": 6.0, "forward_pct": 9.4},
        {"verdict": "INPUT_STRAGGLER", "severity": "warning", "ranks": "1"},
        12.0,
    )
    assert lines == [
        "[traceml    12s] INPUT_STRAGGLER (warning) ranks 1",
        "  step 8.2 ms over 40 steps | input 6% fwd 9%",
    ]
    assert render({}, {}, 3.0) == ["[traceml     3s] waiting for step data (no verdict yet)"]


@pytest.mark.slow
def test_cli_mode_shows_the_verdict_while_training(tmp_path):
    result = run_traceml(
        ["run", str(EXAMPLES / "ddp_minimal.py"), "--nproc-per-node=2", "--mode=cli",
         "--run-name=live", "--aggregator-port", str(free_port()), "--", "--steps", "400"],
        tmp_path,
        env={"TRACEML_LIVE_REFRESH_SEC": "0.5"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    live = [line for line in result.stdout.splitlines() if line.startswith("[traceml ")]
    assert live, result.stdout
    assert any("step " in line for line in result.stdout.splitlines() if line.startswith("  step "))
    summary = load_summary(tmp_path / "logs" / "live")
    assert [r["steps_completed"] for r in summary["ranks"]] == [400, 400]
