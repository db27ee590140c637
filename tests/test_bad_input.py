"""Bad input to `traceml run`: one error line, exit code 2, nothing started, nothing left behind."""

from __future__ import annotations

import pytest
from conftest import EXAMPLES, assert_rejected, free_port
from helpers.aggregator import listening_port
from helpers.jobs import assert_rejected_on_a_free_port

pytestmark = [pytest.mark.torchrun]

SCRIPT = str(EXAMPLES / "ddp_minimal.py")


def test_missing_script(tmp_path):
    assert_rejected_on_a_free_port(tmp_path, ["no_such_train.py"], "not found")


@pytest.mark.parametrize("n", ["0", "-1"])
def test_nproc_per_node_below_one(tmp_path, n):
    assert_rejected_on_a_free_port(
        tmp_path,
        [SCRIPT, "--nproc-per-node", n],
        f"--nproc-per-node must be an integer >= 1 (got {n})",
    )


@pytest.mark.parametrize("name", ["a/b", "..", "../escape", "x/..", "/abs", "."])
def test_run_name_that_is_not_one_safe_path_segment(tmp_path, name):
    assert_rejected_on_a_free_port(tmp_path, [SCRIPT, "--run-name", name], f"run name {name!r}")


@pytest.mark.parametrize(
    "reuseport, name, why",
    [(False, "busy-port-run", ""), (True, "reuseport-run", " (already in use)")],
    ids=["plain listener", "SO_REUSEPORT listener"],
)
def test_aggregator_port_already_in_use(tmp_path, reuseport, name, why):
    """Also when the listener has SO_REUSEPORT, as gRPC listens by default: a second server
    would share the port."""
    with listening_port(reuseport=reuseport) as taken:
        port = str(taken)
        assert_rejected(
            tmp_path,
            [SCRIPT, "--aggregator-port", port, "--run-name", name],
            f"aggregator port 127.0.0.1:{port} is not available{why}",
            marker=name,
        )


def test_a_directory_is_not_a_script(tmp_path):
    assert_rejected_on_a_free_port(tmp_path, [str(EXAMPLES)], "is a directory")


def test_an_unknown_option_before_the_script(tmp_path):
    assert_rejected_on_a_free_port(
        tmp_path, ["--nproc_per_node=2", SCRIPT], "unknown option '--nproc_per_node=2'"
    )


def test_an_empty_run_name(tmp_path):
    assert_rejected_on_a_free_port(tmp_path, [SCRIPT, "--run-name", ""], "run name ''")


def test_master_port_equal_to_the_aggregator_port(tmp_path):
    port = str(free_port())
    assert_rejected(
        tmp_path,
        [SCRIPT, "--master-port", port, "--aggregator-port", port],
        f"--master-port and --aggregator-port are both {port}",
        marker=port,
    )
