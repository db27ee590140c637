"""The aggregator's gRPC server (``grpc.aio``): Stream, Relay (a node relay's senders' streams
on one call), Push, ReportNodeExit, Finalize, Summarize, NodeSession
(:mod:`traceml_aggregator.sessions`), health.

One event loop serves every rank's calls (thousands of concurrent streams cost coroutines, not
threads); the single :class:`~traceml_aggregator.writer.Writer` stores what they bring. The
standard ``grpc.health.v1.Health`` service reports SERVING once the store is open, which is
what the launcher waits for.

Every call but health's must carry the run token (:mod:`traceml_aggregator.auth`); a batch
must come from one of the run's senders (:mod:`traceml_aggregator.senders`). The server's
limits (docs/wire.md): messages of at most
:data:`~traceml.core.transport.MAX_MESSAGE_BYTES` either way, at most
``max_concurrent_rpcs`` calls in flight (more are answered ``RESOURCE_EXHAUSTED`` by gRPC;
each sender's stream is one of them for as long as it is open), and the writer's queue bound,
answered with a retry-after (in the Ack on a stream, ``RESOURCE_EXHAUSTED`` on a Push). The
open-files soft limit is raised to the hard limit at start: each stream's connection is a
socket (:func:`raise_open_files_limit`).
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import sqlite3
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from traceml import settings, wire
from traceml.analysis.hang import STALL_META_KEY
from traceml.core import disk_reserve, endpoint, log, otlp
from traceml.core.ends import interrupted_reason, is_interrupted, signal_name
from traceml.core.heap import SERVING_TALLY, serving_heap
from traceml.core.records import SAMPLES, AggregatorLoss, AggregatorRestart
from traceml.core.rundir import DASHBOARD_LINK_FILE_NAME, DATABASE_NAME, RunDir
from traceml.core.transport import NODE_LOST_AFTER_S, RETRY_AFTER_METADATA_KEY, server_options
from traceml_aggregator.auth import TokenInterceptor, server_credentials, server_ssl_context
from traceml_aggregator.checkpoint import Checkpoint, Checkpointer
from traceml_aggregator.checkpoint import read as read_checkpoint
from traceml_aggregator.finalize import Finalizer, Outcome, RunState
from traceml_aggregator.hang import HangWatch
from traceml_aggregator.live import LiveAggregates, StepReplay
from traceml_aggregator.live.rows import LiveRows, summarize_reply
from traceml_aggregator.nodes import NodeRegistry
from traceml_aggregator.pace import FlushPace
from traceml_aggregator.retention import PRUNED_META_KEY, Policy, Retention, sample_meta_keys
from traceml_aggregator.retention import run as run_retention
from traceml_aggregator.script_world import ScriptWorld, store_record
from traceml_aggregator.senders import BATCH_ONLY, Rejections, check_batch
from traceml_aggregator.sessions import NodeSessions
from traceml_aggregator.store import (
    LOSS_META_KEY,
    NODE_CLOCKS_META_KEY,
    NODE_LOSSES_META_KEY,
    REJECTED_META_KEY,
    REJECTED_REASONS_META_KEY,
    RESTARTS_META_KEY,
    STORE_INT_MAX,
    Store,
    StoreUnavailable,
    WriteResult,
    is_unreadable,
    open_run_store,
    unreadable,
)
from traceml_aggregator.streams import STREAMS_META_KEY, SenderStream, StreamLedger
from traceml_aggregator.writer import QueueFull, StoreFailed, Writer

_log = log.get("aggregator")

SERVICE_NAME = "traceml.wire.v1.Aggregator"
#: How long a Summarize call lets queued batches commit (and reach the live aggregates), s.
SUMMARIZE_DRAIN_S = 2.0
#: How long a client pushed back by a full writer queue waits before it sends again, ms.
RETRY_AFTER_MS = 500
#: What a stream's (or a relay channel's) batch pushed back by the writer's queue is answered.
PUSHED_BACK = wire.Ack(retry_after_ms=RETRY_AFTER_MS)
#: How often the stream ledger and the refusal counts are written to the store when they
#: changed, s: an aggregator killed in any way loses at most this much of them (its
#: replacement restores the rest).
RUN_RECORDS_PERSIST_S = 1.0


@dataclass(frozen=True)
class ServerConfig:
    """Options of one aggregator (the ``traceml-aggregator`` flags)."""

    run_dir: Path
    run_name: str
    port: int = settings.AGGREGATOR_PORT.value
    bind_host: str = "127.0.0.1"
    world_size: int | None = None
    #: Node launchers that will report their torchrun's exit (None: ranks under plain torchrun).
    nnodes: int | None = None
    #: Node 0's rendezvous port (``--master-port``): a claim with another is refused (None:
    #: not checked).
    master_port: int | None = None
    html_report: bool = settings.HTML_REPORT.value
    finalize_timeout_s: float = settings.FINALIZE_TIMEOUT_SEC.value
    #: Seconds without a completed step before a live rank has stalled (a hang).
    hang_timeout_s: float = settings.HANG_TIMEOUT_SEC.value
    #: Write the reports when stopped if no Finalize asked for them (standalone use). The
    #: launcher turns it off: it finalizes itself, and a run it stops on purpose (a refused
    #: node claim) must leave no summary.
    summary_at_stop: bool = True
    #: A launcher owns this process (``--owned``): it stops when its standard input reaches
    #: end of file (the launcher closed its end of the pipe, or died in any way), and SIGTERM
    #: and SIGINT are noted, not obeyed, so that an scancel that signals every process of the
    #: job leaves it serving until the launcher has finalized.
    owned: bool = False
    #: This aggregator replaces one that died (``--restart-reason``): why, and since when
    #: (Unix s) the run had none. Recorded in the store's ``aggregator_restarts`` meta entry.
    restart_reason: str = ""
    down_since_unix_s: float | None = None
    #: With ``--finalize-only``: the run's aggregator was lost for good (``--lost-reason``),
    #: since when (Unix s). Recorded in the store's ``aggregator_loss`` meta entry.
    lost_reason: str = ""
    lost_unix_s: float | None = None
    #: The run token every call but health's must carry (see traceml_aggregator/auth.py).
    run_token: str = field(default="", repr=False)
    #: PEM files of the aggregator's TLS certificate and key (both, or neither: plain text).
    tls_cert: Path | None = None
    tls_key: Path | None = None
    max_concurrent_rpcs: int = settings.MAX_CONCURRENT_RPCS.value
    #: Bound of the writer's queue, bytes of serialized batches.
    max_queued_bytes: int = settings.MAX_QUEUED_BYTES.value
    #: Serve Prometheus ``/metrics`` on this port of ``metrics_bind_host`` (None: off).
    metrics_port: int | None = None
    #: Where ``/metrics`` listens: this host only unless asked otherwise.
    metrics_bind_host: str = settings.METRICS_BIND_HOST.value
    #: ``--otlp-endpoint``: push the ``/metrics`` series to this OTLP/gRPC collector (None:
    #: only when a standard ``OTEL_EXPORTER_OTLP_*ENDPOINT`` variable is set; see
    #: :mod:`traceml_aggregator.otlp`).
    otlp_endpoint: str | None = None
    #: Seconds between two OTLP pushes: ``TRACEML_OTLP_INTERVAL_SEC``.
    otlp_interval_s: float = field(
        default_factory=lambda: settings.read(settings.OTLP_INTERVAL_SEC)
    )
    #: Serve the dashboard (:mod:`traceml_aggregator.dashboard`) on this port of ``bind_host``
    #: (None: off).
    dashboard_port: int | None = None
    #: Seconds between two checkpoints of the live aggregates (see
    #: :mod:`traceml_aggregator.checkpoint`): ``TRACEML_AGGREGATOR_CHECKPOINT_SEC``.
    checkpoint_interval_s: float = field(
        default_factory=lambda: settings.read(settings.AGGREGATOR_CHECKPOINT_SEC)
    )
    #: ``--keep-all-steps``: no retention, the store keeps every step and sample row (see
    #: :mod:`traceml_aggregator.retention`).
    keep_all_steps: bool = settings.KEEP_ALL_STEPS.value
    #: What the store keeps of the steps and samples otherwise: the ``TRACEML_STORE_*`` knobs.
    retention: Policy = field(default_factory=Policy.from_settings)
    #: Node 0's budget of messages a second, past which it paces its senders (see
    #: :mod:`traceml_aggregator.pace`): ``TRACEML_AGGREGATOR_MESSAGES_PER_SEC``.
    messages_per_s: float = field(
        default_factory=lambda: settings.read(settings.AGGREGATOR_MESSAGES_PER_SEC)
    )

    @property
    def tls(self) -> tuple[Path, Path] | None:
        """``(cert, key)`` when the aggregator serves TLS (gRPC, the dashboard and
        ``/metrics`` alike), else None."""
        return (self.tls_cert, self.tls_key) if self.tls_cert is not None else None


def record_restart(store: Store, reason: str, down_since_unix_s: float) -> dict:
    """Append one restart to the store's :data:`~traceml_aggregator.store.RESTARTS_META_KEY`
    entry, a JSON list of ``{"reason": str, "gap_s": float, "restarted_unix_s": float}`` (gap:
    s from the death the launcher saw to this replacement serving); returns the entry."""
    now = time.time()
    entry = AggregatorRestart(
        reason=reason,
        gap_s=round(max(0.0, now - down_since_unix_s), 3),
        restarted_unix_s=round(now, 3),
    ).to_json()
    restarts = json.loads(store.meta().get(RESTARTS_META_KEY) or "[]")
    store.set_meta(RESTARTS_META_KEY, json.dumps(restarts + [entry]))
    return entry


def record_loss(store: Store, reason: str, lost_unix_s: float) -> dict:
    """Set the store's :data:`~traceml_aggregator.store.LOSS_META_KEY` entry: node 0's
    aggregator was lost for good (``reason``, one line) at ``lost_unix_s`` (Unix s); returns
    the entry, ``{"reason": str, "lost_unix_s": float}``."""
    entry = AggregatorLoss(reason=reason, lost_unix_s=round(lost_unix_s, 3)).to_json()
    store.set_meta(LOSS_META_KEY, json.dumps(entry))
    return entry


def restore(live: LiveAggregates, store: Store) -> tuple[Checkpoint, StepReplay]:
    """Start seeding ``live`` from what ``store`` holds, from its latest checkpoint on
    (:meth:`LiveAggregates.restore`), and say how long it took and how many stored steps are
    left to fold in (when the store held steps); returns the checkpoint the next ones start
    from and those steps."""
    started = time.monotonic()
    checkpoint, replay = live.restore(store, read_checkpoint(store))
    meta = store.meta()
    marks = [PRUNED_META_KEY, *(sample_meta_keys(r.TABLE)[0] for r in SAMPLES)]
    if not checkpoint.steps_from and any(meta.get(key) for key in marks):
        _log.warning(
            "the store's step and sample rows were pruned (retention) and no checkpoint of "
            "the live aggregates could be read: the summary covers the kept rows only (a "
            "sample)"
        )
    if store.steps_rowid:
        _log.info(
            f"live aggregates restored in {time.monotonic() - started:.2f} s: "
            f"{replay.upto - replay.after} stored steps after the checkpoint to fold in"
        )
    return checkpoint, replay


class AggregatorService(wire.AggregatorServicer):
    """The servicer: validates the run name, hands batches to the writer, acknowledges."""

    def __init__(
        self,
        config: ServerConfig,
        writer: Writer,
        state: RunState,
        finalizer,
        rejections,
        live: LiveAggregates,
        streams: StreamLedger,
        script_world: ScriptWorld | None = None,
    ):
        self.config = config
        self.script_world = script_world or ScriptWorld()
        self.streams = streams
        self.writer = writer
        self.live = live
        self._live_rows = LiveRows()
        self.state = state
        self.finalizer = finalizer
        self.rejections = rejections
        #: Node relays' ``Relay`` calls opened, and the ``RelayUp`` messages they carried.
        self.relay_calls = self.relay_messages = 0
        #: The flush interval every Ack asks for, from the Stream and Relay calls open.
        self.pace = FlushPace(config.messages_per_s, NODE_LOST_AFTER_S, writer.pace)
        #: ``(NodeExit, received µs)`` of node exits the store could not commit yet (the
        #: summary's commit tries them again).
        self.unstored_exits: list[tuple] = []
        store = writer.store
        self.sessions = NodeSessions(
            NodeRegistry(
                own_host=socket.gethostname(),
                nnodes=config.nnodes,
                master_port=config.master_port,
            ),
            store_exit=self._store_node_exit,
            finalize=self._finalize,
            persist=self._persist_meta,
            foreign=self._foreign,
            refuse=rejections.refuse,
            give_up_on=state.give_up_on,
            losses=json.loads(store.meta().get(NODE_LOSSES_META_KEY) or "[]"),
            clocks=json.loads(store.meta().get(NODE_CLOCKS_META_KEY) or "[]"),
        )
        if config.restart_reason and config.nnodes:  # the nodes that were in the run go on
            self.sessions.expect(set(range(config.nnodes)) - state.exited_nodes.keys())

    def _foreign(self, run_name: str) -> str:
        if run_name != self.config.run_name:
            return self.rejections.refuse(
                "foreign_run",
                f"run name {run_name!r}: this aggregator's is {self.config.run_name!r}",
            )
        return ""

    async def _ingest(self, request, context, on_stream: bool):
        """Check ``request`` (a Batch), store it, and return its Ack (:meth:`_admit`, then
        :meth:`_answer`)."""
        admitted = await self._admit(request, context, on_stream)
        if isinstance(admitted, wire.Ack):
            return admitted
        return await self._answer(request, admitted, context, on_stream)

    async def _admit(self, request, context, on_stream: bool):
        """Check ``request`` (a Batch, :meth:`_refusal`) and queue it with the writer: the
        writer's future of its :class:`~traceml_aggregator.writer.WriteResult`, or its Ack now
        (refused; on a stream, pushed back by a full queue). It suspends only to adopt the
        script's own world (once a run) and to abort a Push pushed back (see
        :meth:`_pushed_back`)."""
        refused = await self._refusal(request)
        if refused is not None:
            return refused
        try:
            return self.writer.queue_batch(request)
        except QueueFull as exc:
            return await self._pushed_back(exc, context, on_stream)

    async def _refusal(self, request):
        """The Ack refusing ``request`` (a Batch of another run, a sequence number below 1, a
        batch :func:`~traceml_aggregator.senders.check_batch` refuses), counted; None when it
        may be queued. It suspends only to adopt the script's own world (once a run)."""
        reason = self._foreign(request.run_name)
        if reason:
            return wire.Ack(rejected=True, reason=reason)
        if request.seq < 1:
            reason = self.rejections.refuse("bad_sequence", "sequence numbers start at 1")
            return wire.Ack(rejected=True, reason=reason)
        refusal, adopt = self.script_world.check(request, self.state.world_size)
        if adopt:
            await self._adopt_script_world(request.identity)
        refusal = refusal or check_batch(request, self.state.world_size, self.config.nnodes)
        if refusal is not None:
            return wire.Ack(rejected=True, reason=self.rejections.refuse(*refusal))
        return None

    async def _pushed_back(self, exc: QueueFull, context, on_stream: bool):
        """A full writer queue's answer: on a stream an Ack carrying ``retry_after_ms``
        (:func:`push_back`); a Push is aborted with ``RESOURCE_EXHAUSTED`` and the retry-after
        in trailing metadata."""
        if on_stream:
            return push_back(exc)
        await context.abort(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"the aggregator is behind: {exc}; send again later",
            trailing_metadata=((RETRY_AFTER_METADATA_KEY, str(RETRY_AFTER_MS)),),
        )

    async def _answer(self, request, stored: asyncio.Future, context, on_stream: bool):
        """The Ack of ``request`` once the writer's future ``stored`` is done (see
        :meth:`_stored`)."""
        result = await self._stored(stored, context)
        if isinstance(result, QueueFull):
            return await self._pushed_back(result, context, on_stream)
        return self._ack(request, result)

    @staticmethod
    async def _stored(stored: asyncio.Future, context):
        """What the writer's future ``stored`` came to: its result, or the
        :class:`~traceml_aggregator.writer.QueueFull` of a batch (a relay message) that waited
        too long, or whose store failed to commit (a full disk); an error of the writer itself
        (a bug) aborts the call (``UNAVAILABLE``)."""
        try:
            return await stored
        except QueueFull as exc:
            return exc
        except Exception as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"writer error: {exc}")

    def _ack(self, request, result: WriteResult):
        """The Ack of ``request`` (a Batch) that the writer's ``result`` answers; a refusal and
        values dropped are counted."""
        if result.rejected:  # a refusal of this batch alone names the batch's own seq
            return wire.Ack(
                rejected=True,
                reason=self.rejections.refuse(result.kind, result.rejected),
                stored_seq=request.seq if result.kind in BATCH_ONLY else 0,
            )
        if result.values_dropped:
            sender = request.WhichOneof("sender") or "rank"
            self.rejections.refuse(
                "value_out_of_range",
                f"{result.values_dropped} values above {STORE_INT_MAX} (2**63 - 1) in a batch "
                f"of {sender.replace('_', ' ')} {getattr(request, sender)}: dropped, the rest "
                "of the batch stored",
                result.values_dropped,
            )
        return wire.Ack(stored_seq=result.stored_seq, flush_interval_ms=self.pace.ms)

    async def _adopt_script_world(self, identity) -> None:
        """Make the script's own process group of ``identity`` the run's world (see
        :mod:`traceml_aggregator.script_world`): its size is the run's from now on, here, in
        the live aggregates and in the store."""
        record = self.script_world.adopt(identity, self.state.world_size)
        self.state.world_size = self.live.world_size = record["world_size"]
        await self.writer.call(store_record, self.writer.store, record)

    async def Push(self, request, context):
        return await self._ingest(request, context, on_stream=False)

    async def Stream(self, request_iterator, context):
        """One sender's stream: an Ack per batch, in order, once it is stored. How the stream
        ended goes to :attr:`streams` (see :mod:`traceml_aggregator.streams`): closed after
        the sender's ``closing`` message, lost otherwise (a dead peer's connection also ends
        the request stream, so only that message tells a clean end)."""
        stream = SenderStream(self.streams)
        self.pace.opened()
        try:
            async for batch in request_iterator:
                ack = await self._stream_batch(stream, batch, context)
                if ack is not None:
                    yield ack
        finally:  # also when cancelled: by the sender, a reset, or a keepalive timeout
            self.pace.closed()
            stream.end()

    async def _stream_batch(self, stream: SenderStream, batch, context):
        """What a sender's stream answers ``batch``: its Ack, or None for a ``closing``."""
        if batch.closing:
            stream.closing()
            return None
        ack = await self._ingest(batch, context, on_stream=True)
        stream.answered(batch, ack)
        return ack

    async def Relay(self, request_iterator, context):
        """A node relay's call: its local senders' streams as channels (``RelayFrame``), each
        stored and acknowledged as :meth:`Stream` does. The batches of one ``RelayUp`` are
        checked and queued in one pass, in order (the writer stores them in one transaction);
        its one ``RelayDown`` carries their Acks once all are answered. A channel whose
        ``ended`` frame came, or every channel when the call ends (the relay's node lost, or
        its launcher gone), leaves the ledger as a stream would: closed after its ``closing``,
        lost otherwise. A ``RelayUp`` that carries its node's heartbeat hears the node at once
        (:meth:`~traceml_aggregator.sessions.NodeSessions.relayed_heartbeat`), and its
        ``RelayDown`` answers the clock exchange."""
        channels: dict[int, SenderStream] = {}
        self.relay_calls += 1
        self.pace.opened()
        try:
            async for up in request_iterator:
                received_ns = time.time_ns()  # t1 of a carried heartbeat's clock exchange
                self.relay_messages += 1
                echo = (
                    self.sessions.relayed_heartbeat(up.node_rank, up.heartbeat, received_ns)
                    if up.HasField("heartbeat")
                    else None
                )
                down = wire.RelayDown()
                await self._relay_up(channels, up.frames, context, down.acks)
                if echo is not None:
                    echo.answered_unix_ns = time.time_ns()
                    down.clock.CopyFrom(echo)
                yield down
        finally:
            self.pace.closed()
            for stream in channels.values():
                stream.end()

    async def _relay_up(self, channels: dict[int, SenderStream], frames, context, acks) -> None:
        """Add the RelayAcks of one ``RelayUp``'s ``frames`` to ``acks`` (its ``RelayDown``'s,
        built in place: a RelayAck made apart is copied in), in one pass (no task, no future and
        no wake-up of the writer per channel: a ``RelayUp`` carries a node's every sender):
        each batch is checked in frame order, and those not refused are queued with the writer
        as one item (:meth:`~traceml_aggregator.writer.Writer.queue_batches`, one future). A
        channel's frames after a batch the writer took are answered, in order, once it stored
        the message; its other frames (a refusal, a push-back, a ``closing``, an ``ended``)
        at once, so a call cancelled while the writer is behind loses no stream's clean end.
        A message queued when the call is cancelled stays queued, unanswered, as a Stream's
        batch would; a store that cannot commit pushes its batches back, as a full queue
        does."""
        checked: list[tuple] = []  # (frame, its Ack, or its index among the batches to queue)
        batches: list = []
        for frame in frames:
            answer = None
            if not (frame.ended or frame.batch.closing):
                answer = await self._refusal(frame.batch)
                if answer is None:
                    answer = len(batches)
                    batches.append(frame.batch)
            checked.append((frame, answer))
        stored, refused = self.writer.queue_batches(batches) if batches else (None, {})
        later: list[tuple] = []  # (frame, its answer), behind a batch of its channel taken
        waiting: set[int] = set()  # channels with a batch the writer took
        for frame, answer in checked:
            if isinstance(answer, int) and answer in refused:
                answer = PUSHED_BACK
            if frame.channel in waiting or isinstance(answer, int):
                waiting.add(frame.channel)
                later.append((frame, answer))
            else:
                self._relay_answered(channels, frame, answer, acks)
        if stored is not None:
            results = await self._stored(stored, context)  # a QueueFull: each pushed back
            pushed = push_back(results) if isinstance(results, QueueFull) else PUSHED_BACK
            taken = iter(() if isinstance(results, QueueFull) else results)
            for frame, answer in later:
                if isinstance(answer, int):
                    result = next(taken, None)
                    answer = pushed if result is None else self._ack(frame.batch, result)
                self._relay_answered(channels, frame, answer, acks)

    def _relay_answered(self, channels: dict[int, SenderStream], frame, answer, acks) -> None:
        """Take ``frame`` (a RelayFrame) into its channel's stream: ``ended`` ends it,
        ``closing`` marks it closing, a batch's ``answer`` (its Ack) goes to the ledger and to
        ``acks`` (a RelayDown's)."""
        stream = channels.get(frame.channel)
        if stream is None:
            stream = channels[frame.channel] = SenderStream(self.streams)
        if frame.ended:
            channels.pop(frame.channel).end()
        elif frame.batch.closing:
            stream.closing()
        else:
            stream.answered(frame.batch, answer)
            acks.add(channel=frame.channel, ack=answer)

    def _node_exit_refusal(self, report) -> str:
        """Why ``report`` (a NodeExit) cannot be this run's, counted; "" when it can."""
        nnodes, world_size = self.config.nnodes, self.state.world_size
        if nnodes is not None and report.node_rank >= nnodes:
            return self.rejections.refuse(
                "node_rank_out_of_range",
                f"the exit of node {report.node_rank}: the run has {nnodes} nodes",
            )
        for end in report.ranks:
            if world_size is not None and end.rank >= world_size:
                return self.rejections.refuse(
                    "rank_out_of_range",
                    f"node {report.node_rank}'s exit report of rank {end.rank}: world size "
                    f"is {world_size}",
                )
        return ""

    async def _store_node_exit(self, report) -> str:
        """Take a node's exit (``ReportNodeExit``, or a node session's) and store it; the
        refusal, or "". One the store cannot commit (a full disk) is counted all the same
        (logged), so that finalization does not wait for finish markers the store cannot
        take, and kept in :attr:`unstored_exits` for the summary's commit (an aggregator
        restarted before it never learns it)."""
        reason = self._foreign(report.run_name) or self._node_exit_refusal(report)
        if reason:
            return reason
        self.state.on_node_exit(report)
        self.live.on_node_exit(report)
        if never_started := _never_started(report):  # the static rendezvous cannot complete
            self.sessions.fail_run(never_started)
        received_unix_us = time.time_ns() // 1000
        try:
            await self.writer.call(self.writer.store.write_node_exit, report, received_unix_us)
        except (sqlite3.Error, OSError) as exc:
            self.unstored_exits.append((report, received_unix_us))
            _log.warning(
                f"warning: node {report.node_rank}'s exit is not stored yet ({type(exc).__name__}"
                f": {exc}); this aggregator counts its ranks done"
            )
        return ""

    async def _persist_meta(self, key: str, value) -> None:
        await self.writer.call(self.writer.store.set_meta, key, json.dumps(value))

    async def ReportNodeExit(self, request, context):
        reason = await self._store_node_exit(request)
        if reason:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, reason)
        return wire.NodeExitAck()

    async def NodeSession(self, request_iterator, context):
        await self.sessions.serve(context)

    async def Finalize(self, request, context):
        reason = self._foreign(request.run_name)
        if reason:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, reason)
        return await self._finalize(request)

    async def _finalize(self, request):
        """Finalize within ``request.timeout_s``; the FinalizeReply (Finalize, or a node
        session's request)."""
        return finalize_reply(await self.finalizer.finalize(request.timeout_s))

    async def Summarize(self, request, context):
        reason = self._foreign(request.run_name)
        if reason:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, reason)

        try:
            await self.writer.drain(SUMMARIZE_DRAIN_S)
            rows = self._live_rows if request.with_ranks else None
            return summarize_reply(await self.live.summary(), self.live, rows)
        except Exception as exc:  # an analysis bug must not take the aggregator down
            return wire.SummarizeReply(error=f"{type(exc).__name__}: {exc}")


