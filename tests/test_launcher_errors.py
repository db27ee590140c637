"""Bad input to `traceml run`: one line on stderr, exit code 2, nothing started, no run directory.

Also: ``--session-id`` names the run, ``--finalize-timeout-sec`` wins over
``TRACEML_FINALIZE_TIMEOUT_SEC``, and node r > 0 gives up waiting for node 0 after the
configured window with an error naming host:port.
"""

from __future__ import annotations

import json
import time

import pytest
from conftest import SCRIPTS, assert_rejected, free_port, run_traceml
from helpers.jobs import assert_rejected_on_a_free_port, run_args

SCRIPT = str(SCRIPTS / "faulty_ddp.py")

# (flags, text of the one error line). Missing script, --nproc-per-node, unsafe run names and
# a busy port are in test_bad_input.py.
BAD_FLAGS = [
    (["--run-name", "a", "--session-id", "b"], "--run-name 'a' and --session-id 'b' differ"),
    (
        ["--nnodes", "2", "--node-rank", "2", "--run-name", "r"],
        "--node-rank 2 must be in 0..1 for --nnodes 2",
    ),
    (["--nnodes", "2", "--node-rank", "1"], "--run-name is required with --nnodes > 1"),
    (["--nnodes", "2", "--session-id", "../up"], "run name '../up' must be one path segment"),
    (
        ["--run-name", "r", "--logs-dir", "/proc/traceml"],  # no directory can be made there
        "cannot make the run directory /proc/traceml/r (--logs-dir /proc/traceml): No such file "
        "or directory",
    ),
    (
        ["--finalize-timeout-sec", "0"],
        "--finalize-timeout-sec must be a finite number > 0 (got 0.0)",
    ),
    (
        ["--finalize-timeout-sec", "-1"],
        "--finalize-timeout-sec must be a finite number > 0 (got -1.0)",
    ),
    (
        ["--finalize-timeout-sec", "nan"],
        "--finalize-timeout-sec must be a finite number > 0 (got nan)",
    ),
    (
        ["--finalize-timeout-sec", "inf"],
        "--finalize-timeout-sec must be a finite number > 0 (got inf)",
    ),
    (["--finalize-timeout-sec", "soon"], "Invalid value for '--finalize-timeout-sec'"),
    (
        ["--aggregator-max-restarts", "-1"],
        "--aggregator-max-restarts must be an integer >= 0 (got -1)",
    ),
]


@pytest.mark.torchrun
@pytest.mark.parametrize("flags,expected", BAD_FLAGS, ids=[" ".join(f) for f, _ in BAD_FLAGS])
def test_bad_flags_are_one_line_errors(tmp_path, flags, expected):
    port = str(free_port())
    assert_rejected(tmp_path, [SCRIPT, "--aggregator-port", port] + flags, expected, marker=port)


BAD_ENV = [
    ("TRACEML_FINALIZE_TIMEOUT_SEC", "abc", "a finite number > 0"),
    ("TRACEML_FINALIZE_TIMEOUT_SEC", "0", "a finite number > 0"),
    ("TRACEML_FINALIZE_TIMEOUT_SEC", "-5", "a finite number > 0"),
    ("TRACEML_FINALIZE_TIMEOUT_SEC", "nan", "a finite number > 0"),
    ("TRACEML_FINALIZE_TIMEOUT_SEC", "inf", "a finite number > 0"),
    ("TRACEML_AGGREGATOR_WAIT_SEC", "forever", "a finite number > 0"),
    ("TRACEML_AGGREGATOR_START_SEC", "-1", "a finite number > 0"),
    ("TRACEML_AGGREGATOR_MAX_RESTARTS", "many", "an integer >= 0"),
    ("TRACEML_AGGREGATOR_MAX_RESTARTS", "-1", "an integer >= 0"),
]


@pytest.mark.torchrun
@pytest.mark.parametrize("name,value,why", BAD_ENV, ids=[f"{n}={v}" for n, v, _ in BAD_ENV])
def test_bad_environment_values_are_one_line_errors(tmp_path, monkeypatch, name, value, why):
    monkeypatch.setenv(name, value)  # run_traceml passes the test's environment on
    assert_rejected_on_a_free_port(tmp_path, [SCRIPT], f"{name} must be {why} (got {value!r})")


@pytest.mark.slow
@pytest.mark.torchrun
def test_session_id_names_the_run_and_the_flag_wins_over_the_environment(tmp_path, port):
    """``--session-id`` alone is the run name; a bad TRACEML_FINALIZE_TIMEOUT_SEC is not even
    read when the flag is given."""
    args = [
        "run",
        SCRIPT,
        "--steps",
        "3",
        "--session-id",
        "alias-run",
        "--finalize-timeout-sec",
        "7",
        "--aggregator-port",
        str(port),
        "--logs-dir",
        str(tmp_path / "logs"),
    ]
    result = run_traceml(args, tmp_path, env={"TRACEML_FINALIZE_TIMEOUT_SEC": "abc"})
    assert result.returncode == 0, result.stderr
    assert "TRACEML_FINALIZE_TIMEOUT_SEC" not in result.stderr
    run_dir = tmp_path / "logs" / "alias-run"
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["run_name"] == "alias-run"
    assert manifest["launch"]["finalize_timeout_sec"] == 7.0
    summary = json.loads((run_dir / "final_summary.json").read_text())
    assert summary["run"]["run_name"] == "alias-run"
    assert [r["steps_completed"] for r in summary["ranks"]] == [3]


@pytest.mark.slow
@pytest.mark.torchrun
def test_environment_sets_the_budget_when_the_flag_is_absent(tmp_path, port):
    args = run_args(tmp_path, SCRIPT, "env-budget", port, "--steps", "2", nproc=1)
    result = run_traceml(args, tmp_path, env={"TRACEML_FINALIZE_TIMEOUT_SEC": "42.5"})
    assert result.returncode == 0, result.stderr
    manifest = json.loads((tmp_path / "logs" / "env-budget" / "manifest.json").read_text())
    assert manifest["launch"]["finalize_timeout_sec"] == 42.5


@pytest.mark.slow
@pytest.mark.torchrun
def test_node_without_node0_gives_up_after_the_wait_window(tmp_path, port):
    """Node 1 waits TRACEML_AGGREGATOR_WAIT_SEC for node 0's aggregator, then fails with an
    error naming host:port, and never starts training."""
    args = run_args(
        tmp_path,
        SCRIPT,
        "lonely",
        port,
        "--nnodes",
        "2",
        "--node-rank",
        "1",
        "--master-port",
        str(free_port()),
        nproc=1,
    )
    start = time.monotonic()
    result = run_traceml(args, tmp_path, timeout=60, env={"TRACEML_AGGREGATOR_WAIT_SEC": "3"})
    elapsed = time.monotonic() - start
    assert result.returncode == 1, result.stderr
    assert f"waiting up to 3 s for node 0's aggregator at 127.0.0.1:{port}" in result.stderr
    assert f"no TraceML aggregator serving at 127.0.0.1:{port} after 3 s" in result.stderr
    assert 3 <= elapsed < 30
    node_dir = tmp_path / "logs" / "lonely" / "nodes" / "node_1"
    manifest = json.loads((node_dir / "manifest.json").read_text())
    assert manifest["status"] == "aggregator_unreachable"
    assert "aggregator" not in manifest
    assert not (node_dir / "training.stdout.log").exists()
    assert not (tmp_path / "logs" / "lonely" / "manifest.json").exists()
