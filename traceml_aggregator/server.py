"""The aggregator's gRPC server (``grpc.aio``): Push, ReportNodeExit, Finalize, Summarize,
RegisterNode, health.

One event loop serves every rank's calls (thousands of concurrent streams cost coroutines, not
threads); the single :class:`~traceml_aggregator.writer.Writer` stores what they bring. The
standard ``grpc.health.v1.Health`` service reports SERVING once the store is open, which is
what the launcher waits for.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from traceml import wire
from traceml.core import endpoint, log
from traceml.core.rundir import DATABASE_NAME
from traceml_aggregator.finalize import Finalizer, RunState
from traceml_aggregator.live import LiveAggregates
from traceml_aggregator.nodes import NodeRegistry
from traceml_aggregator.store import Store
from traceml_aggregator.writer import Writer

_log = log.get("aggregator")

SERVICE_NAME = "traceml.wire.v1.Aggregator"
#: How long a Summarize call lets queued batches commit (and reach the live aggregates), s.
SUMMARIZE_DRAIN_S = 2.0


@dataclass(frozen=True)
class ServerConfig:
    """Options of one aggregator (the ``traceml-aggregator`` flags)."""

    run_dir: Path
    run_name: str
    port: int = endpoint.DEFAULT_PORT
    bind_host: str = "127.0.0.1"
    world_size: int | None = None
    #: Node launchers that will report their torchrun's exit (None: ranks under plain torchrun).
    nnodes: int | None = None
    html_report: bool = False
    finalize_timeout_s: float = 300.0
    #: Write the reports when stopped if no Finalize asked for them (standalone use). The
    #: launcher turns it off: it finalizes itself, and a run it stops on purpose (a refused
    #: node claim) must leave no summary.
    summary_at_stop: bool = True
    #: Serve Prometheus ``/metrics`` on this port of ``bind_host`` (None: off).
    metrics_port: int | None = None


class AggregatorService(wire.AggregatorServicer):
    """The servicer: validates the run name, hands batches to the writer, acknowledges."""

    def __init__(
        self, config: ServerConfig, writer: Writer, state: RunState, finalizer, live: LiveAggregates
    ):
        self.config = config
        self.writer = writer
        self.live = live
        self.state = state
        self.finalizer = finalizer
        self.nodes = NodeRegistry(own_host=socket.gethostname(), nnodes=config.nnodes)

    def _foreign(self, run_name: str) -> str:
        if run_name != self.config.run_name:
            return f"run name {run_name!r} is not this aggregator's {self.config.run_name!r}"
        return ""

    async def Push(self, request, context):
        reason = self._foreign(request.run_name)
        if reason:
            return wire.Ack(rejected=True, reason=reason)
        if request.seq < 1:
            return wire.Ack(rejected=True, reason="sequence numbers start at 1")
        try:
            result = await self.writer.store_batch(request)
        except Exception as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"store failed: {exc}")
        if result.rejected:
            return wire.Ack(rejected=True, reason=result.rejected)
        return wire.Ack(stored_seq=result.stored_seq)

    async def ReportNodeExit(self, request, context):
        reason = self._foreign(request.run_name)
        if reason:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, reason)
        await self.writer.call(self.writer.store.write_node_exit, request, time.time_ns() // 1000)
        self.state.on_node_exit(request)
        self.live.on_node_exit(request)
        return wire.NodeExitAck()

    async def Finalize(self, request, context):
        reason = self._foreign(request.run_name)
        if reason:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, reason)
        outcome = await self.finalizer.finalize(request.timeout_s)
        return wire.FinalizeReply(
            complete=not outcome.missing,
            missing_ranks=outcome.missing,
            summary_json_path=str(outcome.json_path or ""),
            summary_text_path=str(outcome.text_path or ""),
            summary_html_path=str(outcome.html_path or ""),
            summary_text=outcome.text,
            error=outcome.error,
        )

    async def Summarize(self, request, context):
        reason = self._foreign(request.run_name)
        if reason:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, reason)
        from traceml.report.flat import flatten

        try:
            await self.writer.drain(SUMMARIZE_DRAIN_S)
            metrics, labels = flatten(await self.live.summary())
        except Exception as exc:  # an analysis bug must not take the aggregator down
            return wire.SummarizeReply(error=f"{type(exc).__name__}: {exc}")
        return wire.SummarizeReply(metrics=metrics, labels=labels)


    async def RegisterNode(self, request, context):
        reason = self._foreign(request.run_name)
        if reason:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, reason)
        accepted, refusal = self.nodes.claim(request)
        if not accepted:
            _log.warning(f"refused a node claim: {refusal}")
        return wire.NodeClaimReply(
            accepted=accepted, reason=refusal, run_failure=self.nodes.run_failure
        )


class BindError(RuntimeError):
    """The aggregator could not listen on its host:port (in use, or no such address)."""


async def serve(config: ServerConfig, ready=None) -> int:
    """Run the aggregator until SIGTERM/SIGINT; returns the process exit code.

    Args:
        config: the server's options.
        ready: optional callback with the bound port once the server is SERVING.

    Raises:
        BindError: the port cannot be bound.
    """
    store = Store(config.run_dir / DATABASE_NAME)
    store.set_meta("run_name", config.run_name)
    if config.world_size:
        store.set_meta("world_size", str(config.world_size))
    state = RunState(world_size=config.world_size, nnodes=config.nnodes)
    live = LiveAggregates(config.run_name, config.world_size)

    def on_stored(batch) -> None:
        state.on_batch(batch)
        live.on_batch(batch)

    writer = Writer(store, on_stored)

    def reports(store_, missing):
        from traceml_aggregator.reports import write_reports

        return write_reports(store_, config.run_dir, missing, html=config.html_report)

    finalizer = Finalizer(state, writer, reports, config.finalize_timeout_s)
    server = grpc.aio.server(
        options=[
            ("grpc.so_reuseport", 0),  # a second aggregator on the port must fail, not share
            ("grpc.max_receive_message_length", 64 * 1024 * 1024),
        ]
    )
    wire.add_AggregatorServicer_to_server(
        AggregatorService(config, writer, state, finalizer, live), server
    )
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    address = endpoint.target(config.bind_host, config.port)
    try:
        port = server.add_insecure_port(address)
    except RuntimeError as exc:
        raise BindError(f"cannot listen on {address}: {exc}") from exc
    if port == 0:
        raise BindError(f"cannot listen on {address} (port in use or address not local)")
    metrics_server = None
    if config.metrics_port is not None:
        from traceml_aggregator.metrics import serve_metrics

        try:
            metrics_server = serve_metrics(live, config.bind_host, config.metrics_port)
        except OSError as exc:
            raise BindError(
                f"cannot serve /metrics on {endpoint.target(config.bind_host, config.metrics_port)}"
                f": {exc}"
            ) from exc
    writer.start()
    await server.start()
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    watchdog = asyncio.get_running_loop().create_task(finalizer.watchdog())
    if ready is not None:
        ready(port)
    # The analysis and report modules (~0.04 s) load once serving: neither on the way to
    # SERVING nor in the Finalize that the end of the run waits for.
    import traceml.report  # noqa: F401

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    watchdog.cancel()
    await server.stop(grace=1.0)
    if metrics_server is not None:
        metrics_server.shutdown()
    await writer.drain(5.0)
    outcome = await finalizer.finalize_on_stop() if config.summary_at_stop else None
    if outcome is not None:
        _log.info(f"summary written at stop: {outcome.json_path or outcome.error}")
    await writer.close()
    live.close()
    _log.info(
        f"stored {writer.records_stored} records in {writer.batches_stored} batches; "
        f"{writer.batches_duplicate} resent batches were already stored"
    )
    return 0
