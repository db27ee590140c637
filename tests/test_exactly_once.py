"""Exactly-once storage under forced resends on the sender's stream, over real gRPC to a real
aggregator process.

Three ways a client resends a batch the aggregator may already hold:

1. acknowledgements are withheld: a proxy in front of the real aggregator takes the client's
   ``Stream`` and stores every batch upstream, but answers some with a stale ack, drops the
   stream mid-batch (after the batch was stored), or never answers one (the client's ack
   deadline passes and it cancels the stream);
2. the aggregator goes away mid-stream (SIGTERM or SIGKILL) and comes back on the same port
   and run directory: the client reconnects, opens a new stream and resends what was not
   acknowledged.

In both, the aggregator's own counters (records stored, resent batches found already stored)
must add up to each step stored exactly once. The ``steps`` table alone could not show it: its
primary key would hide a duplicate row.
"""

from __future__ import annotations

import time
from concurrent import futures

import grpc
import pytest
from conftest import free_port
from live_aggregator import LiveAggregator, finish, make_client, step

from traceml import wire
from traceml.core.transport import open_channel
from traceml.sdk import client as client_mod

pytestmark = [pytest.mark.aggregator]


class AckWithholdingProxy(wire.AggregatorServicer):
    """Takes a client's Stream and stores each batch at ``upstream`` (a Push); the first time
    it sees a sequence number in ``stale`` it answers with an acknowledgement one behind, in
    ``lost`` it fails the stream (UNAVAILABLE), in ``silent`` it answers nothing until
    ``silent_s`` passed and then ends the stream — each after the real aggregator stored the
    batch."""

    def __init__(
        self, upstream: str, *, stale: set[int], lost: set[int], silent: set[int], silent_s: float
    ) -> None:
        self._channel = open_channel(upstream)
        self._stub = wire.AggregatorStub(self._channel)
        self._stale, self._lost, self._silent = set(stale), set(lost), set(silent)
        self._silent_s = silent_s
        self.withheld: list[tuple[str, int]] = []
        self.streams = 0

    def Stream(self, request_iterator, context):
        self.streams += 1
        for request in request_iterator:
            ack = self._stub.Push(request, timeout=10)
            if request.seq in self._stale:
                self._stale.discard(request.seq)
                self.withheld.append(("stale", request.seq))
                yield wire.Ack(stored_seq=ack.stored_seq - 1)
            elif request.seq in self._lost:
                self._lost.discard(request.seq)
                self.withheld.append(("lost", request.seq))
                context.abort(grpc.StatusCode.UNAVAILABLE, "stream dropped mid-batch")
            elif request.seq in self._silent:
                self._silent.discard(request.seq)
                self.withheld.append(("silent", request.seq))
                time.sleep(self._silent_s)
                return
            else:
                yield ack


@pytest.fixture
def agg(tmp_path):
    """A live aggregator of run "once" (killed at the end if a test left it running)."""
    with LiveAggregator(tmp_path / "run", "once") as aggregator:
        yield aggregator


def test_withheld_acknowledgements_cause_resends_that_are_not_stored_again(agg):
    proxy = AckWithholdingProxy(agg.target, stale={2, 5}, lost={4}, silent={7}, silent_s=2.0)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    wire.add_AggregatorServicer_to_server(proxy, server)
    proxy_port = free_port()
    server.add_insecure_port(f"127.0.0.1:{proxy_port}")
    server.start()
    try:
        warnings: list[str] = []
        client = make_client(
            f"127.0.0.1:{proxy_port}", "once", warnings, batch_max_records=5, rpc_timeout_s=0.5
        )
        for i in range(40):
            client.submit(client_mod.STEPS, step(i))
        assert client.close(finish(40), timeout_s=60) is True
    finally:
        server.stop(None)
    assert agg.stop() == 0

    assert sorted(proxy.withheld) == [("lost", 4), ("silent", 7), ("stale", 2), ("stale", 5)]
    # One stream, then a new one after the drop at seq 4 and another after the silence at 7.
    assert proxy.streams == 3
    stats = client.stats
    assert (stats.resends, stats.send_failures, stats.acked, stats.dropped) == (4, 2, 40, 0)
    # Every batch was stored once; each of the four resends was found already stored.
    assert agg.counters() == [{"records": 40, "batches": stats.batches_acked, "duplicates": 4}]
    assert agg.query("SELECT COUNT(*), MIN(step), MAX(step) FROM steps") == [(40, 0, 39)]
    assert agg.query("SELECT steps_completed, records_dropped FROM rank_finish") == [(40, 0)]
    assert len(warnings) == 1 and "UNAVAILABLE" in warnings[0]


@pytest.mark.parametrize("stop", ["sigterm", "sigkill"])
def test_client_reconnects_to_a_restarted_aggregator_and_each_step_is_stored_once(agg, stop):
    warnings: list[str] = []
    client = make_client(agg.target, "once", warnings, batch_max_records=5, rpc_timeout_s=2.0)
    total = 300

    def feed(steps: range) -> None:  # the training loop: a step every millisecond or so
        for i in steps:
            client.submit(client_mod.STEPS, step(i))
            time.sleep(0.001)

    feed(range(total // 2))
    deadline = time.monotonic() + 30
    while client.stats.acked < 20:  # some stored; the rest may still be on its way
        assert time.monotonic() < deadline
        time.sleep(0.002)
    assert (agg.stop() if stop == "sigterm" else agg.kill()) in (0, -9)
    feed(range(total // 2, total))  # while nothing listens: sends fail, records wait
    stored_before = agg.query("SELECT COUNT(*) FROM steps")[0][0]
    agg.start()  # same port, same run directory
    assert client.close(finish(total), timeout_s=60) is True
    assert agg.stop() == 0

    stats = client.stats
    assert stats.acked == total and stats.dropped == 0
    assert stats.send_failures >= 1 and stats.resends >= 1
    assert len(warnings) == 1 and "unreachable" in warnings[0]
    assert agg.query("SELECT COUNT(*), MIN(step), MAX(step) FROM steps") == [(total, 0, total - 1)]
    assert agg.query("SELECT steps_completed FROM rank_finish") == [(total,)]
    # What each life of the aggregator stored adds up to each record once.
    counters = agg.counters()
    if stop == "sigterm":
        first, second = counters
        assert first["records"] == stored_before
    else:  # a killed aggregator says nothing; what it committed is what the store held
        (second,) = counters
    assert 20 <= stored_before <= total // 2
    assert second["records"] == total - stored_before
