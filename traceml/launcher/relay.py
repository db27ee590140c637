"""The node relay: this node's senders' streams, carried to node 0's aggregator on one call.

Every rank's SDK and the node sampler hold one ``Stream`` each (docs/wire.md). Under
``traceml run`` they hold it with their own launcher instead of node 0: :class:`NodeRelay`
serves ``Stream`` on an abstract Unix socket (``unix-abstract:traceml-relay-PID-RANDOM``,
exported to the ranks as ``TRACEML_RELAY``) and carries every local stream as a channel of one
``Relay`` call to node 0 (``RelayFrame``, service.proto). So node 0 holds one call per node,
not one per rank, and pays gRPC's per-message cost once per relay message, not once per batch.

Exactly once, end to end. The relay never acknowledges anything itself: node 0 answers each
batch after its commit, and the relay passes that Ack down to the rank that sent it. A rank
keeps every batch until it has its Ack (:mod:`traceml.sdk.client`), so the relay never holds
the only copy of anything: when the upstream call fails (node 0 restarted, partitioned, or
silent for ``TRACEML_RPC_TIMEOUT_SEC``), every local stream is failed with the upstream's
status, the ranks reopen theirs (their own backoff) and resend what was not acknowledged, and
node 0 stores it once (its (sender, attempt, seq) check). The relay tries node 0 again with the
first frame they send, on a new channel: it adds no wait to theirs.

Flow: one ``RelayUp`` is in flight at a time; what the local senders write meanwhile goes in
the next one. The node's senders flush on the same ticks (:func:`traceml.sdk.client.
flush_wait_s`), within a few ms of each other, so the relay gathers before it sends: a
``RelayUp`` goes once every open local stream has a frame waiting, or
:data:`RELAY_GATHER_S` after the oldest one came, whichever is first. A flush of the node's
ranks and sampler so crosses as one message, which node 0's writer stores in one transaction
(each sender's batches apart were a message each: node 0 pays gRPC per message). Node 0
answers each ``RelayUp`` with one ``RelayDown``.

Node 0's aggregator gone for good (it died and node 0's launcher will not restart it:
:meth:`NodeRelay.upstream_gone`): the relay ends every local stream with :data:`GONE_CODE`
and why, and refuses new ones so; its senders stop sending (nothing would be stored) rather
than keep their telemetry and wait at their exit for acknowledgements that cannot come.

Liveness: a local stream that ends is told to node 0 (``ended``): closed after its ``closing``
message, lost otherwise (the rank died: its socket is reset at once). When the relay's call
ends without that (the launcher was killed: torchrun and its ranks die with it), node 0 counts
every channel of it lost, as it counts a rank's own stream, and the node session
(:mod:`traceml.launcher.session`) reports the node lost as before. The relay carries the
session's heartbeats in its ``RelayUp``s when one is due (:meth:`NodeRelay.carry_heartbeats`),
so node 0 hears the node on the relay's call and the session's stream falls silent; node 0
answers each one's clock exchange in the ``RelayDown``.

Who may connect: an abstract socket has no file mode, so every local call must carry the run
token (compared in constant time); anything else is refused ``UNAUTHENTICATED``. The socket
disappears with the process: nothing is left behind by a SIGKILL.

Threads: one, running the relay's event loop (its ``grpc.aio`` server and the upstream call);
the launcher only starts and closes it. Fail-open: a relay that cannot start costs a warning,
and the ranks stream straight to node 0.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import threading
from dataclasses import dataclass

import grpc

from traceml import wire
from traceml.core import log
from traceml.core.threads import name_os_thread
from traceml.core.transport import (
    MAX_MESSAGE_BYTES,
    RELAY_GONE_CODE,
    RELAY_STATUS_PREFIX,
    TOKEN_METADATA_KEY,
    Credentials,
    call_metadata,
    open_aio_channel,
    same_token,
    server_options,
)

_log = log.get("launcher")

#: The gRPC service the relay serves locally (the aggregator's, its ``Stream`` method only).
SERVICE = "traceml.wire.v1.Aggregator"
#: The upstream channel's own connection to node 0: gRPC shares one per target in a process
#: by default, and the launcher's session holds one to node 0 whose reconnect backoff (gRPC's,
#: up to minutes) would then also delay the relay's new channel after an outage.
OWN_POOL = [("grpc.use_local_subchannel_pool", 1)]
#: Bound of one RelayUp's frames, bytes: what a backlog of frames (a node of many ranks, an
#: outage's resends) would add up to is sent over several messages, each within the wire's
#: message bound (:data:`~traceml.core.transport.MAX_MESSAGE_BYTES`); a frame larger than
#: this goes alone.
RELAY_UP_MAX_BYTES = MAX_MESSAGE_BYTES // 2
#: A frame's encoding beyond its fields: its tag and length prefix in the RelayUp, bytes.
FRAME_OVERHEAD_BYTES = 8
#: The local server takes messages of at most the wire's bound less this, bytes, so that the
#: largest one still fits the bound as a RelayUp's only frame: a larger one is refused
#: (``RESOURCE_EXHAUSTED``) to its sender alone, as node 0 would, never failing the relay's
#: call and with it every stream of the node.
FRAME_HEADROOM_BYTES = 1024
#: Longest a local stream's frame waits for the other local streams' before it goes up, s (see
#: the module): they flush on the same tick, so this bounds only a stream that sends off the
#: tick (a full batch, a resend, a first step) or whose node's others have nothing to send.
RELAY_GATHER_S = 0.05
#: Longest wait at :meth:`NodeRelay.close` for the local streams' last frames to reach node 0, s.
CLOSE_FLUSH_S = 1.0
#: The status every local stream ends with once node 0's aggregator is gone for good
#: (:meth:`NodeRelay.upstream_gone`): node 0's aggregator never sends it, so a sender tells
#: it from the relay's failures of the upstream (``UNAVAILABLE``: kept, sent again).
GONE_CODE = grpc.StatusCode[RELAY_GONE_CODE]
_DONE = object()  # a local stream's last answer: it half-closed and every Ack was passed down


@dataclass
class RelayStats:
    """What the relay carried (counts since it started)."""

    messages_up: int = 0  # RelayUp messages node 0 answered
    frames_up: int = 0  # frames in them
    heartbeats_answered: int = 0  # the node session's heartbeats in them that node 0 answered
    largest_up_bytes: int = 0  # the largest of them, serialized
    upstream_failures: int = 0  # upstream calls that failed (each failed its local streams)


class _Local:
    """One local sender's stream: its channel number, what it is owed, and its answers."""

    def __init__(self, channel: int) -> None:
        self.channel = channel
        self.answers: asyncio.Queue = asyncio.Queue()
        self.due = 0  # batches sent up whose Ack has not come down yet
        self.half_closed = False
        self.framed = False  # a frame of it was queued for node 0

    def deliver(self, ack) -> None:
        self.due -= 1
        self.answers.put_nowait(ack)
        self.done_if_owed_nothing()

    def done_if_owed_nothing(self) -> None:
        if self.half_closed and self.due <= 0:
            self.answers.put_nowait(_DONE)


