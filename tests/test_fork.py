"""Fork safety: a DataLoader forks 4 workers every epoch while the SDK streams telemetry.

Each run trains epochs with ``num_workers=4`` and the ``fork`` start method, the client sending
one batch per step on its stream (``TRACEML_BATCH_MAX_RECORDS=1``, 5 ms flush interval), so the
stream is open with a batch in flight at almost any moment a worker is forked: the fork hook
closes it, and the next batch reopens it. Measured with grpcio 1.85 before the client quiesced
its calls around fork(), such runs killed workers or broke the parent's stream in several of
30. Required here: no worker death, every step stored exactly once, and not one gRPC log line
on stderr.

The short run (12 epochs, 48 forks) is in ``tools/test.sh --quick``; the full run adds the
same race for 192 forks (48 epochs: the forks of what were four repeats of the short run, ~6
CPU s each under the suite's load, most of it a torch and an aggregator start-up; the race at a
stream's first connect, once per run, now runs twice in the full suite, not five times) and one
more that streams through a node relay (as ``traceml run``'s ranks do) for 200 forks.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import GRPC_LINE, SCRIPTS, traceml_env
from helpers.aggregator import relay_calls
from live_aggregator import LiveAggregator

from traceml import settings
from traceml.core.transport import Credentials
from traceml.launcher.relay import NodeRelay

pytestmark = [pytest.mark.aggregator]

BATCHES = 8
#: Epochs of the quick run (48 forks), the long one (192) and the relay's (200).
EPOCHS, LONG_EPOCHS, RELAY_EPOCHS = 12, 48, 50


def test_forking_dataloader_while_streaming(tmp_path):
    fork_storm(tmp_path, "fork", EPOCHS)


@pytest.mark.slow
def test_forking_dataloader_while_streaming_for_192_forks(tmp_path):
    fork_storm(tmp_path, "fork-long", LONG_EPOCHS)


@pytest.mark.slow
def test_forking_dataloader_while_streaming_through_the_node_relay(tmp_path):
    """The same race with the rank streaming to a node relay (traceml/launcher/relay.py, as
    under ``traceml run``), in one run of RELAY_EPOCHS epochs: 200 forks."""
    fork_storm(tmp_path, "fork-relay", RELAY_EPOCHS, relay=True)


def fork_storm(tmp_path, run_name: str, epochs: int, relay: bool = False) -> None:
    """Train ``epochs`` epochs of BATCHES steps with 4 fork()ed loader workers each, the rank
    streaming to a live aggregator (through a :class:`NodeRelay` in this process with
    ``relay``); assert the outcome above."""
    steps = epochs * BATCHES
    agg = LiveAggregator(tmp_path / "run", run_name, world_size=1).start()
    node_relay = None
    env = traceml_env(
        {
            "TRACEML_AGGREGATOR": agg.target,
            "TRACEML_RUN_NAME": agg.run_name,
            "TRACEML_FLUSH_INTERVAL_SEC": "0.005",
            "TRACEML_BATCH_MAX_RECORDS": "1",
        }
    )
    if relay:
        node_relay = NodeRelay(agg.target, Credentials.from_env(), 5.0)
        node_relay.start()
        env[settings.RELAY.name] = node_relay.address
    for name in ("GRPC_VERBOSITY", "GRPC_TRACE", "GRPC_ENABLE_FORK_SUPPORT"):
        env.pop(name, None)  # gRPC's defaults, as a user has them
    try:
        result = subprocess.run(
            [
                sys.executable,
                str(SCRIPTS / "fork_loader.py"),
                "--epochs",
                str(epochs),
                "--batches",
                str(BATCHES),
                "--workers",
                "4",
            ],
            env=env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
    finally:
        if node_relay is not None:
            node_relay.close()
        assert agg.stop() == 0

    assert result.returncode == 0, result.stderr[-3000:]  # a dead worker raises in the loader
    assert f"trained {steps} steps in {epochs} epochs" in result.stdout
    grpc_lines = [line for line in result.stderr.splitlines() if GRPC_LINE.search(line)]
    assert grpc_lines == []
    assert "traceml:" not in result.stderr  # no lost connection, no sender error

    assert agg.query("SELECT COUNT(*), MIN(step), MAX(step) FROM steps") == [(steps, 0, steps - 1)]
    assert agg.query("SELECT steps_completed, records_dropped, end_state FROM rank_finish") == [
        (steps, 0, "completed")
    ]
    # The stream was busy all along: about one batch per step, not a few big ones at exit.
    (stored_seq,) = agg.query("SELECT stored_seq FROM streams WHERE sender = 'rank'")[0]
    assert stored_seq >= steps // 2
    # The fork hook ended the stream cleanly at each epoch's forks, and the next batch opened
    # another: at least one stream per epoch, the last one closed after the finish marker.
    (ledger,) = agg.query("SELECT value FROM meta WHERE key = 'sender_streams'")[0]
    (rank_stream,) = [s for s in json.loads(ledger) if s["sender"] == "rank"]
    assert (rank_stream["state"], rank_stream["finished"]) == ("closed", True)
    assert rank_stream["streams"] >= epochs
    if relay:  # every one of those streams went through the relay's one call
        assert relay_calls(agg.log()) == 1
        assert node_relay.stats.upstream_failures == 0
