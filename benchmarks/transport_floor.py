"""The gRPC transport alone, as ``benchmarks/ingest.py --transport-floor`` runs it: the floor
under the aggregator's cost.

The aggregator's own ``grpc.aio`` server (:func:`traceml_aggregator.server.grpc_server`: its
options, bound of calls in flight and token interceptor) and the aggregator's service, whose
``Stream``, ``Push`` and ``Relay`` only parse each batch (each ``RelayUp``) and acknowledge its
sequence number (each of its batches', in one ``RelayDown``, as node 0 answers a node relay):
nothing is checked, stored or folded into live aggregates. What this process spends per
message is what any Python aggregator on ``grpc.aio`` pays before it does anything with it, so
the aggregator's figures read against it split into the transport's share and the
aggregator's own.

Usage (``ingest.py`` starts it): ``python benchmarks/transport_floor.py PORT``; prints
``listening PORT`` once it serves; SIGTERM or SIGKILL ends it (it holds no state).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

from traceml import wire
from traceml_aggregator.senders import Rejections
from traceml_aggregator.server import grpc_server, raise_open_files_limit


class TransportOnly(wire.AggregatorServicer):
    """Acknowledges every batch at once, as stored (``stored_seq`` = its ``seq``)."""

    async def Push(self, request, context):
        return wire.Ack(stored_seq=request.seq)

    async def Stream(self, request_iterator, context):
        async for batch in request_iterator:  # the aggregator's own way of reading a stream
            if not batch.closing:
                yield wire.Ack(stored_seq=batch.seq)

    async def Relay(self, request_iterator, context):
        async for up in request_iterator:  # one RelayDown a RelayUp, a RelayAck a batch frame
            yield wire.RelayDown(
                acks=[
                    wire.RelayAck(channel=f.channel, ack=wire.Ack(stored_seq=f.batch.seq))
                    for f in up.frames
                    if f.HasField("batch") and not f.batch.closing
                ]
            )


async def serve(port: int) -> None:
    """Serve on 127.0.0.1:``port`` until killed."""
    server = grpc_server(os.environ["TRACEML_RUN_TOKEN"], Rejections())
    wire.add_AggregatorServicer_to_server(TransportOnly(), server)
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    print(f"listening {bound}", flush=True)
    await server.wait_for_termination()


class TransportFloor:
    """This server in a subprocess on a free port of 127.0.0.1, as a context manager (killed
    on the way out); the part of :class:`LiveAggregator`'s interface ``ingest.py`` uses."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.process: subprocess.Popen | None = None

    @property
    def target(self) -> str:
        """``host:port`` for clients."""
        return f"127.0.0.1:{self.port}"

    def __enter__(self) -> TransportFloor:
        self.process = subprocess.Popen(
            [sys.executable, __file__, str(self.port)], stdout=subprocess.PIPE, text=True
        )
        line = self.process.stdout.readline()
        if line.strip() != f"listening {self.port}":  # "listening 0": the port was taken
            raise RuntimeError(f"the transport floor server did not start: {line!r}")
        return self

    def __exit__(self, *exc_info) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()

    def stop(self, timeout_s: float) -> int:
        """SIGTERM; 0 once the process ended by it (it has nothing to drain)."""
        self.process.send_signal(signal.SIGTERM)
        code = self.process.wait(timeout_s)
        return 0 if code == -signal.SIGTERM else code


def main() -> None:
    raise_open_files_limit()  # as the aggregator does
    asyncio.run(serve(int(sys.argv[1])))


if __name__ == "__main__":
    main()
