"""Benchmark (e): bytes on the wire per step record.

Two figures:

1. the protobuf encoding of a step inside a ``Batch`` (the batch's ``step_groups`` columns,
   divided by the steps they hold), for a CPU rank's steps and for steps with every GPU field
   set;
2. what really crosses the TCP connection, counted by a byte-counting proxy between the SDK's
   :class:`~traceml.sdk.client.TelemetryClient` and a real aggregator: protobuf, gRPC framing,
   HTTP/2 frames (HEADERS, DATA, WINDOW_UPDATE, PING), divided by the records delivered,
   for several records per batch (a rank sends one batch per second, so records per batch is
   its steps per second, up to ``TRACEML_BATCH_MAX_RECORDS``).

Target: <= 60 B per record. Usage: ``python benchmarks/wire_size.py``.
"""

from __future__ import annotations

import asyncio
import tempfile
import threading
from pathlib import Path

from _common import LiveAggregator, free_port

from traceml import wire
from traceml.core.phases import STEP_FIELDS
from traceml.sdk import client as client_mod
from traceml.sdk.client import ClientConfig, TelemetryClient
from traceml.wire.records import add_steps

RECORDS = 5000
STEP_US = 100_000  # a 100 ms step
RUN_START_US = 2 * 3600 * 1_000_000  # records from the third hour of a run: end_us ~ 7e9


def cpu_record(i: int) -> dict[str, int]:
    """What a CPU rank sends: step clock and the five CPU phases (µs)."""
    return {
        "step": 36_000 + i,
        "end_us": RUN_START_US + i * STEP_US + (i * 7919) % 997,
        "step_us": STEP_US + (i * 104_729) % 5_000,
        "input_wait_us": 800 + i % 300,
        "dataloader_next_us": 650 + i % 200,
        "forward_us": 31_000 + i % 2_000,
        "backward_us": 58_000 + i % 3_000,
        "optimizer_us": 6_500 + i % 500,
    }


def gpu_record(i: int) -> dict[str, int]:
    """Every field set: a GPU-timed step that also read the allocator's peaks (bytes)."""
    rec = cpu_record(i)
    rec.update(h2d_us=1_200)
    rec = {name: rec[name] for name in STEP_FIELDS if name in rec}
    rec.update(
        gpu_step_us=98_000,
        gpu_h2d_us=1_100,
        gpu_forward_us=30_500,
        gpu_backward_us=57_000,
        gpu_optimizer_us=6_300,
        peak_allocated_bytes=61_000_000_000,
        peak_reserved_bytes=72_000_000_000,
    )
    return rec


def encoded_in_batch(make, steps: int) -> float:
    """Bytes one step adds to a Batch of ``steps`` steps (its share of the groups' columns)."""
    header = wire.Batch(run_name="run-20250101-120000-abcd", rank=1023, seq=123_456)
    full = wire.Batch()
    full.CopyFrom(header)
    add_steps(full, (make(i) for i in range(steps)))
    return (full.ByteSize() - header.ByteSize()) / steps


class CountingProxy:
    """A TCP proxy on 127.0.0.1 that counts the bytes in each direction (its own thread)."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.port = free_port()
        self.up = 0  # client -> aggregator
        self.down = 0  # aggregator -> client
        self._loop = asyncio.new_event_loop()
        ready = threading.Event()
        threading.Thread(target=self._serve, args=(ready,), daemon=True).start()
        ready.wait()

    def _serve(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)

        async def main() -> None:
            server = await asyncio.start_server(self._handle, "127.0.0.1", self.port)
            ready.set()
            async with server:
                await server.serve_forever()

        self._loop.run_until_complete(main())

    async def _handle(self, reader, writer) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)

        async def pump(src, dst, upward: bool) -> None:
            while data := await src.read(65536):
                if upward:
                    self.up += len(data)
                else:
                    self.down += len(data)
                dst.write(data)
                await dst.drain()
            dst.close()

        await asyncio.gather(
            pump(reader, up_writer, True),
            pump(up_reader, writer, False),
            return_exceptions=True,
        )


def wire_bytes(per_batch: int, make) -> tuple[float, float]:
    """(bytes up, bytes down) per record delivered by a real client through the proxy."""
    with (
        tempfile.TemporaryDirectory() as tmp,
        LiveAggregator(Path(tmp) / "run", "run-20250101-120000-abcd") as agg,
    ):
        proxy = CountingProxy(agg.port)
        config = ClientConfig(
            flush_interval_s=3600, batch_max_records=per_batch, buffer_max_records=65536
        )
        client = TelemetryClient(f"127.0.0.1:{proxy.port}", agg.run_name, rank=1023, config=config)
        for i in range(RECORDS):
            client.submit(client_mod.STEPS, make(i))
        assert client.close(wire.RankFinish(steps_completed=RECORDS), timeout_s=120)
        assert client.stats.acked == RECORDS
        agg.stop()
        return proxy.up / RECORDS, proxy.down / RECORDS


def main() -> None:
    print("(e) bytes on the wire per step record (target <= 60 B)")
    for steps in (1, 10, 512):
        print(
            f"  protobuf, {steps:>3} CPU steps in a batch:  "
            f"{encoded_in_batch(cpu_record, steps):6.1f} B a step"
        )
    print(
        "  protobuf, 512 steps, every field set:  "
        f"{encoded_in_batch(gpu_record, 512):6.1f} B a step"
    )
    print(f"  real TCP bytes, {RECORDS} CPU records through the SDK client:")
    print("    records/batch   up B/record   down B/record")
    for per_batch in (1, 10, 100, 512):
        up, down = wire_bytes(per_batch, cpu_record)
        print(f"    {per_batch:>13}   {up:>11.1f}   {down:>13.1f}")


if __name__ == "__main__":
    main()