def push_back(exc: QueueFull):
    """The Ack that pushes a stream's batch back for ``exc``: ``retry_after_ms``, and for a
    store that failed (:class:`~traceml_aggregator.writer.StoreFailed`) why, in ``reason``
    (a closing sender then stops waiting: its batches would not be stored either)."""
    if isinstance(exc, StoreFailed):
        return wire.Ack(retry_after_ms=RETRY_AFTER_MS, reason=str(exc))
    return PUSHED_BACK


def finalize_reply(outcome: Outcome):
    """The FinalizeReply that tells a launcher what a finalization (or the watchdog's partial
    summary) wrote."""
    return wire.FinalizeReply(
        complete=not outcome.missing,
        missing_ranks=outcome.missing,
        summary_json_path=str(outcome.json_path or ""),
        summary_text_path=str(outcome.text_path or ""),
        summary_html_path=str(outcome.html_path or ""),
        summary_text=outcome.text,
        error=outcome.error,
        run_status=outcome.run_status,
    )


def publish_stall(sessions: NodeSessions, record: dict | None) -> None:
    """Push the run's stall record (None: the stall is over) down every node session."""
    notice = wire.StallNotice(record_json=json.dumps(record) if record else "")
    sessions.publish(wire.NodeDown(stall=notice))


def grpc_server(
    run_token: str,
    rejections: Rejections,
    max_concurrent_rpcs: int = settings.MAX_CONCURRENT_RPCS.value,
) -> grpc.aio.Server:
    """The aggregator's ``grpc.aio`` server, no service or port added yet: the run token
    checked on every call (:class:`~traceml_aggregator.auth.TokenInterceptor`, refusals counted
    in ``rejections``), at most ``max_concurrent_rpcs`` calls in flight, as many waiting to be
    served, the wire's message bounds and keepalive policy
    (:func:`~traceml.core.transport.server_options`), and the port never shared
    (``so_reuseport`` 0: a second aggregator on it must fail to bind).

    Calls waiting to be served: ``grpc.aio`` takes the calls gRPC's core received one at a time,
    on the event loop, and the core drops some of the calls that arrive while more than
    ``grpc.server.max_pending_requests`` wait (1,000 by default), every one beyond its hard
    limit (3,000), without a status: the client sees CANCELLED, or INTERNAL from its next
    write. A start of 1,000 node relays opens ~2,000 calls within a second (each relay and
    session); at the defaults a tenth of them failed and went again (docs/scale.md, "A burst of
    calls"; ``tests/test_connect_burst.py``). Both bounds are ``max_concurrent_rpcs`` instead,
    the number of calls the server takes in flight anyway."""
    pending = [
        ("grpc.server.max_pending_requests", max_concurrent_rpcs),
        ("grpc.server.max_pending_requests_hard_limit", max_concurrent_rpcs),
    ]
    return grpc.aio.server(
        interceptors=[TokenInterceptor(run_token, rejections)],
        maximum_concurrent_rpcs=max_concurrent_rpcs,
        options=[("grpc.so_reuseport", 0), *pending, *server_options()],
    )


