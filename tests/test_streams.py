"""Per-sender stream liveness and wire versioning, over real gRPC to real aggregators.

Liveness (docs/wire.md, *Streams*): a rank that closes its client after its finish marker
ends its stream ``closed`` and ``finished``; one whose process is SIGKILLed mid-stream ends
``lost`` at once (its kernel resets the connection), and the summary keeps them apart.

Versioning: every call names its wire version; a client and an aggregator of two versions fail
with one line that names both, either way round.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest
from conftest import TEST_RUN_TOKEN, free_port, load_summary
from live_aggregator import LiveAggregator, finish, make_client, step

from traceml import wire
from traceml.core import endpoint
from traceml.core.transport import (
    TOKEN_METADATA_KEY,
    VERSION_METADATA_KEY,
    WIRE_VERSION,
    version_mismatch,
)
from traceml.sdk import client as client_mod
from traceml_aggregator.auth import TokenInterceptor
from traceml_aggregator.senders import Rejections

pytestmark = [pytest.mark.aggregator]

#: Rank 1's process: streams steps, says so once one is acknowledged, then waits to be killed.
VANISHING_RANK = """
import sys, time
from traceml.sdk.client import ClientConfig, TelemetryClient
client = TelemetryClient(sys.argv[1], "live", rank=1,
                         config=ClientConfig(flush_interval_s=0.02, rpc_timeout_s=5.0))
client.submit("step_groups", {"step": 0, "end_us": 1000, "step_us": 1000})
while client.stats.acked < 1:
    time.sleep(0.01)