class NodeRelay:
    """This node's relay (see the module docstring).

    Args:
        upstream: node 0's aggregator, ``host:port``.
        credentials: the run token (required: local calls must carry it) and TLS CA of the
            upstream channel.
        rpc_timeout_s: longest wait for node 0's answer to a ``RelayUp``, s; then the upstream
            call is cancelled and every local stream failed (``TRACEML_RPC_TIMEOUT_SEC``).

    Attributes:
        address: the local address ranks connect to (``unix-abstract:...``).
        stats: a :class:`RelayStats`, updated on the relay's thread.
        session: the node's :class:`~traceml.launcher.session.NodeSession` whose heartbeats
            the relay carries (:meth:`carry_heartbeats`), None: none.
    """

    def __init__(self, upstream: str, credentials: Credentials, rpc_timeout_s: float) -> None:
        if not credentials.token:
            raise ValueError("the node relay needs the run token")
        self.upstream = upstream
        self.address = f"unix-abstract:traceml-relay-{os.getpid()}-{secrets.token_hex(4)}"
        self.stats = RelayStats()
        self._credentials = credentials
        self._timeout_s = rpc_timeout_s
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready = threading.Event()
        self._start_error = ""
        self._stop: asyncio.Event | None = None
        self._wake: asyncio.Event | None = None
        self._locals: dict[int, _Local] = {}
        self._pending: list = []  # RelayFrames for the next RelayUp
        self._pending_since = 0.0  # when the oldest of them was queued (loop time)
        self._in_flight = False  # a RelayUp waits for its RelayDown
        self._next_channel = 1
        self._gone: tuple | None = None  # (GONE_CODE, why) once node 0's aggregator is gone
        self.session = None
        self.node_rank = 0

    # --- the launcher's thread -------------------------------------------------------------
    def start(self, timeout_s: float = 5.0) -> None:
        """Serve the local socket (returns once it listens).

        Raises:
            RuntimeError: it could not listen within ``timeout_s`` (the reason in the text).
        """
        self._thread = threading.Thread(target=self._main, name="traceml-relay", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout_s):
            raise RuntimeError(f"the node relay did not start within {timeout_s:g} s")
        if self._start_error:
            raise RuntimeError(self._start_error)

    def close(self, timeout_s: float = 2.0) -> None:
        """Stop serving (local streams end; their senders keep what was not acknowledged)
        and end the upstream call; returns within about ``timeout_s``."""
        loop, stop = self._loop, self._stop
        if loop is not None and stop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(stop.set)
            except RuntimeError:  # the loop closed meanwhile
                pass
        if self._thread is not None:
            self._thread.join(timeout_s)

    def upstream_gone(self, reason: str) -> None:
        """Node 0's aggregator is gone for good (``reason``; node 0's launcher will not
        restart it): every local stream, open or opened later, ends :data:`GONE_CODE` with
        why, and its sender sends no more (:mod:`traceml.sdk.client`) instead of keeping its
        telemetry and waiting at its exit for acknowledgements that cannot come."""
        why = f"node 0's aggregator is gone for good ({reason})"
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(self._go_dark, (GONE_CODE, why))
            except RuntimeError:  # the loop closed meanwhile
                pass

    def carry_heartbeats(self, session, node_rank: int) -> None:
        """From now on each ``RelayUp`` carries ``session``'s heartbeat (node ``node_rank``'s)
        when one is due (:meth:`~traceml.launcher.session.NodeSession.relay_heartbeat`), and
        node 0's answer to it goes back to the session: node 0 then hears the node on its
        relay's call, and the session's own stream stays silent but for what else it says."""
        self.node_rank, self.session = node_rank, session

    # --- the relay's thread ----------------------------------------------------------------
    def _main(self) -> None:
        name_os_thread()  # its CPU told apart in top -H (grpc.aio's poller thread inherits it)
        try:
            asyncio.run(self._serve())
        except Exception as exc:  # fail-open: the ranks' streams fail, training goes on
            self._start_error = self._start_error or f"{type(exc).__name__}: {exc}"
            _log.warning(f"warning: the node relay stopped ({self._start_error})")
        finally:
            self._ready.set()

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop, self._wake = asyncio.Event(), asyncio.Event()
        server = grpc.aio.server(
            options=server_options(max_receive_bytes=MAX_MESSAGE_BYTES - FRAME_HEADROOM_BYTES)
        )
        stream = grpc.stream_stream_rpc_method_handler(
            self._local_stream,
            request_deserializer=wire.Batch.FromString,
            response_serializer=wire.Ack.SerializeToString,
        )
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(SERVICE, {"Stream": stream}),)
        )
        try:
            server.add_insecure_port(self.address)
        except RuntimeError as exc:
            self._start_error = f"cannot listen on {self.address}: {exc}"
            raise
        await server.start()
        pump = asyncio.ensure_future(self._pump())
        pump.add_done_callback(_said_if_failed)
        self._ready.set()
        try:
            await self._stop.wait()
            await server.stop(grace=0.2)  # the local streams end (their senders are done)
            # What they wrote last (the sampler's closing, the channels' ends) goes up first.
            await asyncio.wait_for(self._flushed(), CLOSE_FLUSH_S)
        except asyncio.TimeoutError:
            pass
        finally:
            pump.cancel()
            await server.stop(None)

    async def _local_stream(self, requests, context):
        """One local sender's ``Stream``: its batches go up as frames of its channel, node 0's
        Acks come down in order; failed with the upstream's status when the upstream fails."""
        metadata = dict(context.invocation_metadata() or ())
        if not same_token(metadata.get(TOKEN_METADATA_KEY), self._credentials.token):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong run token")
        if self._gone is not None:
            await context.abort(*self._gone)
        local = _Local(self._next_channel)
        self._next_channel += 1
        self._locals[local.channel] = local
        reader = asyncio.ensure_future(self._read_local(local, requests))
        try:
            while (answer := await local.answers.get()) is not _DONE:
                if isinstance(answer, tuple):  # the upstream failed: (code, details)
                    await context.abort(*answer)
                yield answer
        finally:  # also when cancelled: the sender cancelled, or its process died
            reader.cancel()
            if self._locals.pop(local.channel, None) is not None and local.framed:
                self._queue(wire.RelayFrame(channel=local.channel, ended=True))

    async def _read_local(self, local: _Local, requests) -> None:
        """Queue the local stream's messages as frames of its channel; a message that cannot
        be read ends the stream (``INVALID_ARGUMENT``), as node 0 would end its own."""
        try:
            async for batch in requests:
                if not batch.closing:
                    local.due += 1
                local.framed = True
                self._queue(wire.RelayFrame(channel=local.channel, batch=batch))
        except Exception as exc:  # a message that is no Batch (gRPC's decode failed)
            reason = f"{RELAY_STATUS_PREFIX}unreadable message ({type(exc).__name__})"
            local.answers.put_nowait((grpc.StatusCode.INVALID_ARGUMENT, reason))
            return
        local.half_closed = True
        local.done_if_owed_nothing()

    async def _flushed(self) -> None:
        """Return once nothing is queued and no RelayUp is in flight."""
        while self._pending or self._in_flight:
            await asyncio.sleep(0.01)

    def _queue(self, frame) -> None:
        if not self._pending:
            self._pending_since = asyncio.get_running_loop().time()
        self._pending.append(frame)
        assert self._wake is not None
        self._wake.set()

    async def _gather(self) -> None:
        """Return once every open local stream has a frame pending, or :data:`RELAY_GATHER_S`
        after the oldest pending frame was queued, or at once when the relay stops."""
        assert self._wake is not None and self._stop is not None
        deadline = self._pending_since + RELAY_GATHER_S
        loop = asyncio.get_running_loop()
        while not self._stop.is_set() and (left := deadline - loop.time()) > 0:
            framed = {frame.channel for frame in self._pending}
            if all(c in framed for c, local in self._locals.items() if not local.half_closed):
                return
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), left)
            except asyncio.TimeoutError:
                return

    async def _pump(self) -> None:
        """Send what the local senders wrote, one ``RelayUp`` at a time, and pass node 0's
        Acks down. On any failure of the upstream call: fail every local stream and close the
        channel. The next attempt, on a new channel (one kept would wait out gRPC's own
        reconnect backoff, up to minutes, after node 0 is back), is made with the next frame:
        the senders back off before they reopen their streams (:mod:`traceml.sdk.client`), so
        the relay adds no wait of its own, which would stack on theirs."""
        assert self._wake is not None
        metadata = call_metadata(self._credentials.token)
        channel = call = None
        reached = True  # said once per outage
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                if self._gone is not None:
                    self._pending.clear()  # nowhere to send it: its senders were told
                if not self._pending:
                    continue
                await self._gather()
                frames = self._take_frames()
                self._in_flight = True
                try:
                    if call is None:
                        channel = open_aio_channel(self.upstream, self._credentials, OWN_POOL)
                        call = wire.AggregatorStub(channel).Relay(metadata=metadata)
                    up = wire.RelayUp(frames=frames)
                    session = self.session
                    beat = session.relay_heartbeat() if session is not None else None
                    if beat is not None:
                        up.heartbeat.CopyFrom(beat)
                        up.node_rank = self.node_rank
                    up_bytes = up.ByteSize()
                    down = await self._exchange(call, up)
                except Exception as exc:  # RpcError, TimeoutError, or the call's own end
                    failure = await _failure(exc, call, self._timeout_s)
                    if call is not None:
                        call.cancel()
                    if channel is not None:
                        await channel.close()
                    channel = call = None
                    if reached:
                        _log.warning(
                            "warning: the node relay lost node 0's aggregator at "
                            f"{self.upstream} ({failure[1]}); the ranks keep their telemetry "
                            "and resend it"
                        )
                    reached = False
                    self._fail_locals((failure[0], f"{RELAY_STATUS_PREFIX}{failure[1]}"))
                    if self.session is not None:
                        self.session.relay_lost()
                    continue
                finally:
                    self._in_flight = False
                if not reached:
                    _log.info(
                        f"the node relay reached node 0's aggregator at {self.upstream} again"
                    )
                reached = True
                self.stats.messages_up += 1
                self.stats.frames_up += len(frames)
                self.stats.largest_up_bytes = max(self.stats.largest_up_bytes, up_bytes)
                if down.HasField("clock") and session is not None:
                    self.stats.heartbeats_answered += 1
                    session.relay_answered(down.clock)
                if session is not None and (pace_s := _pace_s(down)) is not None:
                    session.paced(pace_s)
                for relay_ack in down.acks:
                    local = self._locals.get(relay_ack.channel)
                    if local is not None:
                        local.deliver(relay_ack.ack)
                if self._pending:
                    self._wake.set()
        finally:
            if channel is not None:
                await channel.close()

    async def _exchange(self, call, up):
        """Write ``up`` (a RelayUp) on ``call`` and return node 0's RelayDown.

        Raises:
            grpc.RpcError: the call failed, or node 0 ended it (``UNAVAILABLE``).
            asyncio.TimeoutError: no answer within the relay's deadline.
            asyncio.InvalidStateError: the call had ended before the write.
        """
        await asyncio.wait_for(call.write(up), self._timeout_s)
        down = await asyncio.wait_for(call.read(), self._timeout_s)
        if down is grpc.aio.EOF:
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.UNAVAILABLE,
                grpc.aio.Metadata(),
                grpc.aio.Metadata(),
                "node 0's aggregator ended the relay call",
            )
        return down

    def _take_frames(self) -> list:
        """The oldest pending frames, in order, that fit :data:`RELAY_UP_MAX_BYTES` (at least
        one: a frame holds at most one batch, whose bound is half the wire's message bound);
        the rest wait for the next RelayUp."""
        pending, taken, size = self._pending, 0, 0
        while taken < len(pending):
            size += pending[taken].ByteSize() + FRAME_OVERHEAD_BYTES
            if taken and size > RELAY_UP_MAX_BYTES:
                break
            taken += 1
        frames, self._pending = pending[:taken], pending[taken:]
        return frames

    def _go_dark(self, gone: tuple) -> None:
        """:meth:`upstream_gone`, on the relay's loop: every local stream ends with ``gone``,
        and so does each one opened from now on."""
        self._gone = gone
        self._end_locals(gone)

    def _fail_locals(self, failure: tuple) -> None:
        """The upstream call failed: every local stream ends with ``failure`` (its senders
        reopen one and resend), and nothing queued is sent (they resend it)."""
        self.stats.upstream_failures += 1
        self._end_locals(failure)

    def _end_locals(self, status: tuple) -> None:
        """Every local stream ends with ``status`` (``(code, details)``); nothing queued is
        sent."""
        for local in self._locals.values():
            local.answers.put_nowait(status)
        self._locals.clear()
        self._pending.clear()


