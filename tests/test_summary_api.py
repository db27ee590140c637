"""`traceml.summary()`: the live verdict as a flat dict, its flush, and its fail-open paths."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from conftest import SCRIPTS, TEST_RUN_TOKEN, free_port
from helpers.aggregator import aggregator_cmd
from planted import HAS_TENSORBOARD


def _python(code_or_args, env: dict, timeout: float = 120) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if not k.startswith("TRACEML_")}
    full.update(env)
    args = ["-c", code_or_args] if isinstance(code_or_args, str) else code_or_args
    return subprocess.run(
        [sys.executable, *args], env=full, capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture
def straggler(planted):
    return planted("input_straggler")


@pytest.mark.torchrun
@pytest.mark.slow
def test_rank0_gets_the_verdict_as_flat_metrics(straggler):
    flat = json.loads(straggler.flat_path.read_text())
    final = straggler.summary
    assert flat["traceml/verdict"] == final["primary_diagnosis"]["kind"] == "INPUT_STRAGGLER"
    assert flat["traceml/severity"] == final["primary_diagnosis"]["severity"]
    assert (flat["traceml/ranks"], flat["traceml/clock"], flat["traceml/run_name"]) == (
        "1",
        "cpu",
        "input_straggler",
    )
    assert flat["traceml/world_size"] == 2 and isinstance(flat["traceml/world_size"], int)
    assert flat["traceml/straggler_gap_ms"] == pytest.approx(
        final["primary_diagnosis"]["evidence"]["gap_ms"], rel=0.2
    )
    assert flat["traceml/step_time_ms"] > 0 and 0 <= flat["traceml/input_wait_pct"] <= 100
    assert "traceml/h2d_ms" not in flat  # not measured on CPU: absent, never 0
    assert all(isinstance(v, (int, float, str)) and v is not None for v in flat.values())


@pytest.mark.torchrun
@pytest.mark.slow
@pytest.mark.skipif(not HAS_TENSORBOARD, reason="tensorboard is not installed")
def test_tensorboard_receives_the_scalars(straggler):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(straggler.tensorboard_dir))
    acc.Reload()
    flat = json.loads(straggler.flat_path.read_text())
    numeric = {k for k, v in flat.items() if not isinstance(v, str)}
    assert set(acc.Tags()["scalars"]) == numeric
    (event,) = acc.Scalars("traceml/step_time_ms")
    assert event.value == pytest.approx(flat["traceml/step_time_ms"], rel=1e-5)


@pytest.mark.aggregator
@pytest.mark.slow
def test_summary_flushes_the_ranks_own_steps_first(tmp_path):
    """A single rank whose sender would hold every step for 60 s: summary() must flush them."""
    port = free_port()
    aggregator = subprocess.Popen(
        aggregator_cmd(tmp_path / "run", "flush", "--port", str(port), "--world-size", "1"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        out = tmp_path / "flat.json"
        proc = _python(
            [
                str(SCRIPTS / "planted_ddp.py"),
                "--scenario",
                "input",
                "--steps",
                "20",
                "--summary-out",
                str(out),
            ],
            {
                "TRACEML_AGGREGATOR": f"127.0.0.1:{port}",
                "TRACEML_RUN_NAME": "flush",
                "TRACEML_RUN_TOKEN": TEST_RUN_TOKEN,  # the aggregator's, from this process
                "TRACEML_FLUSH_INTERVAL_SEC": "60",
                "TRACEML_BATCH_MAX_RECORDS": "10000",
                "RANK": "0",
                "LOCAL_RANK": "0",
                "WORLD_SIZE": "1",
                "LOCAL_WORLD_SIZE": "1",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(free_port()),
            },
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        flat = json.loads(out.read_text())
        # all 20 steps stored, 5 of warm-up left out
        assert flat.get("traceml/window_steps") == 15, (flat, proc.stderr[-2000:])
        assert flat["traceml/verdict"] == "INPUT_BOUND"
    finally:
        aggregator.terminate()
        aggregator.wait(10)


def test_without_session_returns_empty_dict_after_one_warning():
    proc = _python("import traceml; print(traceml.summary(), traceml.summary())", {})
    assert proc.returncode == 0
    assert proc.stdout.strip() == "{} {}"
    warnings = [ln for ln in proc.stderr.splitlines() if "traceml.summary()" in ln]
    assert warnings == [
        "traceml: traceml.summary(): no TraceML session (traceml.init() not called, disabled, "
        "or failed); returning {}"
    ]


@pytest.mark.alone
def test_unreachable_aggregator_returns_empty_dict_fast():
    env = {"TRACEML_AGGREGATOR": f"127.0.0.1:{free_port()}", "TRACEML_RUN_NAME": "x", "RANK": "0"}
    code = (
        "import time, traceml; traceml.init(); t = time.monotonic(); "
        "s = traceml.summary(timeout_s=3); print(s, round(time.monotonic() - t, 1))"
    )
    proc = _python(code, env)
    assert proc.returncode == 0, proc.stderr
    result, elapsed = proc.stdout.split()[0], float(proc.stdout.split()[1])
    assert result == "{}" and elapsed <= 4.0
    assert sum("traceml.summary(): the aggregator at" in ln for ln in proc.stderr.splitlines()) == 1


def test_other_ranks_get_empty_dict_without_asking():
    env = {"TRACEML_AGGREGATOR": f"127.0.0.1:{free_port()}", "TRACEML_RUN_NAME": "x", "RANK": "1"}
    start = time.monotonic()
    proc = _python("import traceml; traceml.init(); print(traceml.summary())", env)
    assert proc.returncode == 0 and proc.stdout.strip() == "{}"
    assert "traceml.summary()" not in proc.stderr
    assert time.monotonic() - start < 60