print("acked", flush=True)
time.sleep(600)
"""


def test_a_rank_that_exits_cleanly_and_one_that_vanished_are_told_apart(tmp_path):
    with LiveAggregator(tmp_path / "run", "live", world_size=2) as agg:
        warnings: list[str] = []
        clean = make_client(agg.target, "live", warnings)
        for i in range(5):
            clean.submit(client_mod.STEPS, step(i))
        vanishing = subprocess.Popen(
            [sys.executable, "-c", VANISHING_RANK, agg.target], stdout=subprocess.PIPE, text=True
        )
        try:
            assert vanishing.stdout.readline().strip() == "acked"
            killed_at = time.time()
            vanishing.send_signal(signal.SIGKILL)
            vanishing.wait(30)
        finally:
            vanishing.kill()
        assert clean.close(finish(5), timeout_s=30) is True
        assert agg.stop() == 0
    assert warnings == []
    (meta,) = agg.query("SELECT value FROM meta WHERE key = 'sender_streams'")[0]
    streams = {s["id"]: s for s in json.loads(meta)}
    assert {
        k: (s["sender"], s["state"], s["finished"], s["streams"]) for k, s in streams.items()
    } == {0: ("rank", "closed", True, 1), 1: ("rank", "lost", False, 1)}
    # Known lost at once: the kernel reset the dead process's connection.
    assert killed_at <= streams[1]["since_unix_s"] <= killed_at + 5.0
    summary = load_summary(agg.run_dir)
    assert [
        (s["id"], s["state"], s["finished"])
        for s in summary["run"]["telemetry_health"]["sender_streams"]
    ] == [(0, "closed", True), (1, "lost", False)]


@pytest.mark.parametrize("method", ["Stream", "Summarize"])
def test_a_client_of_another_wire_version_is_refused_with_one_line_naming_both(tmp_path, method):
    with LiveAggregator(tmp_path / "run", "v", world_size=1) as agg:
        metadata = ((VERSION_METADATA_KEY, "2"), (TOKEN_METADATA_KEY, TEST_RUN_TOKEN))
        with grpc.insecure_channel(agg.target) as channel:
            stub = wire.AggregatorStub(channel)
            with pytest.raises(grpc.RpcError) as refused:
                if method == "Stream":
                    batch = wire.Batch(run_name="v", rank=0, seq=1)
                    list(stub.Stream(iter([batch]), metadata=metadata, timeout=10))
                else:
                    stub.Summarize(
                        wire.SummarizeRequest(run_name="v"), metadata=metadata, timeout=10
                    )
        assert agg.stop() == 0
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert refused.value.details() == (
        "wire version mismatch: this client speaks traceml wire v2, the aggregator speaks v1; "
        "use one TraceML version on every node"
    )
    assert agg.query("SELECT COUNT(*) FROM steps") == [(0,)]
    assert json.loads(agg.query("SELECT value FROM meta WHERE key = 'rejected'")[0][0]) == {
        "wire_version": 1
    }


class _OtherVersionAggregator:
    """An aggregator of wire v2 in a thread: the gate of this tree's aggregator serving version
    2 (every version keeps that check), in front of a service that implements nothing."""

    def __init__(self) -> None:
        self.port = free_port()
        self._ready, self._stop = threading.Event(), None
        self._thread = threading.Thread(target=asyncio.run, args=(self._serve(),), daemon=True)

    async def _serve(self) -> None:
        server = grpc.aio.server(
            interceptors=[TokenInterceptor(TEST_RUN_TOKEN, Rejections(), wire_version=2)]
        )
        wire.add_AggregatorServicer_to_server(wire.AggregatorServicer(), server)
        server.add_insecure_port(f"127.0.0.1:{self.port}")
        await server.start()
        self._stop = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        self._ready.set()
        await self._stop.wait()
        await server.stop(None)

    def __enter__(self):
        self._thread.start()
        assert self._ready.wait(30)
        return self

    def __exit__(self, *exc) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)


def test_this_client_at_an_aggregator_of_another_version_stops_with_one_line():
    expected = version_mismatch(str(WIRE_VERSION), 2)
    assert "v1" in expected and "v2" in expected
    with _OtherVersionAggregator() as other:
        target = f"127.0.0.1:{other.port}"
        warnings: list[str] = []
        client = make_client(target, "v", warnings)
        client.submit(client_mod.STEPS, step(0))
        started = time.monotonic()
        assert client.close(finish(1), timeout_s=30) is False
        assert time.monotonic() - started < 5.0  # refused for good, not retried until timeout
        with pytest.raises(grpc.RpcError) as refused:
            endpoint.call(target, "Summarize", wire.SummarizeRequest(run_name="v"), 10.0)
    assert warnings == [
        f"aggregator rejected telemetry: {expected} (FAILED_PRECONDITION); sending no more"
    ]
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert refused.value.details() == expected


def test_acknowledgements_that_time_out_leave_no_thread_behind(tmp_path):
    """A paused aggregator (SIGSTOP): each batch's ack deadline (0.3 s) passes, the stream is
    cancelled and a new one opened for the resend. Before the fix a cancelled stream left
    gRPC's request-consumer thread blocked on its queue for good."""
    with LiveAggregator(tmp_path / "run", "paused", world_size=1) as agg:
        baseline = set(threading.enumerate())  # another test's thread may end meanwhile
        warnings: list[str] = []
        client = make_client(agg.target, "paused", warnings, rpc_timeout_s=0.3, batch_max_records=1)
        client.submit(client_mod.STEPS, step(0))
        deadline = time.monotonic() + 30
        while client.stats.acked < 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        agg.process.send_signal(signal.SIGSTOP)
        try:
            client.submit(client_mod.STEPS, step(1))
            time.sleep(3.0)  # several deadlines, each a cancelled stream
        finally:
            agg.process.send_signal(signal.SIGCONT)
        assert client.stats.send_failures >= 3
        assert client.close(finish(2), timeout_s=30) is True
        deadline = time.monotonic() + 5
        while set(threading.enumerate()) - baseline and time.monotonic() < deadline:
            time.sleep(0.05)
        # The sender thread has ended, and no stream left a thread of gRPC's behind.
        assert not set(threading.enumerate()) - baseline, [t.name for t in threading.enumerate()]
        assert agg.stop() == 0
    assert agg.query("SELECT COUNT(*) FROM steps") == [(2,)]
