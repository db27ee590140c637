"""The SDK's telemetry client against a real aggregator process: bounds, rejection, close, fork.

Every test talks real gRPC to a real ``traceml-aggregator`` (see ``live_aggregator.py``) and
checks what the store holds after it stopped.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
from live_aggregator import LiveAggregator, finish, make_client, step

from traceml import wire
from traceml.core.transport import open_channel
from traceml.sdk import client as client_mod
from traceml.wire.records import add_steps


def wait_for(predicate, timeout_s: float = 30.0) -> None:
    """Poll ``predicate`` every 10 ms until true; fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


@pytest.fixture
def aggregator(tmp_path):
    """A live aggregator of run "mine"."""
    with LiveAggregator(tmp_path / "run", "mine") as agg:
        yield agg


def test_full_buffer_drops_are_counted_and_reported_in_the_finish_marker(aggregator):
    warnings: list[str] = []
    # The sender sleeps an hour between wakes: only close() makes it send.
    client = make_client(
        aggregator.target, "mine", warnings, flush_interval_s=3600, buffer_max_records=10
    )
    for i in range(15):
        client.submit(client_mod.STEPS, step(i))
    assert (client.stats.submitted, client.stats.dropped_buffer_full) == (10, 5)

    assert client.close(finish(15), timeout_s=30) is True
    assert client.stats.acked == 10 and client.stats.dropped == 5
    assert aggregator.stop() == 0
    assert aggregator.query("SELECT step FROM steps ORDER BY step") == [(i,) for i in range(10)]
    # One batch carried the 10 records and the finish marker (seq 1).
    assert aggregator.query(
        "SELECT steps_completed, records_dropped, last_seq, end_state FROM rank_finish"
    ) == [(15, 5, 1, "completed")]
    assert warnings == []


def test_every_batch_carries_the_running_counts_and_the_store_keeps_the_latest(aggregator):
    """No finish marker is ever sent (a rank SIGKILLed later): the store still knows what the
    client produced and dropped, from the counts of its last batch."""
    client = make_client(
        aggregator.target, "mine", [], flush_interval_s=3600, buffer_max_records=10
    )
    for i in range(15):
        client.submit(client_mod.STEPS, step(i))
    assert client.flush(30) is True
    client.submit(client_mod.STEPS, step(15))
    assert client.flush(30) is True
    assert aggregator.stop() == 0
    assert aggregator.query("SELECT rank_finish.rank FROM rank_finish") == []
    assert aggregator.query(
        "SELECT seq, records_produced, records_dropped, steps_produced, steps_dropped "
        "FROM sender_counts"
    ) == [(2, 16, 5, 16, 5)]
    assert aggregator.query("SELECT COUNT(*) FROM steps") == [(11,)]


def test_a_bounded_close_counts_what_it_had_no_time_to_send_in_the_finish_marker(aggregator):
    """3000 records, one per batch, and 1 s to close: past the cutoff (half the time) the rest
    is given up, counted, and the finish marker still arrives; stored + unsent = produced."""
    produced = 3000
    client = make_client(
        aggregator.target, "mine", [], flush_interval_s=3600, batch_max_records=1
    )
    for i in range(produced):
        client.submit(client_mod.STEPS, step(i))
    began = time.monotonic()
    assert client.close(finish(produced), timeout_s=1.0) is True
    assert time.monotonic() - began < 1.5
    unsent = client.stats.dropped_unsent
    assert unsent > 0 and client.stats.steps_dropped == unsent
    assert aggregator.stop() == 0
    (stored,) = aggregator.query("SELECT COUNT(*) FROM steps")[0]
    assert stored + unsent == produced
    assert aggregator.query("SELECT steps_completed, records_dropped FROM rank_finish") == [
        (produced, unsent)
    ]
    assert aggregator.query("SELECT steps_produced, steps_dropped FROM sender_counts") == [
        (produced, unsent)
    ]


def test_a_rank_client_sends_its_first_record_at_once_and_the_rest_at_the_interval(aggregator):
    """first_record_at_once (a rank's SDK): the first step goes without waiting for the flush
    interval (an hour here); the second waits for it."""
    client = make_client(
        aggregator.target, "mine", [], flush_interval_s=3600, first_record_at_once=True
    )
    client.submit(client_mod.STEPS, step(0))
    wait_for(lambda: client.stats.acked == 1, timeout_s=20)
    client.submit(client_mod.STEPS, step(1))
    time.sleep(0.5)
    assert (client.stats.acked, client.stats.batches_sent, len(client._buffer)) == (1, 1, 1)
    assert client.close(finish(2), timeout_s=30) is True
    assert aggregator.stop() == 0
    assert aggregator.query("SELECT step FROM steps ORDER BY step") == [(0,), (1,)]