def raise_open_files_limit() -> tuple[int, int]:
    """Raise this process's open-files soft limit (``RLIMIT_NOFILE``) to its hard limit, as
    far as the kernel allows (each sender's connection is a descriptor; the usual soft limit of
    1,024 would refuse senders beyond ~1,000). Returns the ``(soft, hard)`` limits now."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else 1 << 20
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            pass  # the limit stays as it was; the aggregator serves what it can
    return resource.getrlimit(resource.RLIMIT_NOFILE)


class BindError(RuntimeError):
    """The aggregator could not listen on its host:port (in use, or no such address)."""


class Aggregator:
    """Node 0's aggregator wired, not yet serving: its store, run state, hang watch, live
    aggregates, stream ledger, writer, checkpointer, retention and refusal counts, restored
    from what an earlier aggregator of the run stored, with the finalizer and the gRPC
    service (:class:`AggregatorService`) over them. :func:`serve` binds it to its ports and
    runs its tasks; ``benchmarks/node0_cost.py`` drives its service in one process, without
    gRPC. Opens (and creates) the run's store; nothing runs until :func:`serve` starts it.

    Raises:
        sqlite3.Error, StoreVersionError: the run's store cannot be opened.
    """

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.store = store = Store(config.run_dir / DATABASE_NAME)
        store.set_meta("run_name", config.run_name)
        script_world = ScriptWorld.restore(store.meta())  # adopted by an earlier aggregator
        world_size = script_world.world_size(config.world_size)
        if world_size:
            store.set_meta("world_size", str(world_size))
        self.state = RunState(world_size=world_size, nnodes=config.nnodes)
        self.state.restore(store)  # what an aggregator of this run stored before this one
        self.hangs = HangWatch(
            config.hang_timeout_s, self.state.is_done, RunDir(config.run_dir, 0).stall_file
        )
        stall = store.meta().get(STALL_META_KEY)
        self.hangs.restore(json.loads(stall) if stall else None)  # an earlier one's stall
        self.live = LiveAggregates(config.run_name, world_size)
        self.streams = StreamLedger()
        self.streams.restore(store.meta().get(STREAMS_META_KEY))
        # After a restart, what the earlier aggregator stored: the checkpoint now, the steps
        # stored after it once serving (LiveAggregates.catch_up, in serve).
        checkpoint, self.replay = restore(self.live, store)
        self.writer = Writer(store, self._on_stored, config.max_queued_bytes)
        self.checkpointer = Checkpointer(checkpoint, self.live, self.writer)
        self.retention = None if config.keep_all_steps else Retention(store, config.retention)
        self.rejections = Rejections()
        self._run_records_failing = False  # the last store of them failed (said once)
        self.rejections.restore(
            store.meta().get(REJECTED_META_KEY), store.meta().get(REJECTED_REASONS_META_KEY)
        )
        self.finalizer = Finalizer(
            self.state, self.writer, self._reports, config.finalize_timeout_s, self._final_steps
        )
        self.service = AggregatorService(
            config,
            self.writer,
            self.state,
            self.finalizer,
            self.rejections,
            self.live,
            self.streams,
            script_world,
        )
        self.finalizer.on_partial = self._publish_partial
        self.finalizer.before_reports = lambda: self.service.sessions.lose_unreported(
            self.state.exited_nodes
        )
        if self.hangs.record is not None:  # an earlier one's stall: heard as sessions open
            publish_stall(self.service.sessions, self.hangs.record)
        #: This run's aggregator restarts so far (RESTARTS_META_KEY's entries).
        self.restarts: list[dict] = json.loads(store.meta().get(RESTARTS_META_KEY) or "[]")
        self.live.run_records = lambda: {
            "stall": self.hangs.record,
            "node_losses": list(self.service.sessions.losses),
            "node_clocks": self.service.sessions.clock_records(),
            "rejected": dict(self.rejections.counts),
            "rejected_reasons": dict(self.rejections.reasons),
            "aggregator_restarts": list(self.restarts),
            "script_world": script_world.record,
        }

    def _on_stored(self, batch, groups: list[tuple]) -> None:
        """The writer's hook after each committed batch (see :class:`Writer`)."""
        self.state.on_batch(batch)
        self.hangs.on_batch(batch)
        self.live.on_batch(batch, groups)

    def _write_run_records(self, store: Store) -> None:
        """The refusal counts and the stream ledger into ``store`` (on the writer thread:
        copies taken now, each in one step, while the event loop may change them)."""
        counts, reasons = dict(self.rejections.counts), dict(self.rejections.reasons)
        store.set_meta(REJECTED_META_KEY, json.dumps(counts, sort_keys=True))
        store.set_meta(REJECTED_REASONS_META_KEY, json.dumps(reasons, sort_keys=True))
        store.set_meta(STREAMS_META_KEY, self.streams.to_json())

    async def store_run_records(self) -> bool:
        """:meth:`_write_run_records` on the writer thread; False when the store failed (a
        full disk: said once while the failures last)."""
        try:
            await self.writer.call(self._write_run_records, self.store)
        except Exception as exc:
            if not self._run_records_failing:
                _log.warning(f"cannot store the stream ledger and refusal counts: {exc}")
            self._run_records_failing = True
            return False
        self._run_records_failing = False
        return True

    async def keep_run_records(self) -> None:
        """Store them every :data:`RUN_RECORDS_PERSIST_S` when they changed (again at the
        next check after a failed write); runs until cancelled."""
        written = (self.streams.changes, self.rejections.total)
        while True:
            await asyncio.sleep(RUN_RECORDS_PERSIST_S)
            now = (self.streams.changes, self.rejections.total)
            if now != written and await self.store_run_records():
                written = now

    async def persist_stall(self, record: dict | None) -> None:
        """Store the stall record (None: the stall is over), then push it to the node
        sessions."""
        if record is None:
            await self.writer.call(self.store.delete_meta, STALL_META_KEY)
        else:
            await self.writer.call(self.store.set_meta, STALL_META_KEY, json.dumps(record))
        publish_stall(self.service.sessions, record)

    def _reports(self, store: Store, missing, steps, deadline):
        from traceml_aggregator.reports import Unstored, write_reports

        disk_reserve.release(RunDir(self.config.run_dir, 0).disk_reserve)  # room on a full disk
        unstored = Unstored(list(self.service.unstored_exits))
        if self.writer.store_failure is not None:  # the summary says what it lacks
            since, error = self.writer.store_failure
            unstored.loss = AggregatorLoss(f"its store failed to commit: {error}", round(since, 3))
        try:
            for report, received_unix_us in unstored.node_exits:
                store.write_node_exit(report, received_unix_us)
                self.service.unstored_exits.remove((report, received_unix_us))
            self._write_run_records(store)
            if unstored.loss is not None:
                record_loss(store, unstored.loss.reason, unstored.loss.lost_unix_s)
        except (sqlite3.Error, OSError) as exc:  # the summary is told them all the same
            _log.warning(f"cannot store the node exits, stream ledger and refusal counts: {exc}")
        return write_reports(
            store,
            self.config.run_dir,
            missing,
            html=self.config.html_report,
            steps=steps,
            samples=self.checkpointer.checkpoint,
            deadline=deadline,
            unstored=unstored,
        )

    async def _final_steps(self) -> dict[int, tuple]:
        """The final summary's steps, once every stored step is folded in."""
        await self.live.caught_up()
        return self.live.final_steps()

    def _publish_partial(self, outcome: Outcome) -> None:
        """Push the watchdog's partial summary down every node session (its paths and missing
        ranks; not its text, which no launcher prints while training runs)."""
        reply = finalize_reply(outcome)
        reply.summary_text = ""
        self.service.sessions.publish(wire.NodeDown(partial_summary=reply))


