"""Keepalive: client and aggregator agree, and an idle minute under real torchrun is silent.

The client pings every ``CLIENT_KEEPALIVE_MS``; the aggregator permits a ping every
``SERVER_MIN_PING_INTERVAL_MS``. Were the client to ping more often than the server permits,
the server would answer GOAWAY ``too_many_pings`` and gRPC would log it on the user's stderr.
The slow test runs ``traceml run`` (torchrun, 2 ranks) over a script that sleeps 70 s between
two steps, as a checkpoint save or an evaluation does, and requires no gRPC line on stderr and
every step stored once.
"""

from __future__ import annotations

import json

import pytest
from conftest import GRPC_LINE, SCRIPTS, free_port, load_summary, query, run_traceml

from traceml.core import transport

STEPS, IDLE_S = 6, 70


def test_client_keepalive_is_within_what_the_server_permits():
    client = dict(transport.channel_options())
    server = dict(transport.server_options())
    assert client["grpc.keepalive_time_ms"] >= server["grpc.http2.min_ping_interval_without_data_ms"]
    assert client["grpc.keepalive_permit_without_calls"] == server[
        "grpc.keepalive_permit_without_calls"] == 1
    # The server keeps pinging an idle connection (0: no bound), so a vanished sender's stream
    # ends within keepalive time + timeout (docs/wire.md).
    assert server["grpc.http2.max_pings_without_data"] == 0
    assert server["grpc.keepalive_time_ms"] + server["grpc.keepalive_timeout_ms"] == 40_000


@pytest.mark.slow
def test_an_idle_minute_prints_no_grpc_line_and_loses_nothing(tmp_path):
    run = "idle-minute"
    result = run_traceml(
        [
            "run", str(SCRIPTS / "idle_steps.py"), "--nproc-per-node=2", "--run-name", run,
            "--aggregator-port", str(free_port()), "--steps", str(STEPS),
            "--idle-sec", str(IDLE_S),
        ],
        tmp_path,
        timeout=IDLE_S + 180,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count(f"trained {STEPS} steps") == 2
    assert [line for line in result.stderr.splitlines() if GRPC_LINE.search(line)] == []
    run_dir = tmp_path / "logs" / run
    assert query(run_dir, "SELECT rank, COUNT(*), MIN(step), MAX(step) FROM steps GROUP BY rank") \
        == [(0, STEPS, 0, STEPS - 1), (1, STEPS, 0, STEPS - 1)]
    summary = load_summary(run_dir)
    assert [(r["rank"], r["steps_completed"], r["records_dropped"]) for r in summary["ranks"]] == [
        (0, STEPS, 0), (1, STEPS, 0)]
    # Each rank's stream stayed up through the idle minute: one stream, closed after its finish.
    ranks = [s for s in summary["run"]["telemetry_health"]["sender_streams"] if s["sender"] == "rank"]
    assert [(s["id"], s["state"], s["finished"], s["streams"]) for s in ranks] == [
        (0, "closed", True, 1), (1, "closed", True, 1)], json.dumps(ranks)
