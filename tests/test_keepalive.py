"""Keepalive: client and aggregator agree, and an idle minute under real torchrun is silent.

The client pings every ``CLIENT_KEEPALIVE_MS``; the aggregator permits a ping every
``SERVER_MIN_PING_INTERVAL_MS``. Were the client to ping more often than the server permits,
the server would answer GOAWAY ``too_many_pings`` and gRPC would log it on the user's stderr.
The slow test runs ``traceml run`` (torchrun, 2 ranks) over a script that sleeps between two
steps, as a checkpoint save or an evaluation does, and requires no gRPC line on stderr and
every step stored once. The idle gap is the defaults' idle minute scaled down: the test sets
the keepalive settings to a tenth of their defaults (``TRACEML_GRPC_*_MS``, the same ratios;
the timeout, which only a peer that does not answer reaches, stays at its default) and idles
for more than three client ping intervals (70 s was two of 30 s), so the ranks and the
aggregator ping each other through the gap as often as in the idle minute, or more.
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import subprocess
import sys
import threading

import pytest
from conftest import GRPC_LINE, SCRIPTS, free_port, load_summary, query, run_traceml
from helpers.waiting import wait_for
from live_aggregator import LiveAggregator, finish, make_client, step

from traceml import settings
from traceml.core import transport
from traceml.sdk import client as client_mod

#: HTTP/2 (RFC 9113): the client's connection preface (bytes), a frame header's length
#: (bytes), the PING frame's type and its ACK flag.
H2_PREFACE_BYTES = 24
H2_FRAME_HEADER_BYTES = 9
H2_PING, H2_ACK = 0x6, 0x1

#: The keepalive settings of the slow test: a tenth of the defaults (traceml/settings.py).
SHORT_KEEPALIVE = {
    settings.GRPC_CLIENT_KEEPALIVE_MS: 3_000,
    settings.GRPC_SERVER_MIN_PING_INTERVAL_MS: 1_000,
    settings.GRPC_SERVER_KEEPALIVE_MS: 2_000,
}
STEPS = 6
#: The idle gap, s: more client ping intervals than the idle minute held at the defaults.
IDLE_S = 10


def test_client_keepalive_is_within_what_the_server_permits():
    client = dict(transport.channel_options())
    server = dict(transport.server_options())
    assert (
        client["grpc.keepalive_time_ms"] >= server["grpc.http2.min_ping_interval_without_data_ms"]
    )
    assert (
        client["grpc.keepalive_permit_without_calls"]
        == server["grpc.keepalive_permit_without_calls"]
        == 1
    )
    # The server keeps pinging an idle connection (0: no bound), so a vanished sender's stream
    # ends within keepalive time + timeout (docs/wire.md).
    assert server["grpc.http2.max_pings_without_data"] == 0
    assert server["grpc.keepalive_time_ms"] + server["grpc.keepalive_timeout_ms"] == 40_000
    # The slow test's short settings keep the defaults' ratios.
    for setting, short in SHORT_KEEPALIVE.items():
        assert int(setting.default) == 10 * short, setting.name
    assert IDLE_S * 1000 / SHORT_KEEPALIVE[settings.GRPC_CLIENT_KEEPALIVE_MS] > 70_000 / int(
        settings.GRPC_CLIENT_KEEPALIVE_MS.default
    )


class PingCountingProxy:
    """A TCP proxy on a free port to ``target_port``, in a thread of its own, that counts the
    HTTP/2 PING frames (plaintext) each way: :attr:`pings` ``("up" or "down", is an ACK)`` ->
    frames. Closed by :meth:`close`."""

    def __init__(self, target_port: int) -> None:
        self.target_port, self.port = target_port, free_port()
        self.pings: collections.Counter = collections.Counter()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._call(self._listen())

    def _call(self, coroutine) -> None:
        asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(10)

    async def _listen(self) -> None:
        self._server = await asyncio.start_server(self._connection, "127.0.0.1", self.port)

    async def _connection(self, client_r, client_w) -> None:
        server_r, server_w = await asyncio.open_connection("127.0.0.1", self.target_port)
        await asyncio.gather(
            self._pipe(client_r, server_w, "up", H2_PREFACE_BYTES),
            self._pipe(server_r, client_w, "down", 0),
        )

    async def _pipe(self, reader, writer, direction: str, skip: int) -> None:
        pending = b""
        try:
            while data := await reader.read(65536):
                writer.write(data)
                pending += data
                if skip:
                    skipped = min(skip, len(pending))
                    pending, skip = pending[skipped:], skip - skipped
                while len(pending) >= H2_FRAME_HEADER_BYTES:
                    end = H2_FRAME_HEADER_BYTES + int.from_bytes(pending[:3], "big")
                    if len(pending) < end:
                        break
                    if pending[3] == H2_PING:
                        self.pings[direction, bool(pending[4] & H2_ACK)] += 1
                    pending = pending[end:]
                await writer.drain()
        finally:
            writer.close()

    async def _stop(self) -> None:
        self._server.close()
        tasks = asyncio.all_tasks() - {asyncio.current_task()}
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def close(self) -> None:
        """Stop listening, end the connections and the thread."""
        self._call(self._stop())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()


@pytest.mark.aggregator
def test_the_wire_sends_no_bandwidth_probe_pings(tmp_path):
    """Both sides turn gRPC's bandwidth-delay-product probe off (``grpc.http2.bdp_probe``):
    with it on, each message received after a quiet spell made the receiver send a PING and
    the sender answer it, so at node 0's pace (a message every 8 s a connection) every
    message cost node 0 a ping's frames and gRPC's thread wake-ups too (docs/scale.md, *The
    transport's bandwidth probe*). A real client streams 40 steps through a proxy that counts
    the frames, a batch at a time: not one PING either way (keepalive pings come after 20 s at
    the earliest), and every step stored once."""
    with LiveAggregator(tmp_path / "run", "pings") as aggregator:
        proxy = PingCountingProxy(aggregator.port)
        try:
            client = make_client(
                f"127.0.0.1:{proxy.port}", "pings", [], flush_interval_s=3600, batch_max_records=4
            )
            for i in range(40):
                client.submit(client_mod.STEPS, step(i))
                if i % 4 == 3:  # a batch of 4 sent: its Ack comes before the next
                    wait_for(lambda i=i: client.stats.acked == i + 1, timeout_s=20)
            assert client.close(finish(40), timeout_s=30) is True
            assert sum(proxy.pings.values()) == 0, proxy.pings
        finally:
            proxy.close()
        assert aggregator.stop() == 0
        assert aggregator.query("SELECT COUNT(DISTINCT step), COUNT(*) FROM steps") == [(40, 40)]


def test_the_wire_time_bounds_are_settings_read_when_a_process_starts():
    """TRACEML_GRPC_*_MS and TRACEML_NODE_LOST_AFTER_SEC set the options of every channel and
    server and the lost-node bound; a malformed value is the default, with one warning."""
    code = (
        "import json; from traceml.core import transport as t; "
        "c, s = dict(t.channel_options()), dict(t.server_options()); "
        "print(json.dumps([c['grpc.keepalive_time_ms'], c['grpc.keepalive_timeout_ms'], "
        "s['grpc.keepalive_time_ms'], s['grpc.keepalive_timeout_ms'], "
        "s['grpc.http2.min_ping_interval_without_data_ms'], t.NODE_LOST_AFTER_S]))"
    )
    env = {
        **os.environ,
        settings.GRPC_CLIENT_KEEPALIVE_MS.name: "3000",
        settings.GRPC_KEEPALIVE_TIMEOUT_MS.name: "4000",
        settings.GRPC_SERVER_KEEPALIVE_MS.name: "2000",
        settings.GRPC_SERVER_MIN_PING_INTERVAL_MS.name: "1000",
        settings.NODE_LOST_AFTER_SEC.name: "7.5",
    }
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert json.loads(out.stdout) == [3000, 4000, 2000, 4000, 1000, 7.5]
    assert out.stderr == ""
    env[settings.GRPC_CLIENT_KEEPALIVE_MS.name] = "soon"
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert json.loads(out.stdout) == [30_000, 4000, 2000, 4000, 1000, 7.5]
    assert out.stderr.splitlines() == [
        "traceml: TRACEML_GRPC_CLIENT_KEEPALIVE_MS must be an integer >= 1 (got 'soon'); "
        "using the default, 30000"
    ]


@pytest.mark.torchrun
@pytest.mark.slow
def test_an_idle_minute_prints_no_grpc_line_and_loses_nothing(tmp_path):
    run = "idle-minute"
    result = run_traceml(
        [
            "run",
            str(SCRIPTS / "idle_steps.py"),
            "--nproc-per-node=2",
            "--run-name",
            run,
            "--aggregator-port",
            str(free_port()),
            "--steps",
            str(STEPS),
            "--idle-sec",
            str(IDLE_S),
        ],
        tmp_path,
        timeout=IDLE_S + 180,
        env={setting.name: str(ms) for setting, ms in SHORT_KEEPALIVE.items()},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count(f"trained {STEPS} steps") == 2
    assert [line for line in result.stderr.splitlines() if GRPC_LINE.search(line)] == []
    run_dir = tmp_path / "logs" / run
    assert query(
        run_dir, "SELECT rank, COUNT(*), MIN(step), MAX(step) FROM steps GROUP BY rank"
    ) == [(0, STEPS, 0, STEPS - 1), (1, STEPS, 0, STEPS - 1)]
    summary = load_summary(run_dir)
    assert [(r["rank"], r["steps_completed"], r["records_dropped"]) for r in summary["ranks"]] == [
        (0, STEPS, 0),
        (1, STEPS, 0),
    ]
    # Each rank's stream stayed up through the idle minute: one stream, closed after its finish.
    ranks = [
        s for s in summary["run"]["telemetry_health"]["sender_streams"] if s["sender"] == "rank"
    ]
    assert [(s["id"], s["state"], s["finished"], s["streams"]) for s in ranks] == [
        (0, "closed", True, 1),
        (1, "closed", True, 1),
    ], json.dumps(ranks)