async def serve(config: ServerConfig, ready=None) -> int:
    """Run the aggregator until SIGTERM/SIGINT; returns the process exit code.

    Args:
        config: the server's options.
        ready: optional callback with the bound port once the server is SERVING.

    Raises:
        BindError: the port cannot be bound.
    """
    raise_open_files_limit()
    aggregator = Aggregator(config)
    store, writer, live = aggregator.store, aggregator.writer, aggregator.live
    service, finalizer = aggregator.service, aggregator.finalizer
    checkpointer, retention = aggregator.checkpointer, aggregator.retention
    server = grpc_server(config.run_token, aggregator.rejections, config.max_concurrent_rpcs)
    wire.add_AggregatorServicer_to_server(service, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    address = endpoint.target(config.bind_host, config.port)
    try:
        if config.tls_cert is not None:
            port = server.add_secure_port(
                address, server_credentials(config.tls_cert, config.tls_key)
            )
        else:
            port = server.add_insecure_port(address)
    except RuntimeError as exc:
        raise BindError(f"cannot listen on {address}: {exc}") from exc
    if port == 0:
        raise BindError(f"cannot listen on {address} (port in use or address not local)")
    metrics_server = None
    if config.metrics_port is not None:
        from traceml_aggregator.metrics import MetricsServer

        where = endpoint.target(config.metrics_bind_host, config.metrics_port)
        try:
            metrics_server = MetricsServer(
                live,
                asyncio.get_running_loop(),
                config.metrics_bind_host,
                config.metrics_port,
                config.run_token,
                config.tls,
            ).start()
        except OSError as exc:  # ssl.SSLError included
            raise BindError(f"cannot serve /metrics on {where}: {exc}") from exc
        _log.info(
            f"/metrics on {'https' if config.tls else 'http'}://{where}/metrics (bearer: the run "
            "token)"
        )
    otlp_push = _otlp_push(config, live)
    dashboard = None
    if config.dashboard_port is not None:
        from traceml_aggregator.dashboard import app as dashboard_app
        from traceml_aggregator.dashboard.sources import LiveSource

        url = endpoint.dashboard_url(config.bind_host, config.dashboard_port, bool(config.tls))
        link_file = config.run_dir / DASHBOARD_LINK_FILE_NAME
        try:
            tls = server_ssl_context(*config.tls) if config.tls else None
            dashboard = await dashboard_app.start(
                LiveSource(live), config.bind_host, config.dashboard_port, config.run_token, tls
            )
            dashboard_app.write_link(link_file, url, config.run_token)
        except OSError as exc:  # ssl.SSLError included
            raise BindError(
                "cannot serve the dashboard on "
                f"{endpoint.target(config.bind_host, config.dashboard_port)}: {exc}"
            ) from exc
        _log.info(
            f"dashboard on {url}: open the link in {link_file} (mode 0600: it holds the run token)"
        )
    writer.start()
    await server.start()
    if config.restart_reason:
        down_since = (
            config.down_since_unix_s if config.down_since_unix_s is not None else time.time()
        )
        entry = await writer.call(record_restart, store, config.restart_reason, down_since)
        aggregator.restarts.append(entry)
        _log.info(
            f"restarted on the run's store after {entry['gap_s']:g} s "
            f"without an aggregator ({config.restart_reason})"
        )
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    stop = asyncio.Event()
    # The steps stored after the checkpoint, folded in while serving: a replacement serves
    # in the same time whatever the run's length (the live views, the checkpoints, the
    # retention and the final summary wait for it; batches that come meanwhile are held).
    catching_up = asyncio.get_running_loop().create_task(live.catch_up(aggregator.replay, writer))

    def stop_if_failed(task: asyncio.Task) -> None:
        """A catch-up that failed (the store cannot be read) stops the aggregator (exit 1: the
        launcher starts another, as after a crash)."""
        if not task.cancelled() and task.exception() is not None:
            stop.set()

    catching_up.add_done_callback(stop_if_failed)
    watchdog = asyncio.get_running_loop().create_task(finalizer.watchdog())
    hang_watch = asyncio.get_running_loop().create_task(
        aggregator.hangs.run(aggregator.persist_stall, _log.warning)
    )
    node_watch = asyncio.get_running_loop().create_task(service.sessions.watch())
    records_keeper = asyncio.get_running_loop().create_task(aggregator.keep_run_records())
    checkpoints = asyncio.get_running_loop().create_task(
        checkpointer.run(config.checkpoint_interval_s)
    )
    pruning = None
    if retention is not None:
        pruning = asyncio.get_running_loop().create_task(
            run_retention(retention, checkpointer, live, config.checkpoint_interval_s)
        )
    if otlp_push is not None:
        otlp_push.start()
    if ready is not None:
        ready(port)
    # The analysis and report modules (~0.04 s) load once serving: neither on the way to
    # SERVING nor in the Finalize that the end of the run waits for.
    import traceml.report  # noqa: F401

    loop = asyncio.get_running_loop()
    if config.owned:
        _stop_at_stdin_eof(loop, stop)
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, _note_signal, sig)
    else:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
    # Off the event loop: a filesystem without fallocate has glibc write a byte a block.
    await asyncio.to_thread(disk_reserve.hold, RunDir(config.run_dir, 0).disk_reserve)
    with serving_heap() as collections:  # start-up is over: see traceml/core/heap.py
        await stop.wait()
    disk_reserve.release(RunDir(config.run_dir, 0).disk_reserve)  # the stop's last commits
    _log.info(f"{SERVING_TALLY}: {collections}")
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    watchdog.cancel()
    hang_watch.cancel()
    node_watch.cancel()
    records_keeper.cancel()
    checkpoints.cancel()
    if pruning is not None:
        pruning.cancel()
    await server.stop(grace=1.0)
    if metrics_server is not None:
        metrics_server.shutdown()
        metrics_server.server_close()
    if dashboard is not None:
        await dashboard.cleanup()
    await writer.drain(5.0)
    try:  # a stop during the catch-up waits for it: what follows needs every step folded in
        await catching_up
    except Exception as exc:  # the store cannot be read: nothing of the aggregates is kept
        _log.error(f"error: cannot fold in the steps stored before this aggregator: {exc}")
        exit_code = 1
    else:
        await _stop_with_aggregates(
            config, checkpointer, finalizer, otlp_push, retention, pruning, live
        )
        exit_code = 0
    await aggregator.store_run_records()  # the latest, also without reports
    await writer.close()
    live.close()
    _log.info(
        f"stored {aggregator.store.records_stored} records in {writer.batches_stored} batches; "
        f"{writer.batches_duplicate} resent batches were already stored"
    )
    _log.info(f"node relays: {service.relay_calls} calls carried {service.relay_messages} messages")
    refused_counts = sorted(aggregator.rejections.counts.items())
    refused = ", ".join(f"{k} {v}" for k, v in refused_counts) or "none"
    _log.info(
        f"refused calls: {refused}; {writer.batches_pushed_back} batches pushed back (writer "
        f"behind, or its store failing); queue peak {writer.peak_queued_bytes} bytes (bound "
        f"{writer.max_queued_bytes})"
    )
    return exit_code


