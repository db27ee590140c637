"""The SDK's telemetry client against a real aggregator process: bounds, rejection, close, fork.

Every test talks real gRPC to a real ``traceml-aggregator`` (see ``live_aggregator.py``) and
checks what the store holds after it stopped.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from conftest import GRPC_LINE, SCRIPTS, free_port, traceml_env
from helpers.batches import rank_batch
from helpers.waiting import LOADED_CALL_S, wait_for
from live_aggregator import LiveAggregator, finish, make_client, step

from traceml import wire
from traceml.core import transport
from traceml.core.transport import open_channel
from traceml.sdk import client as client_mod

pytestmark = [pytest.mark.aggregator]


def timed_fork() -> float:
    """Fork a child that exits at once; check it exited 0; returns how long fork() took, s."""
    started = time.monotonic()
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    forked_in = time.monotonic() - started
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    return forked_in


@pytest.fixture
def aggregator(tmp_path):
    """A live aggregator of run "mine"."""
    with LiveAggregator(tmp_path / "run", "mine") as agg:
        yield agg


def test_a_nodes_senders_share_its_flush_ticks_and_the_nodes_ticks_are_spread():
    """:func:`~traceml.sdk.client.flush_wait_s`: node 0's ticks are the multiples of the interval
    on the monotonic clock, node n's ``n * NODE_PHASE_STEP`` intervals (its fraction) later; a
    sender on a tick waits a whole interval; 1,000 nodes' ticks are spread evenly (gaps of
    0.45 to 1.19 thousandths of the interval: none shared)."""
    wait = client_mod.flush_wait_s
    assert wait(10.5, 2.0, 0) == pytest.approx(1.5)
    assert wait(10.0, 2.0, 0) == pytest.approx(2.0)
    assert wait(10.5, 2.0, 1) == pytest.approx(0.7360679775)  # its ticks: 1.2360679775 + 2k
    assert wait(10.5, 2.0, 8) == pytest.approx(2.0 - (10.5 - 2 * (8 * 0.6180339887 % 1)) % 2)
    for node in (0, 1, 7, 999):
        for now in (0.0, 3.3, 12345.678):
            due = wait(now, 2.0, node)
            assert 0 < due <= 2.0
            assert wait(now + due, 2.0, node) == pytest.approx(2.0)  # now + due is a tick
    phases = sorted(2.0 - wait(0.0, 2.0, node) for node in range(1000))
    gaps = [b - a for a, b in zip(phases, phases[1:], strict=False)] + [
        2.0 - phases[-1] + phases[0]
    ]
    assert 0.45e-3 * 2.0 <= min(gaps) and max(gaps) <= 1.19e-3 * 2.0


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


@pytest.mark.alone
def test_a_bounded_close_counts_what_it_had_no_time_to_send_in_the_finish_marker(aggregator):
    """3000 records, one per batch, and 1 s to close: past the cutoff (half the time) the rest
    is given up, counted, and the finish marker still arrives; stored + unsent = produced."""
    produced = 3000
    client = make_client(aggregator.target, "mine", [], flush_interval_s=3600, batch_max_records=1)
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


class GatedSends:
    """A real client's sends, each noted (its ``closing``, ``urgent`` and whether it carries
    the finish marker) and let through only while :attr:`gate` is set; :meth:`submit` adds
    steps numbered on from 0."""

    def __init__(self, client) -> None:
        self.client, self.gate, self.submitted = client, threading.Event(), 0
        self.sent: list[tuple[bool, bool, bool]] = []  # (closing, urgent, finish) of each send
        send = client._send

        def noting(batch) -> bool:  # the real send, its batch noted, once the gate is open
            self.sent.append((client._closing, batch.urgent, batch.HasField("finish")))
            assert self.gate.wait(20)
            return send(batch)

        client._send = noting

    def submit(self, count: int) -> None:
        for _ in range(count):
            self.client.submit(client_mod.STEPS, step(self.submitted))
            self.submitted += 1


def test_a_batch_is_urgent_exactly_when_its_sender_waits_on_it(aggregator):
    """``urgent`` (node 0's writer then stores the batch without holding it for others,
    traceml_aggregator/writer.py) is set on each batch of a flush but its last (more follows
    at once: a backlog drains one batch in flight), on every batch while a ``flush()`` caller
    waits (``traceml.summary()``), and on every batch of a close, the finish marker's
    included; never on a flush's last batch that nobody waits on. Batches of 4 records:

    - 4 steps: one batch, nobody waits (not urgent);
    - 4 steps, and 8 more while that batch is being sent: its flush ends with it (not urgent),
      the next one carries the 8 in two (urgent, then not);
    - 3 steps and a ``flush()``: one batch, awaited (urgent);
    - 3 steps and a close: one batch with the finish marker (urgent).
    """
    client = make_client(aggregator.target, "mine", [], flush_interval_s=3600, batch_max_records=4)
    sends = GatedSends(client)
    sends.gate.set()
    sends.submit(4)  # the 4th wakes the sender
    wait_for(lambda: client.stats.acked == 4, timeout_s=20)
    sends.gate.clear()
    sends.submit(4)
    wait_for(lambda: len(sends.sent) == 2, timeout_s=20)
    sends.submit(8)  # while the batch of 4 waits at the gate
    sends.gate.set()
    wait_for(lambda: client.stats.acked == 16, timeout_s=20)
    sends.submit(3)  # fewer than a batch: nothing wakes the sender but the flush() below
    assert client.flush(20) is True
    sends.submit(3)
    assert client.close(finish(sends.submitted), timeout_s=30) is True
    assert sends.sent == [
        (False, False, False),
        (False, False, False),
        (False, True, False),
        (False, False, False),
        (False, True, False),
        (True, True, True),
    ]
    assert aggregator.stop() == 0
    assert aggregator.query("SELECT COUNT(DISTINCT step), COUNT(*) FROM steps") == [(22, 22)]


def test_a_flush_caller_that_gives_up_leaves_another_callers_batches_urgent(aggregator):
    """Two ``flush()`` callers at once (a helper's find): the later one, waiting for more,
    gives up first (its timeout) while the earlier one still waits; the batch that carries the
    earlier one's last records is still ``urgent``. Batches of 4: 4 records in flight, held at
    a gate; 6 more and a caller waiting for all 10; 1 more and a caller waiting 0.1 s for all
    11, which gives up; the gate opens: the 7 go in two batches, the second (records 9-11)
    urgent because the first caller waits for records 9 and 10."""
    client = make_client(aggregator.target, "mine", [], flush_interval_s=3600, batch_max_records=4)
    sends = GatedSends(client)
    sends.submit(4)  # the 4th wakes the sender: the batch waits at the gate
    wait_for(lambda: len(sends.sent) == 1, timeout_s=20)
    sends.submit(6)
    first: list[bool] = []
    waiting = threading.Thread(target=lambda: first.append(client.flush(30)))
    waiting.start()
    wait_for(lambda: client._awaiting == [10], timeout_s=20)
    sends.submit(1)
    assert client.flush(0.1) is False  # gives up: the gate is shut
    sends.gate.set()
    waiting.join(30)
    assert first == [True]
    assert [urgent for _, urgent, _ in sends.sent] == [False, True, True]
    assert client.close(finish(sends.submitted), timeout_s=30) is True
    assert aggregator.stop() == 0
    assert aggregator.query("SELECT COUNT(DISTINCT step), COUNT(*) FROM steps") == [(11, 11)]


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


@pytest.mark.alone
def test_a_buffered_cpu_step_takes_less_than_the_documented_bound():
    """BUFFERED_RECORD_MAX_BYTES (docs/telemetry.md) against tracemalloc: 20,000 steps of the
    real tracer buffered by a client that never sends."""
    import functools
    import tracemalloc

    from traceml.sdk.step import StepTracer

    client = make_client(
        "127.0.0.1:1",
        "mine",
        [],
        flush_interval_s=3600,
        batch_max_records=10**9,
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


def test_flops_beyond_the_stores_integers_cost_the_field_alone(aggregator):
    """200 steps, 5 of them with a FLOPs count in [2**63, 2**64) (the wire carries it, SQLite
    does not): every step is stored, those 5 without FLOPs, the 5 values counted as
    ``value_out_of_range``, and the rank's telemetry goes on to its finish marker (issue 24,
    item 4: the batch was refused as malformed, and the SDK sent no more: 5 of 200 stored)."""
    import json

    beyond = {10, 50, 51, 120, 199}
    warnings: list[str] = []
    client = make_client(aggregator.target, "mine", warnings, batch_max_records=16)
    for i in range(200):
        client.submit(client_mod.STEPS, {**step(i), "flops": (1 << 63) + i if i in beyond else 7})
    assert client.close(finish(200), timeout_s=30) is True
    assert (client.stats.acked, client.stats.dropped, client.stats.batches_refused) == (200, 0, 0)
    assert warnings == []
    assert aggregator.stop() == 0
    assert aggregator.query("SELECT step, flops FROM steps ORDER BY step") == [
        (i, None if i in beyond else 7) for i in range(200)
    ]
    assert aggregator.query("SELECT steps_completed FROM rank_finish") == [(200,)]
    [(rejected,)] = aggregator.query("SELECT value FROM meta WHERE key = 'rejected'")
    assert json.loads(rejected) == {"value_out_of_range": 5}


def test_a_batch_refused_alone_is_dropped_and_counted_not_the_end(aggregator):
    """A batch the store cannot take (here a finish marker of no known end state) is refused
    alone, its Ack naming its own sequence number: the client counts its records as dropped
    and says so once, instead of "sending no more", and the aggregator takes the sender's
    next batch; the steps before it are stored."""
    from traceml.core.endpoint import call as rpc

    warnings: list[str] = []
    client = make_client(aggregator.target, "mine", warnings)
    for i in range(3):
        client.submit(client_mod.STEPS, step(i))
    wait_for(lambda: client.stats.acked == 3)
    client.submit(client_mod.STEPS, step(3))
    assert client.close(wire.RankFinish(steps_completed=4, end_state=77), timeout_s=30) is False
    assert (client.stats.batches_refused, client.stats.dropped_invalid) == (1, 1)
    assert client.stats.steps_dropped == 1
    assert len(warnings) == 1 and "telemetry goes on" in warnings[0], warnings
    refused_seq = client._next_seq - 1
    later = rank_batch(refused_seq + 1, [4], run_name="mine", row=step)
    assert rpc(aggregator.target, "Push", later, 30).stored_seq == refused_seq + 1
    assert aggregator.stop() == 0
    assert aggregator.query("SELECT step FROM steps ORDER BY step") == [(0,), (1,), (2,), (4,)]
    assert aggregator.query("SELECT steps_produced, steps_dropped FROM sender_counts") == [(3, 0)]


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
        (i,) for i in range(600) if i != 100
    ]
    assert aggregator.query("SELECT steps_completed, records_dropped FROM rank_finish") == [
        (600, 1)
    ]
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
        batch = rank_batch(1, [0], run_name="other", row=step)
        ack = stub.Push(batch, timeout=10)
        assert ack.rejected and ack.stored_seq == 0
        assert "'other'" in ack.reason
        batch.run_name = "mine"
        assert stub.Push(batch, timeout=10) == wire.Ack(stored_seq=1)
    assert aggregator.stop() == 0
    assert aggregator.query("SELECT rank, step FROM steps") == [(0, 0)]


@pytest.mark.alone
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


def test_flush_delivers_to_an_aggregator_that_came_up_after_the_first_send(tmp_path):
    """The rank's first step found no aggregator (it started later, as under a slow node 0);
    the rest wait for an hour-long interval. flush() (``traceml.summary()``) must deliver them
    all, not give up because a send before it failed; then, with the aggregator gone, a flush
    gives up as soon as the send it woke fails, not at its deadline."""
    warnings: list[str] = []
    agg = LiveAggregator(tmp_path / "run", "mine")
    client = make_client(
        agg.target, "mine", warnings, flush_interval_s=3600, first_record_at_once=True
    )
    client.submit(client_mod.STEPS, step(0))
    wait_for(lambda: client.stats.send_failures == 1, timeout_s=20)
    with agg:
        for i in range(1, 20):
            client.submit(client_mod.STEPS, step(i))
        assert client.flush(60) is True
        assert client.stats.acked == 20
        assert agg.stop() == 0
    assert agg.query("SELECT COUNT(*), MIN(step), MAX(step) FROM steps") == [(20, 0, 19)]
    assert [w.split(" (")[0] for w in warnings] == [
        f"aggregator at {agg.target} unreachable",
        f"aggregator at {agg.target} reached; telemetry flowing",
    ]


def test_flush_gives_up_once_the_send_it_woke_finds_no_aggregator(tmp_path):
    from conftest import free_port

    client = make_client(f"127.0.0.1:{free_port()}", "mine", [], flush_interval_s=3600)
    client.submit(client_mod.STEPS, step(0))
    started = time.monotonic()
    assert client.flush(60) is False
    assert time.monotonic() - started < 10  # not the 60 s budget
    # The send flush woke, and the first step's own send when it ran before flush() did.
    assert client.stats.send_failures in (1, 2)
    assert client.close(finish(1), timeout_s=5) is False


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
    client = make_client(
        aggregator.target, "mine", warnings, batch_max_records=1, rpc_timeout_s=20.0
    )
    client.submit(client_mod.STEPS, step(0))
    wait_for(lambda: client.stats.acked == 1)
    aggregator.process.send_signal(signal.SIGSTOP)
    try:
        client.submit(client_mod.STEPS, step(1))
        time.sleep(1.0)  # the sender (20 ms interval) is in its Push, waiting on the aggregator
        forked_in = timed_fork()
        assert forked_in < 2.0, forked_in
    finally:
        aggregator.process.send_signal(signal.SIGCONT)
    client.submit(client_mod.STEPS, step(2))
    assert client.close(finish(3), timeout_s=60) is True
    assert client.stats.send_failures >= 1 and client.stats.dropped == 0
    assert aggregator.stop() == 0
    assert aggregator.query("SELECT step FROM steps ORDER BY step") == [(0,), (1,), (2,)]


def test_forks_while_the_client_reconnects_during_an_outage():
    """No aggregator at all: the sender thread makes and closes a channel and a stream for
    every retry (at once: 0.5 ms backoff), including while it has no stream. 200 forks meanwhile:
    every child exits 0, no fork waits longer than FORK_WAIT_MAX_S, and gRPC says nothing on
    stderr (issue 24, item 7: the fork hook quiesced only an existing stream, and a closed
    channel's thread could still be inside gRPC: the old code printed "Other threads are
    currently calling into gRPC, skipping fork() handlers"; and gRPC's own fork handlers, on
    then, hung fork() in about one run in ten: the parent waited inside fork() for gRPC's
    timer thread, which waited for the fork)."""
    result = subprocess.run(
        [sys.executable, str(SCRIPTS / "fork_outage.py"), f"127.0.0.1:{free_port()}", "200"],
        env=traceml_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    fields = result.stdout.split()
    assert fields[:4] == ["forks", "200", "bad", "0"], result.stdout
    assert float(fields[5]) <= client_mod.FORK_WAIT_MAX_S, result.stdout
    assert int(fields[7]) >= 3
    assert [line for line in result.stderr.splitlines() if GRPC_LINE.search(line)] == []


def test_grpc_fork_handlers_are_off_in_a_process_with_the_client():
    """gRPC's own fork() handlers hung fork() during an outage (its prepare handler waits for
    its timer threads, one of which waits for the fork: 12 of 115 runs of fork_outage.py hung,
    the parent inside fork()). Importing the client, as traceml.init() does, before grpc turns
    them off unless the user set GRPC_ENABLE_FORK_SUPPORT. Shown where they speak up
    deterministically: forks while a thread is inside gRPC (a call waiting for an aggregator
    that is not there), which they report with "Other threads are currently calling into
    gRPC, skipping fork() handlers" at every fork (the old code: 5 lines in 5 forks)."""
    env = traceml_env()
    for name in ("GRPC_VERBOSITY", "GRPC_TRACE", "GRPC_ENABLE_FORK_SUPPORT"):
        env.pop(name, None)  # gRPC's defaults, as a user has them
    result = subprocess.run(
        [sys.executable, str(SCRIPTS / "fork_in_grpc_call.py"), f"127.0.0.1:{free_port()}", "5"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["exit", "codes", "0", "0", "0", "0", "0"]
    assert [line for line in result.stderr.splitlines() if GRPC_LINE.search(line)] == []


@pytest.mark.parametrize("users, expected", [(None, "false"), ("1", "1")])
def test_traceml_run_turns_grpc_fork_handlers_off_for_its_ranks(
    tmp_path, monkeypatch, users, expected
):
    """Also for a script that imports grpc before traceml (gRPC reads the variable once, at
    its import); a user's own setting stands."""
    from traceml.core.rundir import RunDir
    from traceml.launcher.config import LaunchConfig
    from traceml.launcher.torchrun import worker_env

    if users is None:
        monkeypatch.delenv(transport.GRPC_FORK_SUPPORT_ENV, raising=False)
    else:
        monkeypatch.setenv(transport.GRPC_FORK_SUPPORT_ENV, users)
    env = worker_env(LaunchConfig(script="train.py"), RunDir(tmp_path / "run", 0))
    assert env[transport.GRPC_FORK_SUPPORT_ENV] == expected


def test_an_error_in_the_fork_hook_leaves_no_lock_held(aggregator, monkeypatch):
    """The hook took the stream's lock, then ending the stream raised: the old hook left the
    lock held for good (Python only prints a before-fork hook's exception), so the sender's
    next push waited on it forever and every later fork waited FORK_WAIT_MAX_S. Now the lock
    is free after the fork, one warning says what happened, and the next batch is acked."""
    from traceml.sdk import stream as stream_mod

    warnings: list[str] = []
    client = make_client(aggregator.target, "mine", warnings)
    client.submit(client_mod.STEPS, step(0))
    wait_for(lambda: client.stats.acked == 1)

    def broken_end(self, wait_s, cancel_by=None):
        raise RuntimeError("injected")

    with monkeypatch.context() as patch:
        patch.setattr(stream_mod._Open, "end", broken_end)
        timed_fork()
    assert (client._grpc_lock.locked(), client._stream._lock.locked()) == (False, False)
    assert warnings == ["telemetry fork hook error (RuntimeError: injected)"]
    client.submit(client_mod.STEPS, step(1))
    wait_for(lambda: client.stats.acked == 2)
    assert client.close(finish(2), timeout_s=30) is True


def test_a_fork_during_a_summary_call_waits_no_longer_than_the_bound(aggregator):
    """A one-off call (``traceml.summary()``'s Summarize) waits on a paused aggregator for its
    deadline. A fork() then cancels it instead of waiting for it (before the fix the fork
    waited behind the call's lock for the whole deadline), and the call is made again after
    the fork: it answers once the aggregator resumes. (One Summarize answered first: the
    aggregator's live analysis, at nice 19, is up before the pause, so the answer after it
    does not wait on a late start; the deadline is long for the same reason.)"""
    import threading

    warnings: list[str] = []
    client = make_client(aggregator.target, "mine", warnings)
    client.submit(client_mod.STEPS, step(0))
    wait_for(lambda: client.stats.acked == 1)
    summarize = wire.SummarizeRequest(run_name="mine")
    assert client.call("Summarize", summarize, LOADED_CALL_S).error == ""
    aggregator.process.send_signal(signal.SIGSTOP)
    replies: list = []
    caller = threading.Thread(
        target=lambda: replies.append(client.call("Summarize", summarize, LOADED_CALL_S))
    )
    try:
        caller.start()
        wait_for(lambda: client._one_off is not None)  # the call is in flight
        forked_in = timed_fork()
        assert forked_in <= client_mod.FORK_WAIT_MAX_S, forked_in
        assert caller.is_alive()  # made again after the fork, waiting on the paused aggregator
    finally:
        aggregator.process.send_signal(signal.SIGCONT)
    caller.join(LOADED_CALL_S)
    assert len(replies) == 1 and isinstance(replies[0], wire.SummarizeReply), replies
    assert client.close(finish(1), timeout_s=30) is True
    assert warnings == []


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
    result = subprocess.run(
        [sys.executable, "-c", NESTED],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    ours = [line for line in result.stderr.splitlines() if line.startswith("traceml:")]
    assert ours == [
        "traceml: trace_step() opened inside an open step; the inner block is "
        "timed as part of the outer step"
    ]
    assert aggregator.stop() == 0
    assert aggregator.query("SELECT step FROM steps ORDER BY step") == [(i,) for i in range(20)]
    assert aggregator.query("SELECT COUNT(*) FROM steps WHERE backward_us IS NULL") == [(0,)]
    assert aggregator.query("SELECT steps_completed, records_dropped FROM rank_finish") == [(20, 0)]