def test_a_buffered_cpu_step_takes_less_than_the_documented_bound():
    """BUFFERED_RECORD_MAX_BYTES (docs/telemetry.md) against tracemalloc: 20,000 steps of the
    real tracer buffered by a client that never sends."""
    import functools
    import tracemalloc

    from traceml.sdk.step import StepTracer

    client = make_client(
        "127.0.0.1:1", "mine", [], flush_interval_s=3600, batch_max_records=10**9,
        buffer_max_records=10**9,
    )
    tracer = StepTracer(functools.partial(client.submit, client_mod.STEPS), time.perf_counter_ns())
    count = 20_000
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        for _ in range(count):
            tracer.begin()
            tracer.forward_ns, tracer.backward_ns, tracer.optimizer_ns = 10**8, 10**7, 10**6
            tracer.end()
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    per_record = sum(d.size_diff for d in after.compare_to(before, "filename")) / count
    assert len(client._buffer) == count
    assert 0 < per_record <= client_mod.BUFFERED_RECORD_MAX_BYTES, per_record
    client.close(timeout_s=0.1)


def test_a_step_the_wire_cannot_carry_is_dropped_alone_and_counted(aggregator):
    """One step with a negative duration (a measurement bug, e.g. a nested step before it was
    refused) in a batch of 512: before the fix the batch's conversion raised after the buffer
    had given up its records, and all 512 were lost, uncounted."""
    warnings: list[str] = []
    client = make_client(aggregator.target, "mine", warnings, flush_interval_s=3600)
    for i in range(600):
        client.submit(client_mod.STEPS, step(i) if i != 100 else {**step(i), "step_us": -5})
    assert client.close(finish(600), timeout_s=30) is True
    assert (client.stats.acked, client.stats.dropped_invalid, client.stats.dropped) == (599, 1, 1)
    assert aggregator.stop() == 0
    assert aggregator.query("SELECT step FROM steps ORDER BY step") == [
        (i,) for i in range(600) if i != 100]
    assert aggregator.query("SELECT steps_completed, records_dropped FROM rank_finish") == [
        (600, 1)]
    assert warnings == []


def test_rejected_run_name_stops_sending_and_nothing_is_stored(aggregator):
    warnings: list[str] = []
    client = make_client(aggregator.target, "theirs", warnings, batch_max_records=1)
    client.submit(client_mod.STEPS, step(0))
    wait_for(lambda: client.stats.batches_sent == 1)
    for i in range(1, 6):
        client.submit(client_mod.STEPS, step(i))
    time.sleep(0.3)  # 15 flush intervals: a client that kept sending would have sent by now

    assert client.stats.batches_sent == 1
    assert client.stats.acked == 0
    started = time.monotonic()
    assert client.close(finish(6), timeout_s=30) is False
    assert time.monotonic() - started < 5
    assert len(warnings) == 1
    assert "rejected" in warnings[0] and "'theirs'" in warnings[0] and "'mine'" in warnings[0]

    assert aggregator.stop() == 0
    for table in ("steps", "ranks", "streams", "rank_finish"):
        assert aggregator.query(f"SELECT COUNT(*) FROM {table}") == [(0,)], table


def test_push_from_another_run_is_answered_rejected(aggregator):
    with open_channel(aggregator.target) as channel:
        stub = wire.AggregatorStub(channel)
        batch = wire.Batch(run_name="other", rank=0, seq=1)
        add_steps(batch, [step(0)])
        ack = stub.Push(batch, timeout=10)
        assert ack.rejected and ack.stored_seq == 0
        assert "'other'" in ack.reason
        batch.run_name = "mine"
        assert stub.Push(batch, timeout=10) == wire.Ack(stored_seq=1)
    assert aggregator.stop() == 0
    assert aggregator.query("SELECT rank, step FROM steps") == [(0, 0)]


def test_close_delivers_everything_once_and_closes_for_good(aggregator):
    warnings: list[str] = []
    client = make_client(aggregator.target, "mine", warnings, batch_max_records=7)
    for i in range(40):
        client.submit(client_mod.STEPS, step(i))
    assert client.close(finish(40), timeout_s=30) is True
    stats = client.stats
    assert (stats.submitted, stats.acked, stats.dropped, stats.send_failures) == (40, 40, 0, 0)
    assert stats.batches_acked == stats.batches_sent

    # Closed for good: a second close answers at once, submit is a no-op.
    started = time.monotonic()
    assert client.close(finish(40), timeout_s=30) is False
    assert time.monotonic() - started < 1
    client.submit(client_mod.STEPS, step(40))
    assert client.stats.submitted == 40
    client._thread.join(5)
    assert not client._thread.is_alive()

    assert aggregator.stop() == 0
    assert aggregator.query("SELECT COUNT(*), MIN(step), MAX(step) FROM steps") == [(40, 0, 39)]
    assert aggregator.query("SELECT steps_completed FROM rank_finish") == [(40,)]
    assert warnings == []