async def _stop_with_aggregates(
    config: ServerConfig, checkpointer, finalizer, otlp_push, retention, pruning, live
) -> None:
    """At a stop, what needs the live aggregates with every stored step: the checkpoint a
    replacement (or ``--finalize-only``) starts from, the OTLP push's last figures, the
    summary at stop, and the retention's last prune."""
    try:  # a replacement (or --finalize-only) starts from here
        await checkpointer.write()
    except Exception as exc:
        _log.warning(f"cannot store the live aggregates' checkpoint: {exc}")
    if otlp_push is not None:  # the run's last figures, after its last batches
        await otlp_push.final()
    outcome = await finalizer.finalize_on_stop() if config.summary_at_stop else None
    if outcome is not None:
        _log.info(f"summary written at stop: {outcome.json_path or outcome.error}")
    # The rows the last checkpoint covers, once the summary is written (it reads none of them):
    # a store kept whole so far takes seconds a million rows, and a stop may be cut short.
    # The samples' held rows are their groups' last and stay (final).
    if pruning is not None and retention is not None:
        await asyncio.gather(pruning, return_exceptions=True)
        try:
            await retention.prune(checkpointer, live, final=True)
        except Exception as exc:
            _log.warning(f"retention: cannot prune the stored rows: {exc}")


