"""The node relay (traceml/launcher/relay.py) in front of a real aggregator process, over real
gRPC: ranks' clients stream to the relay's abstract Unix socket, the relay carries them to node
0 on one ``Relay`` call.

Exactly once end to end: the relay never acknowledges anything itself, so when its upstream is
dropped mid-batch, goes silent (acknowledgements withheld past the relay's deadline), or the
aggregator is killed and restarted mid-stream, the ranks resend what was not acknowledged and
every step is stored once. The aggregator's own counters (records stored, resent batches found
already stored) must add up to that: the ``steps`` table alone could not show a duplicate (its
primary key would hide it).
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import time
from concurrent import futures

import grpc
import pytest
from conftest import free_port, wait_for
from helpers.aggregator import relay_calls
from live_aggregator import LiveAggregator, finish, make_client, step

from traceml import wire
from traceml.core.transport import MAX_MESSAGE_BYTES, Credentials, open_channel
from traceml.launcher import relay as relay_mod
from traceml.launcher.relay import NodeRelay
from traceml.sdk import client as client_mod
from traceml_aggregator.writer import COMMIT_STALL_FILE_ENV

pytestmark = [pytest.mark.aggregator]

RANKS = 8
#: The relay's deadline for node 0's answer in these tests, s (TRACEML_RPC_TIMEOUT_SEC).
RELAY_TIMEOUT_S = 1.0


@pytest.fixture
def agg(tmp_path):
    """A live aggregator of run "relay" (killed at the end if a test left it running)."""
    with LiveAggregator(tmp_path / "run", "relay") as aggregator:
        yield aggregator


def start_relay(upstream: str) -> NodeRelay:
    relay = NodeRelay(upstream, Credentials.from_env(), RELAY_TIMEOUT_S)
    relay.start()
    return relay


def send_steps(relay: NodeRelay, target: str, steps: int, **config) -> tuple[list, list[str]]:
    """RANKS clients through ``relay``, each submitting ``steps`` steps then closing; returns
    the clients (closed, each asserted delivered) and their warnings."""
    warnings: list[str] = []
    clients = [
        make_client(target, "relay", warnings, rank=r, relay=relay.address, **config)
        for r in range(RANKS)
    ]
    for i in range(steps):
        for client in clients:
            client.submit(client_mod.STEPS, step(i))
    for client in clients:
        assert client.close(finish(steps), timeout_s=60) is True
    return clients, warnings


def steps_by_rank(agg: LiveAggregator) -> list[tuple]:
    return agg.query("SELECT rank, COUNT(*), MIN(step), MAX(step) FROM steps GROUP BY rank")


def assert_each_step_stored_once(
    agg: LiveAggregator, clients: list, steps: int, ranks: int = RANKS
) -> None:
    """Each of ``ranks`` ranks' ``steps`` steps is in the store, and the aggregator's one life
    stored each acknowledged batch once, none found stored already (nothing was resent)."""
    assert steps_by_rank(agg) == [(r, steps, 0, steps - 1) for r in range(ranks)]
    batches = sum(c.stats.batches_acked for c in clients)
    assert agg.counters() == [{"records": ranks * steps, "batches": batches, "duplicates": 0}]


def ledger(agg: LiveAggregator) -> list[dict]:
    (text,) = agg.query("SELECT value FROM meta WHERE key = 'sender_streams'")[0]
    return json.loads(text)


def test_eight_ranks_through_one_relay_call_are_stored_once_and_closed(agg):
    relay = start_relay(agg.target)
    try:
        clients, warnings = send_steps(relay, agg.target, 60, batch_max_records=7)
    finally:
        relay.close()
    assert agg.stop() == 0

    assert warnings == []
    assert_each_step_stored_once(agg, clients, 60)
    assert relay_calls(agg.log()) == 1
    assert relay.stats.upstream_failures == 0
    # Each rank's batches and closing went up as frames of its channel, several in a message.
    assert relay.stats.messages_up < relay.stats.frames_up
    entries = [(e["sender"], e["id"], e["state"], e["finished"], e["streams"]) for e in ledger(agg)]
    assert entries == [("rank", r, "closed", True, 1) for r in range(RANKS)]


def test_a_nodes_senders_flush_on_its_ticks_and_cross_the_relay_together(agg, monkeypatch):
    """Four ranks' clients of one node, each started at its own moment, submitting a step every
    10 ms: once their streams are open, every flush falls on the node's ticks
    (:func:`~traceml.sdk.client.flush_wait_s`, 0.5 s here), and the relay gathers each tick's
    batches into one ``RelayUp``, every one of which then carries the four (each sender
    flushing at its own moment went up a message each). The gather's bound is widened for the
    test (a loaded host may wake a client's thread late), kept below the interval."""
    monkeypatch.setattr(relay_mod, "RELAY_GATHER_S", 0.3)
    ranks, interval_s, steps = 4, 0.5, 300
    relay = start_relay(agg.target)
    warnings: list[str] = []
    clients = []
    try:
        for r in range(ranks):  # started 0.13 s apart: unaligned, each would flush on its own
            clients.append(
                make_client(
                    agg.target,
                    "relay",
                    warnings,
                    rank=r,
                    relay=relay.address,
                    flush_interval_s=interval_s,
                )
            )
            clients[-1].submit(client_mod.STEPS, step(0))
            time.sleep(0.13)
        wait_for(lambda: all(c.stats.batches_acked for c in clients), 30, "every stream open")
        before = (relay.stats.messages_up, relay.stats.frames_up)
        for i in range(1, steps):
            for client in clients:
                client.submit(client_mod.STEPS, step(i))
            time.sleep(0.01)
        messages, frames = (relay.stats.messages_up - before[0], relay.stats.frames_up - before[1])
        for client in clients:
            assert client.close(finish(steps), timeout_s=60) is True
    finally:
        relay.close()
    assert agg.stop() == 0
    assert warnings == []
    assert_each_step_stored_once(agg, clients, steps, ranks)
    assert messages >= 3  # the ~3 s of steps crossed at least 3 ticks
    assert frames == ranks * messages, (messages, frames)


def test_a_rank_whose_relay_is_gone_streams_straight_to_node_0_and_loses_nothing(agg):
    """The relay closes (its socket goes, as with its launcher's death) while a rank streams
    through it: the rank says so once, sends the rest straight to node 0 (its stream's status
    did not come from the relay, which names itself in what it answers), and every step is
    stored once. Node 0's ledger: the relay's channel lost, the rank's own stream closed."""
    relay = start_relay(agg.target)
    warnings: list[str] = []
    client = make_client(agg.target, "relay", warnings, rank=0, relay=relay.address)
    try:
        for i in range(50):
            client.submit(client_mod.STEPS, step(i))
        wait_for(lambda: client.stats.acked == 50, 30, "the first 50 steps through the relay")
    finally:
        relay.close()
    for i in range(50, 100):
        client.submit(client_mod.STEPS, step(i))
    assert client.close(finish(100), timeout_s=60) is True
    assert agg.stop() == 0
    assert warnings == [
        f"the node relay {relay.address} is gone (its launcher exited); telemetry goes "
        f"straight to the aggregator at {agg.target}"
    ]
    assert client.relay == ""
    assert steps_by_rank(agg) == [(0, 100, 0, 99)]
    assert agg.counters()[0]["duplicates"] == 0 and agg.counters()[0]["records"] == 100
    [entry] = ledger(agg)
    assert (entry["sender"], entry["id"], entry["state"], entry["streams"]) == (
        "rank",
        0,
        "closed",
        2,
    )


def test_pending_frames_are_taken_in_order_up_to_the_bound_and_at_least_one(monkeypatch):
    monkeypatch.setattr(relay_mod, "RELAY_UP_MAX_BYTES", 1_000)
    relay = NodeRelay("127.0.0.1:1", Credentials(token="t"), 1.0)  # not started
    frames = [
        wire.RelayFrame(channel=n, batch=wire.Batch(run_name="x" * size))
        for n, size in enumerate((300, 300, 300, 2_000, 100), 1)
    ]
    relay._pending = list(frames)
    sizes = [f.ByteSize() + relay_mod.FRAME_OVERHEAD_BYTES for f in frames]
    assert sum(sizes[:3]) <= 1_000 < sum(sizes[:4])
    assert relay._take_frames() == frames[:3]
    assert relay._take_frames() == frames[3:4]  # alone past the bound: still sent
    assert relay._take_frames() == frames[4:]
    assert relay._pending == []


def test_a_backlog_of_frames_crosses_in_relay_messages_within_the_bound(agg, monkeypatch):
    bound = 1_000  # bytes: two of these small batches a message
    monkeypatch.setattr(relay_mod, "RELAY_UP_MAX_BYTES", bound)
    relay = NodeRelay(agg.target, Credentials.from_env(), 10.0)
    relay.start()
    warnings: list[str] = []
    clients = [
        make_client(agg.target, "relay", warnings, rank=r, relay=relay.address, rpc_timeout_s=10)
        for r in range(RANKS)
    ]
    try:
        os.kill(agg.process.pid, signal.SIGSTOP)  # node 0 answers nothing: frames pile up
        try:
            for i in range(30):
                for client in clients:
                    client.submit(client_mod.STEPS, step(i))
            # The first message took what fits the bound; the other ranks' batches wait.
            wait_for(lambda: len(relay._pending) >= RANKS // 2, 10, "a backlog at the relay")
        finally:
            os.kill(agg.process.pid, signal.SIGCONT)
        for client in clients:
            assert client.close(finish(30), timeout_s=60) is True
    finally:
        relay.close()
    assert agg.stop() == 0

    assert warnings == []
    assert_each_step_stored_once(agg, clients, 30)
    # A batch here is ~0.5 KB: a message holds at most the bound plus one frame.
    assert relay.stats.largest_up_bytes <= bound + 600
    assert relay.stats.upstream_failures == 0


def test_a_rank_that_vanishes_behind_the_relay_is_lost_and_one_that_closed_is_closed(agg):
    relay = start_relay(agg.target)
    try:
        for rank, clean in ((0, True), (1, False)):
            with open_channel(relay.address, credentials=Credentials.from_env()) as channel:
                requests: queue.SimpleQueue = queue.SimpleQueue()
                call = wire.AggregatorStub(channel).Stream(iter(requests.get, None))
                batch = wire.Batch(run_name="relay", rank=rank, seq=1)
                batch.step_groups.add()  # an empty group: a batch that carries nothing
                requests.put(batch)
                assert next(call).stored_seq == 1
                if clean:
                    requests.put(wire.Batch(closing=True))
                    requests.put(None)
                    assert list(call) == []
                else:
                    call.cancel()
    finally:
        relay.close()
    assert agg.stop() == 0
    assert [(e["id"], e["state"]) for e in ledger(agg)] == [(0, "closed"), (1, "lost")]


def test_a_clean_end_is_taken_at_once_though_another_channel_waits_on_a_stalled_writer(tmp_path):
    """One ``RelayUp`` carries rank 0's next batch and rank 1's ``closing`` and ``ended`` while
    every commit stalls; the relay's call is then cancelled (its deadline, or its close). Rank 1
    had nothing queued: its clean end is in the ledger (``closed``), not lost behind rank 0's
    batch; rank 0's stream, cancelled unclosed, is ``lost``, and its queued batch is still
    stored once the stall ends."""
    stall = tmp_path / "stall"

    def batch(rank: int, seq: int) -> wire.Batch:
        b = wire.Batch(run_name="relay", rank=rank, seq=seq)
        b.step_groups.add()  # an empty group: a batch that carries nothing
        return b

    def up(*frames: wire.RelayFrame) -> wire.RelayUp:
        return wire.RelayUp(frames=list(frames))

    with LiveAggregator(tmp_path / "run", "relay", env={COMMIT_STALL_FILE_ENV: str(stall)}) as agg:
        with open_channel(agg.target, credentials=Credentials.from_env()) as channel:
            stub = wire.AggregatorStub(channel)
            requests: queue.SimpleQueue = queue.SimpleQueue()
            call = stub.Relay(iter(requests.get, None))
            requests.put(up(*(wire.RelayFrame(channel=r + 1, batch=batch(r, 1)) for r in (0, 1))))
            down = next(call)
            assert [(a.channel, a.ack.stored_seq) for a in down.acks] == [(1, 1), (2, 1)]
            stall.touch()
            requests.put(
                up(
                    wire.RelayFrame(channel=1, batch=batch(0, 2)),
                    wire.RelayFrame(channel=2, batch=wire.Batch(closing=True)),
                    wire.RelayFrame(channel=2, ended=True),
                )
            )

            def queued() -> bool:  # a copy of rank 0's batch 2 waits: the RelayUp was read
                try:
                    stub.Push(batch(0, 2), timeout=10)
                except grpc.RpcError as exc:
                    return "a copy of this batch waits" in (exc.details() or "")
                return False

            wait_for(queued, 30, "rank 0's batch queued behind the stall")
            call.cancel()
        stall.unlink()
        assert agg.stop() == 0
        assert [(e["id"], e["state"]) for e in ledger(agg)] == [(0, "lost"), (1, "closed")]
        assert steps_by_rank(agg) == []  # empty groups: no step rows
        assert agg.query("SELECT sender_id, stored_seq FROM streams ORDER BY sender_id") == [
            (0, 2),
            (1, 1),
        ]


def test_an_unreadable_or_oversized_message_ends_its_own_stream_and_no_other(agg):
    relay = start_relay(agg.target)
    warnings: list[str] = []
    rank = make_client(agg.target, "relay", warnings, rank=0, relay=relay.address)
    try:
        with open_channel(relay.address, credentials=Credentials.from_env()) as channel:
            raw = channel.stream_stream("/traceml.wire.v1.Aggregator/Stream")  # bytes as they are
            garbage = raw(iter([b"\xff\xfe\x00garbage" * 100]), timeout=10)
            with pytest.raises(grpc.RpcError) as unreadable:
                next(garbage)
            big = wire.Batch(run_name="relay", rank=1, seq=1, identity=wire.RankIdentity())
            big.identity.hostname = "x" * (MAX_MESSAGE_BYTES - 30)
            data = big.SerializeToString()
            # Within the wire's bound alone, past it as a RelayUp's frame.
            assert MAX_MESSAGE_BYTES - 16 < len(data) <= MAX_MESSAGE_BYTES
            too_big = raw(iter([data]), timeout=10)
            with pytest.raises(grpc.RpcError) as oversized:
                next(too_big)
        for i in range(20):  # the real rank's stream goes on through the relay meanwhile
            rank.submit(client_mod.STEPS, step(i))
        assert rank.close(finish(20), timeout_s=30) is True
    finally:
        relay.close()
    assert agg.stop() == 0
    assert unreadable.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "unreadable message" in unreadable.value.details()
    assert oversized.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert relay.stats.upstream_failures == 0 and warnings == []
    assert steps_by_rank(agg) == [(0, 20, 0, 19)]


def test_a_call_without_the_run_token_is_refused_by_the_relay(agg):
    relay = start_relay(agg.target)
    try:
        with open_channel(relay.address, credentials=Credentials(token="not-the-token")) as ch:
            call = wire.AggregatorStub(ch).Stream(iter([wire.Batch(run_name="relay", seq=1)]))
            with pytest.raises(grpc.RpcError) as refused:
                next(call)
    finally:
        relay.close()
    assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED
    assert agg.stop() == 0
    assert agg.counters() == [{"records": 0, "batches": 0, "duplicates": 0}]


class MisbehavingUpstream(wire.AggregatorServicer):
    """Node 0 as the relay sees it, misbehaving: passes each RelayUp to the real aggregator's
    ``Relay`` and, after the aggregator stored it, fails the call (``drop``: the message
    numbers, counted over all calls) or answers nothing for ``silent_s`` (``silent``)."""

    def __init__(self, upstream: str, *, drop: set[int], silent: set[int], silent_s: float):
        self._channel = open_channel(upstream)
        self._stub = wire.AggregatorStub(self._channel)
        self._drop, self._silent, self._silent_s = drop, silent, silent_s
        self.messages = 0
        self.calls = 0
        self.misbehaved: list[tuple[str, int]] = []

    def Relay(self, request_iterator, context):
        self.calls += 1
        ups: queue.SimpleQueue = queue.SimpleQueue()
        downs = self._stub.Relay(iter(ups.get, None))
        try:
            for up in request_iterator:
                ups.put(up)
                down = next(downs)  # the aggregator stored every batch in it
                self.messages += 1
                if self.messages in self._drop:
                    self.misbehaved.append(("drop", self.messages))
                    context.abort(grpc.StatusCode.UNAVAILABLE, "the upstream dropped mid-batch")
                if self.messages in self._silent:
                    self.misbehaved.append(("silent", self.messages))
                    time.sleep(self._silent_s)
                    return
                yield down
        finally:
            ups.put(None)
            downs.cancel()


def test_an_upstream_dropped_mid_batch_or_silent_costs_resends_that_are_not_stored_again(agg):
    upstream = MisbehavingUpstream(
        agg.target, drop={3, 9}, silent={6}, silent_s=RELAY_TIMEOUT_S + 1.0
    )
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    wire.add_AggregatorServicer_to_server(upstream, server)
    port = free_port()
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    relay = start_relay(f"127.0.0.1:{port}")
    try:
        clients, warnings = send_steps(
            relay, agg.target, 40, batch_max_records=5, rpc_timeout_s=RELAY_TIMEOUT_S + 3.0
        )
    finally:
        relay.close()
        server.stop(None)
    assert agg.stop() == 0

    assert upstream.misbehaved == [("drop", 3), ("silent", 6), ("drop", 9)]
    assert upstream.calls == 4 and relay.stats.upstream_failures == 3
    assert steps_by_rank(agg) == [(r, 40, 0, 39) for r in range(RANKS)]
    resends = sum(c.stats.resends for c in clients)
    assert resends >= 1
    (counters,) = agg.counters()
    # Every record once; each resend of a batch the aggregator had stored was found stored.
    assert counters["records"] == RANKS * 40
    assert counters["batches"] == sum(c.stats.batches_acked for c in clients)
    assert 1 <= counters["duplicates"] <= resends
    # The ranks' client says it once per process until node 0 is reached again (the relay said
    # why, on the launcher's stderr). These 8 clients share this process: one not acked yet
    # when an outage began says "reached" once it is, and a later outage is said again; so
    # the process's messages alternate, never the same one twice in a row.
    said = [
        "down" if "unreachable (UNAVAILABLE)" in w else "up" if "telemetry flowing" in w else w
        for w in warnings
    ]
    assert said and said == ["down", "up"] * (len(said) // 2) + ["down"] * (len(said) % 2)


@pytest.mark.parametrize("stop", ["sigterm", "sigkill"])
def test_an_aggregator_restarted_mid_stream_behind_the_relay_stores_each_step_once(agg, stop):
    relay = start_relay(agg.target)
    warnings: list[str] = []
    clients = [
        make_client(agg.target, "relay", warnings, rank=r, relay=relay.address, rpc_timeout_s=2.0)
        for r in range(RANKS)
    ]
    total = 200

    def feed(steps: range) -> None:  # the training loops: a step every millisecond or so
        for i in steps:
            for client in clients:
                client.submit(client_mod.STEPS, step(i))
            time.sleep(0.001)

    try:
        feed(range(total // 2))
        deadline = time.monotonic() + 30
        while min(c.stats.acked for c in clients) < 20:  # some stored; the rest on its way
            assert time.monotonic() < deadline
            time.sleep(0.005)
        assert (agg.stop() if stop == "sigterm" else agg.kill()) in (0, -9)
        feed(range(total // 2, total))  # node 0 is gone: the relay fails, records wait
        stored_before = agg.query("SELECT COUNT(*) FROM steps")[0][0]
        agg.start()  # same port, same run directory
        for client in clients:
            assert client.close(finish(total), timeout_s=60) is True
    finally:
        relay.close()
    assert agg.stop() == 0

    assert steps_by_rank(agg) == [(r, total, 0, total - 1) for r in range(RANKS)]
    assert all(c.stats.acked == total and c.stats.dropped == 0 for c in clients)
    assert relay.stats.upstream_failures >= 1
    counters = agg.counters()
    second = counters[-1]
    if stop == "sigterm":
        assert counters[0]["records"] == stored_before
    assert RANKS * 20 <= stored_before <= RANKS * total // 2
    assert second["records"] == RANKS * total - stored_before


class Stepping:
    """A rank's ``client`` that submits its next step each time :meth:`until` is polled."""

    def __init__(self, client, pause_s: float) -> None:
        self.client, self.pause_s, self.steps = client, pause_s, 0

    def until(self, done) -> bool:
        """Submit the next step, pause ``pause_s``, then ``done()``: a :func:`wait_for`
        condition that steps the rank while it waits."""
        self.client.submit(client_mod.STEPS, step(self.steps))
        self.steps += 1
        time.sleep(self.pause_s)
        return done()


@contextlib.contextmanager
def node_1_through_its_relay(agg, warnings: list[str], flush_interval_s: float, pause_s: float):
    """Node 1's session and relay (carrying the session's heartbeats) in this process, against
    ``agg``, and rank 1's client streaming through the relay (its warnings to ``warnings``):
    yields ``(session, relay, Stepping)``; the relay and the session are closed after."""
    from test_launcher_news import claim

    from traceml.launcher.session import NodeSession

    session = NodeSession(agg.target, claim(1)).start()
    relay = NodeRelay(agg.target, Credentials.from_env(), 60.0)
    relay.start()
    relay.carry_heartbeats(session, 1)
    client = make_client(
        agg.target, "r", warnings, rank=1, relay=relay.address, flush_interval_s=flush_interval_s
    )
    try:
        yield session, relay, Stepping(client, pause_s)
    finally:
        relay.close()
        session.close()


@pytest.mark.slow
def test_the_relay_carries_the_sessions_heartbeats_and_the_session_sends_its_own_without_it(
    tmp_path,
):
    """Node 1's session and relay in this process, against a real aggregator: once node 0
    answers the heartbeats the relay carries, they ride the ``RelayUp``s and the session's own
    stream falls silent, the clock exchange still measured through them. While every commit
    stalls, node 0 still hears the node (its ``RelayUp``s are read, and pushed back after 2 s):
    with nodes lost after 3 s of silence, a 5 s stall loses none. Once the relay is gone, the
    session sends its own heartbeats again."""
    stall = tmp_path / "stall"
    env = {COMMIT_STALL_FILE_ENV: str(stall), "TRACEML_NODE_LOST_AFTER_SEC": "3"}
    args = ("--nnodes", "2")
    with LiveAggregator(tmp_path / "run", "r", world_size=2, extra_args=args, env=env) as agg:
        warnings: list[str] = []
        # a RelayUp every 20 ms or so
        with node_1_through_its_relay(agg, warnings, 0.02, 0.02) as (session, relay, rank):
            try:
                assert session.wait_claim(30).accepted
                answered = relay.stats
                wait_for(lambda: rank.until(lambda: answered.heartbeats_answered >= 2), 30, "2")
                own = session.heartbeats_sent
                wait_for(lambda: rank.until(lambda: answered.heartbeats_answered >= 5), 30, "3")
                # 3 more heartbeats through the relay, >= 1.5 s apart: the session's stream,
                # which would have sent 2 or more in that time, sent none (one, at most, if a
                # RelayUp took over 0.5 s on a loaded machine and its own came due first)
                assert session.heartbeats_sent - own <= 1
                assert session.clock.best() is not None
                stall.touch()
                stalled = time.monotonic()
                wait_for(lambda: rank.until(lambda: time.monotonic() - stalled > 5), 30, "stall")
                stall.unlink()
                assert "lost: nothing" not in agg.log()
                assert rank.client.close(finish(rank.steps), timeout_s=60) is True
                relay.close()
                wait_for(lambda: session.heartbeats_sent >= own + 2, 30, "its own heartbeats")
            finally:
                stall.unlink(missing_ok=True)
        assert "lost: nothing" not in agg.log()
    assert agg.query("SELECT COUNT(*) FROM steps") == [(rank.steps,)]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("budget", "interval_s", "heartbeats"),
    [(None, 2.0, 5), ("0.25", 4.0, 3)],
    ids=["default", "paced"],
)
def test_at_the_nodes_flush_the_relay_carries_every_heartbeat_and_the_session_sends_none(
    tmp_path, budget, interval_s, heartbeats
):
    """Node 1's session and relay, a rank's client flushing every 2 s (the default, as the
    heartbeat interval): once node 0 answered a heartbeat the relay carried, the next ones
    ride the relay's ``RelayUp``s and the session's own stream sends none. (Its own, due 2 s
    after the last as the relay's was, raced the node's flush tick and, once ahead, kept the
    relay from carrying any.) Paced: node 0's budget of 0.25 messages a second makes its one
    ``Relay`` call too many at one a second, so its Acks ask for a flush every 4 s
    (traceml_aggregator/pace.py); the rank flushes so, the session's heartbeats come so, and
    each ``RelayUp`` (one every 4 s, not 2) still carries one."""
    env = {} if budget is None else {"TRACEML_AGGREGATOR_MESSAGES_PER_SEC": budget}
    args = ("--nnodes", "2")
    with LiveAggregator(tmp_path / "run", "r", world_size=2, extra_args=args, env=env) as agg:
        warnings: list[str] = []
        with node_1_through_its_relay(agg, warnings, 2.0, 0.05) as (session, relay, rank):
            assert session.wait_claim(30).accepted
            answered = relay.stats
            wait_for(lambda: rank.until(lambda: answered.heartbeats_answered >= 2), 30, "two")
            assert rank.client.flush_interval_s == session.heartbeat_interval_s == interval_s
            own, carried = session.heartbeats_sent, answered.heartbeats_answered
            sent = answered.messages_up
            wait_for(
                lambda: rank.until(lambda: answered.heartbeats_answered >= carried + heartbeats),
                30,
                f"{heartbeats} heartbeats",
            )
            assert session.heartbeats_sent == own
            assert answered.messages_up - sent == heartbeats  # each RelayUp carried one
            assert rank.client.close(finish(rank.steps), timeout_s=60) is True
    assert warnings == []
    assert agg.query("SELECT COUNT(*) FROM steps") == [(rank.steps,)]


def test_a_lost_node_heard_again_through_its_relay_or_its_kept_session_is_back(tmp_path):
    """Node 1's session stream stays open but silent (as a stalled launcher leaves it): node 0
    marks the node lost after 2 s. A heartbeat its relay carries
    then brings it back; silent again, it is lost again, and a heartbeat on the session it
    kept brings it back: two loss records, each with the time it resumed."""
    from test_launcher_news import claim

    from traceml_aggregator.store import NODE_LOSSES_META_KEY

    env = {"TRACEML_NODE_LOST_AFTER_SEC": "2"}
    args = ("--nnodes", "2")
    with LiveAggregator(tmp_path / "run", "r", world_size=2, extra_args=args, env=env) as agg:
        stub = wire.AggregatorStub(open_channel(agg.target))
        ups: queue.Queue = queue.Queue()
        session = stub.NodeSession(iter(ups.get, None))
        ups.put(wire.NodeUp(claim=claim(1)))
        assert next(session).claim.accepted
        try:
            wait_for(lambda: agg.log().count("node 1 (node1) lost") == 1, 30, "node 1 lost")
            beat = wire.NodeHeartbeat(sent_unix_ns=time.time_ns())
            (down,) = list(stub.Relay(iter([wire.RelayUp(node_rank=1, heartbeat=beat)])))
            assert down.clock.sent_unix_ns == beat.sent_unix_ns  # answered: the node heard
            back = "node 1 (node1) is back: a heartbeat came through its node relay"
            wait_for(lambda: back in agg.log(), 30, "node 1 back through its relay")
            wait_for(lambda: agg.log().count("node 1 (node1) lost") == 2, 30, "lost again")
            ups.put(wire.NodeUp(heartbeat=wire.NodeHeartbeat(sent_unix_ns=time.time_ns())))
            assert next(session).WhichOneof("kind") == "clock"
            back = "node 1 (node1) is back: its session spoke again"
            wait_for(lambda: back in agg.log(), 30, "node 1 back on its session")
            ups.put(wire.NodeUp(goodbye=wire.NodeGoodbye()))
        finally:
            ups.put(None)
        assert agg.stop() == 0
    (text,) = agg.query("SELECT value FROM meta WHERE key = ?", (NODE_LOSSES_META_KEY,))[0]
    losses = json.loads(text)
    assert [(loss["node_rank"], loss["lost_after_s"]) for loss in losses] == [(1, 2.0), (1, 2.0)]
    for loss in losses:
        assert loss["last_heard_unix_s"] < loss["lost_unix_s"] < loss["resumed_unix_s"]
    assert losses[0]["resumed_unix_s"] < losses[1]["lost_unix_s"]