def test_close_gives_up_at_once_when_the_aggregator_was_never_reached(tmp_path):
    from conftest import free_port

    warnings: list[str] = []
    # An hour-long interval: the first send happens in close(), after the step loop.
    client = make_client(f"127.0.0.1:{free_port()}", "mine", warnings, flush_interval_s=3600)
    client.submit(client_mod.STEPS, step(0))
    started = time.monotonic()
    assert client.close(finish(1), timeout_s=60) is False
    assert time.monotonic() - started < 10  # not the 60 s budget
    assert len(warnings) == 1 and "unreachable" in warnings[0]
    assert client.stats.send_failures == 1


def test_close_is_bounded_when_the_aggregator_stops_answering(aggregator):
    warnings: list[str] = []
    client = make_client(aggregator.target, "mine", warnings, rpc_timeout_s=0.5)
    client.submit(client_mod.STEPS, step(0))
    wait_for(lambda: client.stats.acked == 1)
    os.kill(aggregator.process.pid, signal.SIGSTOP)  # alive, connected, silent
    try:
        client.submit(client_mod.STEPS, step(1))
        started = time.monotonic()
        assert client.close(finish(2), timeout_s=2.0) is False
        elapsed = time.monotonic() - started
    finally:
        os.kill(aggregator.process.pid, signal.SIGCONT)
    assert 2.0 <= elapsed < 15
    assert client.stats.send_failures >= 1
    assert len(warnings) == 2 and "DEADLINE_EXCEEDED" in warnings[0]
    # step 1 was never acknowledged: said, with the time waited
    assert warnings[1].startswith("telemetry not delivered at exit: 1 records (no acknowledgement")


def test_a_forked_child_never_sends(aggregator):
    warnings: list[str] = []
    client = make_client(aggregator.target, "mine", warnings, batch_max_records=1)
    client.submit(client_mod.STEPS, step(0))
    wait_for(lambda: client.stats.acked == 1)
    pid = os.fork()
    if pid == 0:  # the child: everything is a no-op, close() does not wait
        ok = client_mod.in_forked_child()
        client.submit(client_mod.STEPS, step(99))
        ok = ok and client.stats.submitted == 1 and client.close(finish(1), 30) is False
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert not client_mod.in_forked_child()
    client.submit(client_mod.STEPS, step(1))
    assert client.close(finish(2), timeout_s=30) is True
    assert aggregator.stop() == 0
    assert aggregator.query("SELECT step FROM steps ORDER BY step") == [(0,), (1,)]


def test_a_fork_during_an_outage_does_not_wait_for_the_rpc_deadline(aggregator):
    """The aggregator is paused (SIGSTOP): a Push waits for its 20 s deadline. A fork() then
    (a DataLoader starting workers) cancels that call instead of waiting for it; before the
    fix it waited for the deadline. Once the aggregator resumes, every step is stored once."""
    warnings: list[str] = []
    client = make_client(aggregator.target, "mine", warnings, batch_max_records=1,
                         rpc_timeout_s=20.0)
    client.submit(client_mod.STEPS, step(0))
    wait_for(lambda: client.stats.acked == 1)
    aggregator.process.send_signal(signal.SIGSTOP)
    try:
        client.submit(client_mod.STEPS, step(1))
        time.sleep(1.0)  # the sender (20 ms interval) is in its Push, waiting on the aggregator
        started = time.monotonic()
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        forked_in = time.monotonic() - started
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert forked_in < 2.0, forked_in
    finally:
        aggregator.process.send_signal(signal.SIGCONT)
    client.submit(client_mod.STEPS, step(2))
    assert client.close(finish(3), timeout_s=60) is True
    assert client.stats.send_failures >= 1 and client.stats.dropped == 0
    assert aggregator.stop() == 0
    assert aggregator.query("SELECT step FROM steps ORDER BY step") == [(0,), (1,), (2,)]


NESTED = """
import torch, traceml
traceml.init()
model = torch.nn.Linear(4, 1)
for _ in range(20):
    with traceml.trace_step(model):
        with traceml.trace_step(model):  # nested by mistake
            model(torch.randn(2, 4)).sum().backward()
"""


def test_a_nested_trace_step_is_part_of_the_outer_step_and_loses_nothing(aggregator, tmp_path):
    """Before the fix the inner step closed first and the outer one then carried a negative
    input wait, which made the sender's conversion raise and lose the whole batch."""
    import subprocess
    import sys

    from conftest import traceml_env

    env = traceml_env({"TRACEML_AGGREGATOR": aggregator.target, "TRACEML_RUN_NAME": "mine"})
    result = subprocess.run([sys.executable, "-c", NESTED], env=env, cwd=tmp_path,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    ours = [line for line in result.stderr.splitlines() if line.startswith("traceml:")]
    assert ours == ["traceml: trace_step() opened inside an open step; the inner block is "
                    "timed as part of the outer step"]
    assert aggregator.stop() == 0
    assert aggregator.query("SELECT step FROM steps ORDER BY step") == [(i,) for i in range(20)]
    assert aggregator.query("SELECT COUNT(*) FROM steps WHERE backward_us IS NULL") == [(0,)]
    assert aggregator.query("SELECT steps_completed, records_dropped FROM rank_finish") == [
        (20, 0)]