def _otlp_push(config: ServerConfig, live: LiveAggregates):
    """The OTLP push of ``config`` (:class:`traceml_aggregator.otlp.OtlpPush`), or None: not
    asked for, or the ``otlp`` extra is not installed (one line says so)."""
    target = otlp.requested(config.otlp_endpoint)
    if target is None:
        return None
    missing = otlp.missing()
    if missing:
        _log.warning(missing)
        return None
    from traceml_aggregator.otlp import Options, OtlpPush

    _log.info(f"OTLP export to {target} every {config.otlp_interval_s:g} s")
    options = Options(config.otlp_endpoint or None, config.run_name)
    return OtlpPush(live, options, target, config.otlp_interval_s)


def _stop_at_stdin_eof(loop: asyncio.AbstractEventLoop, stop: asyncio.Event) -> None:
    """Set ``stop`` once standard input (the owning launcher's pipe) reaches end of file.

    The kernel closes the launcher's end when it exits, however it exits (SIGKILL included),
    so an owned aggregator never outlives its launcher.
    """

    def watch() -> None:
        try:
            while sys.stdin.buffer.read(65536):
                pass
        except (OSError, ValueError):
            pass
        loop.call_soon_threadsafe(stop.set)

    threading.Thread(target=watch, name="traceml-owner-watch", daemon=True).start()


