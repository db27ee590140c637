"""A burst of calls at once, as a start of 1,000 node relays brings (each its ``Relay`` and its
session: ~2,000 calls within a second): the aggregator serves every one the first time.

gRPC's core keeps the calls that arrived and that ``grpc.aio`` has not taken yet (it takes one
at a time, on the event loop), and past 1,000 of them by default drops more, without a status
(the client sees CANCELLED, or INTERNAL from its next write): a tenth of such a burst failed
and went again. The aggregator bounds them as it bounds the calls in flight
(:func:`traceml_aggregator.server.grpc_server`).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import SCRIPTS
from live_aggregator import LiveAggregator

from traceml_aggregator.streams import STREAMS_META_KEY

pytestmark = [pytest.mark.aggregator]

#: Client processes, each with as many connections and calls.
PROCESSES, CHANNELS = 4, 500


def test_two_thousand_calls_at_once_are_all_served_the_first_time(tmp_path):
    """4 processes of 500 connections each, every connection made first, then one ``Stream``
    each at once (a rank's identity and one step, then its ``closing``): every call ends OK
    with its batch acknowledged, each of the 2,000 ranks' one step is stored, and the ledger
    holds each rank's one stream, closed (a call that failed and went again would be two)."""
    world = PROCESSES * CHANNELS
    with LiveAggregator(tmp_path / "run", "r", world_size=world) as agg:
        clients = [
            subprocess.Popen(
                [
                    sys.executable,
                    str(SCRIPTS / "call_burst.py"),
                    f"--target={agg.target}",
                    f"--world-size={world}",
                    f"--first={p * CHANNELS}",
                    f"--channels={CHANNELS}",
                ],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            for p in range(PROCESSES)
        ]
        try:
            for client in clients:  # every connection made and ready
                assert client.stdout.readline() == "ready\n"
            for client in clients:  # then every call at once
                client.stdin.write("go\n")
                client.stdin.flush()
            results = [json.loads(client.stdout.readline()) for client in clients]
            assert [client.wait(timeout=120) for client in clients] == [0] * PROCESSES
        finally:
            for client in clients:
                client.kill()
                client.wait()
        assert [r["codes"] for r in results] == [{"OK": CHANNELS}] * PROCESSES
        assert [r["acked"] for r in results] == [CHANNELS] * PROCESSES
        assert agg.stop() == 0
    assert agg.query("SELECT count(*), count(DISTINCT rank), max(step) FROM steps") == [
        (world, world, 0)
    ]
    (ledger,) = agg.query("SELECT value FROM meta WHERE key = ?", (STREAMS_META_KEY,))[0]
    entries = json.loads(ledger)
    assert sorted(e["id"] for e in entries) == list(range(world))
    assert {(e["streams"], e["state"]) for e in entries} == {(1, "closed")}