def _pace_s(down) -> float | None:
    """Node 0's pace, s, as the Acks of ``down`` (a RelayDown) that stored a batch ask it of
    their senders (``Ack.flush_interval_ms``); None when none did (a push-back or a refusal
    carries none)."""
    acks = (relay_ack.ack for relay_ack in down.acks)
    paces = [ack.flush_interval_ms for ack in acks if not (ack.rejected or ack.retry_after_ms)]
    return max(paces) / 1000.0 if paces else None


async def _failure(exc: BaseException, call, timeout_s: float) -> tuple[grpc.StatusCode, str]:
    """The status of the failed upstream ``call`` (None: not opened): ``(code, details)``."""
    if isinstance(exc, asyncio.InvalidStateError) and call is not None:  # it had ended first
        return await call.code(), await call.details()
    if isinstance(exc, grpc.RpcError):
        code, details = exc.code(), exc.details() or ""
        if code is grpc.StatusCode.UNIMPLEMENTED:
            details = "node 0's aggregator does not serve Relay (use one TraceML version)"
        return code, details
    if isinstance(exc, asyncio.TimeoutError):
        return grpc.StatusCode.UNAVAILABLE, f"no answer within {timeout_s:g} s"
    return grpc.StatusCode.UNAVAILABLE, f"{type(exc).__name__}: {exc}"


def _said_if_failed(pump: asyncio.Task) -> None:
    """The pump ended: on a bug (never by design before the relay closes), one warning line;
    the ranks' streams then time out, and they keep their telemetry."""
    if not pump.cancelled() and pump.exception() is not None:
        exc = pump.exception()
        _log.warning(f"warning: the node relay stopped relaying ({type(exc).__name__}: {exc})")