def _note_signal(signum: int) -> None:
    """An owned aggregator's SIGTERM/SIGINT: said, not obeyed (its launcher stops it)."""
    _log.info(
        f"got {signal.Signals(signum).name}; serving on until the "
        "launcher that owns this process has finalized the run"
    )


def _never_started(report) -> str:
    """Why the run cannot rendezvous when ``report`` (a NodeExit) says its torchrun ended
    before it started a rank ("" when it started them): the other nodes' torchruns would wait
    for it in the static rendezvous until torch's timeout (15 min). When its launcher's signal
    stopped it there (scancel, Ctrl-C), the run was interrupted, and the reason says so as an
    interrupted rank's does (:func:`~traceml.core.ends.is_interrupted`)."""
    ranks = report.ranks
    if not ranks or any(r.end_state != wire.EndState.END_STATE_NOT_STARTED for r in ranks):
        return ""
    if is_interrupted(ranks[0].reason) and ranks[0].signal:
        stopped = interrupted_reason(signal_name(ranks[0].signal), report.node_rank)
        return f"{stopped} before its torchrun started its ranks"
    return (
        f"node {report.node_rank}'s torchrun ended before it started its ranks ({ranks[0].reason})"
    )


def _node_exit_report(path: Path, run_name: str):
    """The :class:`~traceml.wire.NodeExit` of run ``run_name`` in ``path`` (the launcher's
    ``--node-exit-file``); None, said in one warning, when it cannot be read, does not decode,
    or is none of this run's (an empty file decodes to an empty report): the summary is then
    written without it, its node's ranks missing, rather than not at all."""
    from google.protobuf.message import DecodeError

    try:
        report = wire.NodeExit.FromString(path.read_bytes())
    except (OSError, DecodeError) as exc:
        _log.warning(f"warning: --node-exit-file {path} left out: {type(exc).__name__}: {exc}")
        return None
    if report.run_name != run_name:
        _log.warning(
            f"warning: --node-exit-file {path} left out: not a node exit of run {run_name!r} "
            f"(run {report.run_name!r}; an empty file reads as none)"
        )
        return None
    return report


