"""A stall left by an aggregator that died is not kept for ever by its replacement.

A real ``traceml-aggregator`` (hang timeout 1 s) and one rank's real SDK client whose progress
is planted: the rank completes a step, then none, so the aggregator records a stall (its store's
``meta`` and ``aggregator/stall.json``). The aggregator is killed (SIGKILL: no goodbye); the
rank moves on; a new aggregator on the same run directory takes the record over and removes it
once the rank's progress reaches it. Before the fix the record stayed in the store and the file,
and the final summary said the rank hung.
"""

from __future__ import annotations

import json
import time

import pytest
from live_aggregator import LiveAggregator, finish, step

from traceml.sdk import client as client_mod
from traceml.sdk.client import ClientConfig, TelemetryClient

pytestmark = [pytest.mark.slow, pytest.mark.aggregator]


def wait_for(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def test_a_stall_left_by_a_dead_aggregator_is_cleared_when_the_rank_moves(tmp_path):
    run_dir = tmp_path / "run"
    stall_file = run_dir / "aggregator" / "stall.json"
    progress = [(1, "forward")]
    agg = LiveAggregator(run_dir, "r", world_size=1, extra_args=("--hang-timeout-sec", "1"))
    with agg:
        warnings: list[str] = []
        config = ClientConfig(
            flush_interval_s=0.02, rpc_timeout_s=2.0, heartbeat_s=0.2, max_backoff_s=0.5
        )
        rank = TelemetryClient(
            agg.target,
            "r",
            rank=0,
            config=config,
            warn=warnings.append,
            progress=lambda: progress[0],
        )
        rank.submit(client_mod.STEPS, step(0))
        wait_for(stall_file.exists, 60, "the stall record")
        record = json.loads(stall_file.read_text())
        assert [(e["rank"], e["steps_completed"]) for e in record["ranks"]] == [(0, 1)]
        agg.kill()
        progress[0] = (2, "forward")  # the rank moves on while no aggregator runs
        rank.submit(client_mod.STEPS, step(1))
        agg.start()
        wait_for(lambda: not stall_file.exists(), 60, "the stall record to go")
        assert rank.close(finish(2), timeout_s=30) is True
        assert agg.stop() == 0
    assert agg.query("SELECT value FROM meta WHERE key = 'stall'") == []
    assert "the stalled ranks make progress again" in agg.log()
