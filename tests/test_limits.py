"""The wire's limits (docs/wire.md, *Limits*): a full writer queue pushes back and the clients
keep their data; batches stay below the message bound; a record too large for any batch is
dropped with one warning and counted, not lost silently."""

from __future__ import annotations

import threading
import time

import pytest
from helpers.waiting import LOADED_CALL_S
from live_aggregator import LiveAggregator, finish, make_client, step

from traceml import wire
from traceml.sdk import client as client_mod
from traceml.sdk.client import MAX_BATCH_BYTES, SYSTEM_SAMPLES, ClientConfig, TelemetryClient

pytestmark = [pytest.mark.aggregator]


def test_a_full_writer_queue_pushes_back_and_every_record_arrives(tmp_path):
    """A queue bound of 1 byte: any batch that arrives while another waits is answered
    RESOURCE_EXHAUSTED with a retry-after. 16 senders at once: some are pushed back, none
    warns, none loses a record, and each step is stored once."""
    senders, steps = 16, 600
    with LiveAggregator(
        tmp_path / "run", "queue", world_size=senders, extra_args=("--max-queued-bytes", "1")
    ) as agg:
        warnings: list[str] = []
        config = ClientConfig(
            flush_interval_s=0.02, batch_max_records=20, buffer_max_records=65536, rpc_timeout_s=5.0
        )
        clients = [
            TelemetryClient(agg.target, "queue", rank=rank, config=config, warn=warnings.append)
            for rank in range(senders)
        ]

        def feed(c):
            for i in range(steps):
                c.submit(client_mod.STEPS, step(i))

        threads = [threading.Thread(target=feed, args=(c,)) for c in clients]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert all(c.close(finish(steps), timeout_s=120) for c in clients)
        assert warnings == []
        pushed_back = sum(c.stats.pushed_back for c in clients)
        assert pushed_back > 0
        assert [c.stats.acked for c in clients] == [steps] * senders
        assert agg.stop() == 0
    assert agg.query("SELECT COUNT(*), COUNT(DISTINCT rank || '/' || step) FROM steps") == [
        (senders * steps, senders * steps)
    ]
    assert f"{pushed_back} batches pushed back (writer behind, or its store failing)" in agg.log()


def test_batches_stay_below_the_bound_and_an_oversized_record_is_dropped_with_a_warning(tmp_path):
    """Samples of 0.8 MiB each (a huge host name): at most two fit a batch. One of 3 MiB fits
    none: dropped, one warning line, counted in the finish marker's records_dropped."""
    big = 800 * 1024
    with LiveAggregator(tmp_path / "run", "sizes", world_size=1) as agg:
        warnings: list[str] = []
        # Nothing is sent before close(): the whole buffer is cut into batches at once.
        c = make_client(agg.target, "sizes", warnings, flush_interval_s=60.0, batch_max_records=100)
        for i in range(5):
            c.submit(SYSTEM_SAMPLES, wire.SystemSample(node_rank=0, unix_us=i, hostname="h" * big))
        c.submit(
            SYSTEM_SAMPLES, wire.SystemSample(node_rank=0, unix_us=9, hostname="x" * 3 * 2**20)
        )
        assert c.close(timeout_s=60)
        assert (c.stats.dropped_oversized, c.stats.acked, c.stats.send_failures) == (1, 5, 0)
        assert len(warnings) == 1
        assert warnings[0].startswith("dropped a system_samples record of 3145")
        assert f"at most {MAX_BATCH_BYTES} bytes" in warnings[0]
        assert agg.stop() == 0
    assert agg.query("SELECT unix_us FROM system_samples ORDER BY unix_us") == [
        (i,) for i in range(5)
    ]
    # Two samples of 0.8 MiB per batch at most: 2 + 2 + 1.
    assert agg.query("SELECT stored_seq FROM streams") == [(3,)]


@pytest.mark.alone  # the first call must still be in flight 1 s later: not on a loaded machine
def test_calls_beyond_the_bound_in_flight_are_answered_resource_exhausted(tmp_path):
    """--max-concurrent-rpcs 1: while a Finalize waits (3 s) for a rank that never finishes,
    a second call is refused at once; once the first is over, calls are served again."""
    import grpc

    from traceml.core.transport import open_channel

    with LiveAggregator(
        tmp_path / "run",
        "bound",
        world_size=1,
        extra_args=("--max-concurrent-rpcs", "1", "--finalize-timeout-sec", "3"),
    ) as agg:
        with open_channel(agg.target) as channel:
            stub = wire.AggregatorStub(channel)
            waiting = stub.Finalize.future(wire.FinalizeRequest(run_name="bound"), timeout=30)
            time.sleep(1.0)
            with pytest.raises(grpc.RpcError) as refused:
                stub.Summarize(wire.SummarizeRequest(run_name="bound"), timeout=10)
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert waiting.result().missing_ranks == [0]
            summarize = wire.SummarizeRequest(run_name="bound")
            assert stub.Summarize(summarize, timeout=LOADED_CALL_S).error == ""
        assert agg.stop() == 0