def finalize_offline(config: ServerConfig, node_exit_path: Path | None = None) -> int:
    """Write ``final_summary.*`` from the run's store alone, without serving (``--finalize-only``).

    The launcher runs this when its aggregator died and could not be restarted: everything
    acknowledged is in the store. ``node_exit_path`` holds the launcher's serialized
    :class:`~traceml.wire.NodeExit` (its ranks' end states), stored first (left out, with a
    warning, when it is not a node exit of this run), and
    ``config.lost_reason`` (``--lost-reason``) why the aggregator was lost, recorded with
    :func:`record_loss` (the summary's AGGREGATOR_LOST finding). Ranks that neither finished
    nor belong to a reported node are the summary's missing ranks.

    Returns:
        0 once the reports are written (their paths on stderr); 2, said in one line, when
        ``config.run_dir`` holds no store (nothing is created), the store is not a database,
        is damaged or another aggregator holds it
        (:func:`~traceml_aggregator.store.open_run_store`), or it records another run name
        than ``config.run_name``; 1 when the reports cannot be written otherwise.
    """
    from traceml_aggregator.reports import write_reports

    deadline = time.monotonic() + config.finalize_timeout_s
    try:
        store = open_run_store(config.run_dir)
        stored_name = store.meta().get("run_name", config.run_name)
    except StoreUnavailable as exc:
        return _refuse_finalize(str(exc))
    except sqlite3.DatabaseError as exc:  # the meta table's pages are damaged
        store.close()
        return _refuse_finalize(str(unreadable(store.path, exc)))
    if stored_name != config.run_name:
        store.close()
        return _refuse_finalize(
            f"{store.path} is the store of run {stored_name!r}, not of --run-name "
            f"{config.run_name!r}"
        )
    try:
        report = _node_exit_report(node_exit_path, config.run_name) if node_exit_path else None
        if report is not None:
            store.write_node_exit(report, time.time_ns() // 1000)
        if config.lost_reason:
            lost = config.lost_unix_s if config.lost_unix_s is not None else time.time()
            record_loss(store, config.lost_reason, lost)
        world_size = ScriptWorld.restore(store.meta()).world_size(config.world_size)
        state = RunState(world_size=world_size, nnodes=config.nnodes)
        state.restore(store)
        store.checkpoint()
        live = LiveAggregates(config.run_name, world_size)
        # the same aggregates and sample series, so the same summary, as the live aggregator's
        started = time.monotonic()
        checkpoint, replay = restore(live, store)
        live.replay(store, replay)
        _log.info(
            f"live aggregates seeded in {time.monotonic() - started:.2f} s: {replay.steps} "
            "stored steps after the checkpoint folded in"
        )
        steps = live.final_steps()
        # What the summary does not read goes before it is built: at 1,024 ranks ~400 MiB of
        # objects (the ranks' windows), so the finalization's peak is lower and its garbage
        # collections traverse less.
        del live
        outcome = write_reports(
            store,
            config.run_dir,
            state.missing(),
            html=config.html_report,
            steps=steps,
            samples=checkpoint,
            deadline=deadline,
        )
    except sqlite3.DatabaseError as exc:
        if not is_unreadable(exc):
            _log.error(f"error: no summary: {type(exc).__name__}: {exc}")
            return 1
        return _refuse_finalize(str(unreadable(store.path, exc)))
    except Exception as exc:
        _log.error(f"error: no summary: {type(exc).__name__}: {exc}")
        return 1
    finally:
        store.close()
    _log.info(f"summary written from the store: {outcome.json_path}")
    return 0


def _refuse_finalize(reason: str) -> int:
    """``--finalize-only``'s one-line refusal of a store (see :func:`finalize_offline`): 2."""
    _log.error(f"error: --finalize-only: {reason}: nothing to finalize")
    return 2
