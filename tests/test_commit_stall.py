"""A commit stall (a slow shared filesystem) with cancelled calls and resends: the writer
queue's bound holds, and every batch is stored exactly once (issue 25, item 4).

The stall is the writer's test-only hook (``TRACEML_TEST_COMMIT_STALL_FILE``, see
traceml_aggregator/writer.py): every transaction waits while the file exists. Real gRPC
clients, a real aggregator process, a real SQLite store.
"""

from __future__ import annotations

import re
import time

import pytest
from helpers.batches import rank_batch
from live_aggregator import LiveAggregator, finish, step

from traceml.sdk import client as client_mod
from traceml.sdk.client import ClientConfig, TelemetryClient
from traceml_aggregator.writer import COMMIT_STALL_FILE_ENV

pytestmark = [pytest.mark.slow, pytest.mark.aggregator]

SENDERS, STEPS = 6, 50
#: Acknowledgement deadlines, s: under the writer's pushback wait (the call is cancelled, the
#: batch resent on a new stream), and the default one, above it (the sender hears pushback).
SHORT_TIMEOUT_S, LONG_TIMEOUT_S = 1.0, 5.0
_PEAK_LINE = re.compile(r"queue peak (\d+) bytes \(bound (\d+)\)")


def _batch_bytes(rank: int) -> int:
    """Serialized size of the one batch a sender below makes (its STEPS steps)."""
    batch = rank_batch(1, range(STEPS), rank=rank, run_name="stall", row=step)
    c = batch.counts
    c.records_produced = c.steps_produced = STEPS
    return batch.ByteSize()


def _wait(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_a_commit_stall_keeps_the_queue_bound_and_stores_each_batch_once(tmp_path):
    """6 senders, one batch of 50 steps each, while every commit stalls; the bound holds 3
    batches. Ranks 0 and 1 (1 s deadline) queue theirs, cancel the calls and resend on new
    streams: the cancelled calls' batches still count, and the resends of batches still queued
    are pushed back, not queued again. Rank 2 (the default 5 s deadline) queues the third batch
    and hears a retry-after after 2 s, before its deadline: its stream never fails. Ranks 3 to
    5 find the queue full and are pushed back. After the stall each step is stored once, the
    queue's peak stayed within the bound, and at most one resend per sender (the one that finds
    its batch stored) went through the store as a duplicate."""
    stall = tmp_path / "stall"
    stall.touch()
    size = max(_batch_bytes(rank) for rank in range(SENDERS))
    bound = 3 * size + size // 2
    agg = LiveAggregator(
        tmp_path / "run",
        "stall",
        world_size=SENDERS,
        extra_args=("--max-queued-bytes", str(bound)),
        env={COMMIT_STALL_FILE_ENV: str(stall)},
    )
    with agg:
        warnings: dict[int, list[str]] = {rank: [] for rank in range(SENDERS)}

        def sender(rank: int, rpc_timeout_s: float) -> TelemetryClient:
            c = TelemetryClient(
                agg.target,
                "stall",
                rank=rank,
                warn=warnings[rank].append,
                config=ClientConfig(
                    flush_interval_s=0.02,
                    batch_max_records=STEPS,
                    buffer_max_records=65536,
                    rpc_timeout_s=rpc_timeout_s,
                ),
            )
            for i in range(STEPS):
                c.submit(client_mod.STEPS, step(i))
            return c

        cancelling = [sender(rank, SHORT_TIMEOUT_S) for rank in (0, 1)]
        _wait(
            lambda: all(c.stats.send_failures and c.stats.pushed_back for c in cancelling),
            60,
            "cancelled calls, then resends pushed back",
        )
        patient = sender(2, LONG_TIMEOUT_S)
        _wait(lambda: patient.stats.pushed_back, 30, "the retry-after of a queued batch")
        late = [sender(3, SHORT_TIMEOUT_S), sender(4, SHORT_TIMEOUT_S), sender(5, LONG_TIMEOUT_S)]
        _wait(lambda: all(c.stats.pushed_back for c in late), 30, "the full queue's pushback")
        clients = cancelling + [patient] + late
        assert [c.stats.acked for c in clients] == [0] * SENDERS  # nothing committed yet
        stall.unlink()
        _wait(lambda: all(c.stats.acked == STEPS for c in clients), 60, "the acknowledgements")
        assert all(c.close(finish(STEPS), timeout_s=30) for c in clients)
        assert patient.stats.send_failures == 0
        assert warnings[2] == []
        assert agg.stop() == 0
    assert agg.query("SELECT COUNT(*), COUNT(DISTINCT rank || '/' || step) FROM steps") == [
        (SENDERS * STEPS, SENDERS * STEPS)
    ]
    assert agg.query("SELECT COUNT(*) FROM rank_finish") == [(SENDERS,)]
    (counters,) = agg.counters()
    # Each sender's batch of steps and its finish marker, each stored once.
    assert (counters["records"], counters["batches"]) == (SENDERS * STEPS, 2 * SENDERS)
    assert counters["duplicates"] <= SENDERS
    # The last line is the clean stop's (each new peak is logged too, at most every 5 s).
    peak, logged_bound = map(int, _PEAK_LINE.findall(agg.log())[-1])
    assert logged_bound == bound
    assert 2 * size < peak <= bound
