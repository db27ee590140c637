"""Bad input to `traceml run`: one error line, exit code 2, nothing started, nothing left behind."""

from __future__ import annotations

import socket

import psutil
import pytest
from conftest import EXAMPLES, free_port, run_traceml

SCRIPT = str(EXAMPLES / "ddp_minimal.py")


def assert_rejected(tmp_path, args: list[str], expected: str, *, marker: str) -> None:
    """Run ``traceml run ARGS`` in an empty ``tmp_path/cwd`` and check the refusal.

    ``marker`` is a string only this invocation's processes would carry on their command line
    (its run name or port): no process may carry it afterwards.
    """
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    result = run_traceml(["run", *args], cwd, timeout=60)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("traceml: error: ") and expected in lines[0], lines[0]
    assert result.stdout == ""
    assert list(cwd.iterdir()) == []  # no logs dir, no run dir (not even ../<name>)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cwd"]
    started = [
        p.info["pid"]
        for p in psutil.process_iter(["pid", "cmdline"])
        if any(marker in part for part in (p.info["cmdline"] or []))
    ]
    assert started == []


def test_missing_script(tmp_path):
    port = str(free_port())
    assert_rejected(
        tmp_path, ["no_such_train.py", "--aggregator-port", port], "not found", marker=port
    )


@pytest.mark.parametrize("n", ["0", "-1"])
def test_nproc_per_node_below_one(tmp_path, n):
    port = str(free_port())
    assert_rejected(
        tmp_path, [SCRIPT, "--nproc-per-node", n, "--aggregator-port", port],
        "--nproc-per-node must be >= 1", marker=port,
    )


@pytest.mark.parametrize("name", ["a/b", "..", "../escape", "x/..", "/abs", "."])
def test_run_name_that_is_not_one_safe_path_segment(tmp_path, name):
    port = str(free_port())
    assert_rejected(
        tmp_path, [SCRIPT, "--run-name", name, "--aggregator-port", port],
        f"run name {name!r}", marker=port,
    )


def test_aggregator_port_already_in_use(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = str(busy.getsockname()[1])
        assert_rejected(
            tmp_path, [SCRIPT, "--aggregator-port", port, "--run-name", "busy-port-run"],
            f"aggregator port 127.0.0.1:{port} is not available", marker="busy-port-run",
        )
