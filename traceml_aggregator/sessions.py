"""Each node launcher's session stream (``NodeSession``), and which nodes are lost.

A node's launcher holds one bidirectional stream to node 0's aggregator for the whole run
(``traceml/launcher/session.py``). Up come its claim (first, on every new session: see
:class:`~traceml_aggregator.nodes.NodeRegistry`), a heartbeat every
:data:`~traceml.core.transport.NODE_HEARTBEAT_INTERVAL_S`, its torchrun's exit (stored like
``ReportNodeExit``, answered ``exit_stored``) and, from node 0, the finalization request. Down
go the claim's verdict and what the aggregator pushes to every open session: the run's failure
once another node's claim was refused, the finalization result, and what it publishes
(:meth:`NodeSessions.publish`: the stall record as it changes, the watchdog's partial summary),
whose latest of each kind also goes to every session opened later. It is the one channel from
the aggregator to the launchers: none of them reads the aggregator's files while it serves.

Liveness: a node whose claim was accepted is expected to speak until its launcher ends its
session cleanly: a ``goodbye`` message, then the end of the stream. Any other end (a reset, a
keepalive timeout, a cancel; also a bare end of stream, which gRPC may report when the
connection dies) is a break. A node the aggregator has heard nothing from for
:data:`~traceml.core.transport.NODE_LOST_AFTER_S` (25 s: no message on its session, no
heartbeat through its node relay, :meth:`NodeSessions.relayed_heartbeat`, no new session) is
**lost**: a warning, and a record in the store's
:data:`~traceml_aggregator.store.NODE_LOSSES_META_KEY` entry, which the summary's
``run.telemetry_health.node_losses`` and the ``NODE_LOST`` finding read. The watch looks every
:data:`LOST_CHECK_S`, so a node is marked lost between 25 and 26 s after the last message it
sent, that is at most 25 + 2 + 1 = 28 s after its link went down; time the aggregator itself
did not run (stopped, its event loop held) is not counted (:meth:`NodeSessions.watch`). A lost
node heard again
resumes (a new session, a message on the session it kept, a heartbeat through its node relay: a
stalled launcher or host keeps its streams open): its record gets the time. An aggregator
restarted on the run's store expects a session from every node whose exit is not stored, from
the moment it serves.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import grpc

from traceml import wire
from traceml.core import log
from traceml.core.ends import interrupted_reason, signal_name
from traceml.core.records import LostNode, NodeClock
from traceml.core.transport import NODE_LOST_AFTER_S
from traceml_aggregator.nodes import NodeRegistry
from traceml_aggregator.store import NODE_CLOCKS_META_KEY, NODE_LOSSES_META_KEY

_log = log.get("aggregator")

#: How often the aggregator looks for lost nodes, s.
LOST_CHECK_S = 1.0
#: A node's stored clock offset is replaced by its latest estimate at least this often, s.
CLOCK_REFRESH_S = 300.0


def clock_echo(heartbeat, received_ns: int):
    """The ClockEcho of ``heartbeat``'s exchange: its t0, and t1 = ``received_ns`` (node 0's
    wall clock as it read it, ns); t2 (``answered_unix_ns``) is set as it is answered."""
    return wire.ClockEcho(sent_unix_ns=heartbeat.sent_unix_ns, received_unix_ns=received_ns)


def clock_news(stored: dict | None, estimate: dict) -> bool:
    """Whether a node's new clock ``estimate`` is worth a store write over ``stored`` (both
    NodeClock JSON): the first one, one with less than half the bound, one that the stored
    one does not agree with (the clock moved: the two intervals do not overlap), or one
    :data:`CLOCK_REFRESH_S` newer (a clock without NTP drifts, 10-50 ppm). A launcher resends
    its best estimate every heartbeat, so most are not news."""
    if stored is None:
        return True
    apart = abs(estimate["offset_us"] - stored["offset_us"])
    return (
        2 * estimate["error_us"] < stored["error_us"]
        or apart > estimate["error_us"] + stored["error_us"]
        or estimate["measured_unix_s"] - stored["measured_unix_s"] >= CLOCK_REFRESH_S
    )


class _Refused(Exception):
    """A session message this run cannot take (the reason, for ``FAILED_PRECONDITION``)."""


@dataclass(eq=False)
class _Session:
    """One open stream of one node's launcher."""

    node_rank: int
    outbox: asyncio.Queue = field(default_factory=asyncio.Queue)  # NodeDown, None: replaced
    finalizing: asyncio.Task | None = None
    goodbye: bool = False


@dataclass
class _Node:
    """What the aggregator knows of one node's launcher."""

    hostname: str
    last_heard_monotonic: float
    last_heard_unix_s: float
    session: _Session | None = None
    #: The launcher ended its session cleanly: it is done, never lost.
    ended: bool = False
    #: Its latest session broke (no clean end) and no new one came yet.
    broke: bool = False
    #: The loss record while the node is lost (see :class:`NodeSessions`), else None.
    lost: dict | None = None


class NodeSessions:
    """The aggregator's side of ``NodeSession``: claims, exits, pushes, liveness.

    Args:
        registry: the node-rank claims.
        store_exit: ``async fn(NodeExit) -> str``: stores a node's exit; the refusal, or "".
        finalize: ``async fn(FinalizeRequest) -> FinalizeReply``.
        persist: ``async fn(meta key, JSON value)``: stores a run record in the store's meta
            (every loss record so far; every node's clock offset so far).
        foreign: ``fn(run_name) -> str``: why a run name is not this run's ("" when it is).
        refuse: ``fn(kind, detail) -> detail``: counts a refused claim or session message.
        give_up_on: ``fn(node ranks)``: finalization stops waiting for those nodes (the run
            cannot go on, and no launcher holds them).
        losses: loss records an earlier aggregator of this run stored.
        clocks: the clock offsets an earlier aggregator of this run stored.
        lost_after_s: see :data:`~traceml.core.transport.NODE_LOST_AFTER_S`.
    """

    def __init__(
        self,
        registry: NodeRegistry,
        *,
        store_exit,
        finalize,
        persist,
        foreign,
        refuse,
        give_up_on,
        losses: list[dict] | None = None,
        clocks: list[dict] | None = None,
        lost_after_s: float = NODE_LOST_AFTER_S,
    ) -> None:
        self.registry = registry
        self._store_exit = store_exit
        self._finalize = finalize
        self._persist = persist
        self._foreign = foreign
        self._refuse = refuse
        self._give_up_on = give_up_on
        self.lost_after_s = lost_after_s
        #: Every loss of this run, in order: ``{"node_rank", "hostname", "last_heard_unix_s",
        #: "lost_unix_s", "resumed_unix_s" (None while lost), "lost_after_s"}``.
        self.losses: list[dict] = list(losses or [])
        self.nodes: dict[int, _Node] = {}
        #: Each node's clock offset as stored (a NodeClock record's JSON), by node rank.
        self.clocks: dict[int, dict] = {c["node_rank"]: c for c in clocks or []}
        self._clocks_write: asyncio.Future | None = None
        self._losses_write: asyncio.Future | None = None  # the latest, held while it runs
        self._clocks_dirty = False
        self._clocks_logged: set[int] = set(self.clocks)
        #: The latest published NodeDown of each kind (``stall``, ``partial_summary``), for
        #: the sessions that open later.
        self._published: dict[str, wire.NodeDown] = {}

    def clock_records(self) -> list[dict]:
        """Every node's clock offset as stored (NodeClock JSON), by node rank."""
        return [self.clocks[n] for n in sorted(self.clocks)]

    def expect(self, node_ranks) -> None:
        """Expect a session from each of ``node_ranks`` from now on (a restarted aggregator:
        the nodes whose exit is not stored); one that never comes is lost."""
        now_m, now = time.monotonic(), time.time()
        for rank in node_ranks:
            self.nodes.setdefault(rank, _Node("", now_m, now))

    # --- the stream --------------------------------------------------------------------------
    async def serve(self, context) -> None:
        """Serve one session on ``context`` (a ``grpc.aio`` stream-stream context)."""
        first = await context.read()
        if first is grpc.aio.EOF:
            return
        if first.WhichOneof("kind") != "claim":
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "a node session starts with the node's claim"
            )
        claim = first.claim
        reason = self._foreign(claim.run_name)
        if reason:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, reason)
        failure_before = self.registry.run_failure
        accepted, refusal = self.registry.claim(claim)
        if not accepted:
            nnodes = self.registry.nnodes
            kind = (
                "node_rank_out_of_range"
                if nnodes is not None and claim.node_rank >= nnodes
                else "node_claim"
            )
            self._refuse(kind, f"a node claim: {refusal}")
            if self.registry.run_failure != failure_before:
                self._push(wire.NodeDown(run_failure=self.registry.run_failure))
            await context.write(
                wire.NodeDown(
                    claim=wire.NodeClaimReply(
                        accepted=False, reason=refusal, run_failure=self.registry.run_failure
                    )
                )
            )
            return
        session = self._open(claim)
        await context.write(
            wire.NodeDown(
                claim=wire.NodeClaimReply(accepted=True, run_failure=self.registry.run_failure)
            )
        )
        reader = asyncio.ensure_future(self._read(session, context))
        get = None
        try:
            while True:
                get = asyncio.ensure_future(session.outbox.get())
                done, _ = await asyncio.wait({get, reader}, return_when=asyncio.FIRST_COMPLETED)
                if get not in done:
                    get.cancel()
                    try:
                        reader.result()
                    except _Refused as exc:
                        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
                    while not session.outbox.empty():  # what was answered before the end
                        message = session.outbox.get_nowait()
                        if message is not None:
                            await context.write(message)
                    return
                message = get.result()
                if message is None:  # a newer session of this node replaced this one
                    return
                await context.write(message)
        finally:
            reader.cancel()
            if get is not None:
                get.cancel()
            self._close(session, session.goodbye)

    async def _read(self, session: _Session, context) -> None:
        """Take the session's messages until the end of the stream.

        Raises:
            _Refused: an exit report this run cannot take.
        """
        while True:
            up = await context.read()
            received_ns = time.time_ns()  # t1 of a heartbeat's clock exchange
            if up is grpc.aio.EOF:
                return
            self._heard(session.node_rank, "its session spoke again")
            kind = up.WhichOneof("kind")
            if kind == "heartbeat":
                self._clock_exchange(session, up.heartbeat, received_ns)
            elif kind == "goodbye":
                session.goodbye = True
            elif kind == "interrupted":
                name = signal_name(up.interrupted.signal)
                self.fail_run(interrupted_reason(name, session.node_rank))
            elif kind == "exit":
                if up.exit.node_rank != session.node_rank:  # a node reports its own exit only
                    raise _Refused(
                        self._refuse(
                            "exit_of_another_node",
                            f"node {session.node_rank}'s session reported the exit of node "
                            f"{up.exit.node_rank}",
                        )
                    )
                refusal = await self._store_exit(up.exit)
                if refusal:
                    raise _Refused(refusal)
                session.outbox.put_nowait(wire.NodeDown(exit_stored=wire.NodeExitAck()))
            elif kind == "finalize":
                if session.finalizing is not None:
                    session.finalizing.cancel()  # the launcher asks again: now, with less
                session.finalizing = asyncio.ensure_future(self._finalize_and_push(up.finalize))

    def _clock_exchange(self, session: _Session, heartbeat, received_ns: int) -> None:
        """Answer ``heartbeat``'s clock exchange at once on ``session``, and keep the estimate
        it carries (:meth:`_keep_clock`)."""
        if heartbeat.sent_unix_ns:
            echo = clock_echo(heartbeat, received_ns)
            echo.answered_unix_ns = time.time_ns()
            session.outbox.put_nowait(wire.NodeDown(clock=echo))
        self._keep_clock(session.node_rank, heartbeat)

    def relayed_heartbeat(self, node_rank: int, heartbeat, received_ns: int):
        """A heartbeat a node's relay carried in a ``RelayUp`` (``received_ns``: t1, when node
        0 read it): the node is heard now, as on its session, and its estimate kept; returns
        the ClockEcho to answer in that message's ``RelayDown`` (t2 to be set as it is
        answered), or None: no exchange asked, or no node of that rank claimed (a heartbeat
        of no node is not counted)."""
        if node_rank not in self.nodes:
            return None
        self._heard(node_rank, "a heartbeat came through its node relay")
        self._keep_clock(node_rank, heartbeat)
        return clock_echo(heartbeat, received_ns) if heartbeat.sent_unix_ns else None

    def _keep_clock(self, node_rank: int, heartbeat) -> None:
        """Keep the clock estimate ``heartbeat`` carries (none: nothing), stored at once when
        :func:`clock_news` says it is news."""
        if not heartbeat.HasField("clock"):
            return
        estimate = NodeClock(
            node_rank=node_rank,
            offset_us=heartbeat.clock.offset_us,
            error_us=heartbeat.clock.error_us,
            measured_unix_s=round(time.time(), 3),
        ).to_json()
        if clock_news(self.clocks.get(node_rank), estimate):
            self.clocks[node_rank] = estimate
            self._clocks_dirty = True
            if self._clocks_write is None or self._clocks_write.done():
                self._clocks_write = asyncio.ensure_future(self._write_clocks())

    async def _write_clocks(self) -> None:
        """Store every node's clock offset now, and again after each write while news came
        during it (the news of many nodes at once, as a run starts, takes few writes); log each
        node's first stored offset."""
        while self._clocks_dirty:
            self._clocks_dirty = False
            clocks = self.clock_records()
            try:
                await self._persist(NODE_CLOCKS_META_KEY, clocks)
            except Exception as exc:  # the store refused (disk full...): the next news retries
                self._clocks_dirty = True
                _log.warning(f"warning: the nodes' clock offsets were not stored ({exc})")
                return
            for c in clocks:
                if c["node_rank"] not in self._clocks_logged:
                    self._clocks_logged.add(c["node_rank"])
                    _log.info(
                        f"node {c['node_rank']}'s clock is {-c['offset_us'] / 1000:+.3f} ms off "
                        f"node 0's aggregator's (± {c['error_us'] / 1000:.3f} ms)"
                    )

    async def _finalize_and_push(self, request) -> None:
        reply = await self._finalize(request)
        self._push(wire.NodeDown(finalized=reply))

    def _push(self, message) -> None:
        """Queue ``message`` on every open session."""
        for node in self.nodes.values():
            if node.session is not None:
                node.session.outbox.put_nowait(message)

    def fail_run(self, reason: str) -> None:
        """The run cannot go on (``reason``: it cannot rendezvous, or a node's launcher was
        stopped): say so down every open session, and in the claim reply of every one that
        opens later (the first reason stays), so each launcher stops its torchrun rather than
        wait in the rendezvous until torch's timeout, or see its ranks die of their peers'
        end; finalization waits for no node that no launcher holds (none will ever report)."""
        if self.registry.fail(reason):
            self._push(wire.NodeDown(run_failure=reason))
        self._give_up_on(self.registry.unclaimed())

    def publish(self, message) -> None:
        """Push ``message`` (a NodeDown) to every open session now, and to every session that
        opens later until another message of its kind replaces it: a launcher whose session was
        away (a network cut, a restarted aggregator) hears the latest stall and partial summary
        as it comes back."""
        self._published[message.WhichOneof("kind")] = message
        self._push(message)

    def _open(self, claim) -> _Session:
        """A new session of ``claim``'s node: it replaces an open one, resumes a lost node."""
        rank = claim.node_rank
        session = _Session(rank)
        node = self.nodes.get(rank)
        if node is None:
            node = self.nodes[rank] = _Node(claim.hostname, 0.0, 0.0)
        if node.session is not None:
            node.session.outbox.put_nowait(None)
        node.hostname, node.session, node.ended, node.broke = claim.hostname, session, False, False
        for message in self._published.values():  # sent after the claim's verdict
            session.outbox.put_nowait(message)
        self._heard(rank, "its session resumed")
        return session

    def _heard(self, rank: int, how: str) -> None:
        """Node ``rank`` spoke now (``how``: on which path, as the log says it). A lost node
        resumes: its loss record gets the time, and the records are stored
        (:meth:`_store_losses`, not awaited: a relayed heartbeat is heard inside a relay
        message's pass)."""
        node = self.nodes[rank]
        node.last_heard_monotonic, node.last_heard_unix_s = time.monotonic(), time.time()
        if node.lost is None:
            return
        node.lost["resumed_unix_s"] = round(node.last_heard_unix_s, 3)
        lost_s = node.lost["resumed_unix_s"] - node.lost["lost_unix_s"]
        node.lost = None
        self._losses_write = asyncio.ensure_future(self._store_losses())
        _log.info(
            f"node {rank} ({node.hostname or '?'}) is back: {how} {lost_s:.1f} s after it was "
            "marked lost"
        )

    async def _store_losses(self) -> None:
        """Store every loss record; a failure (the disk) is said, and the next loss or
        resumption stores them all again."""
        try:
            await self._persist(NODE_LOSSES_META_KEY, self.losses)
        except Exception as exc:
            _log.warning(f"warning: the node losses were not stored ({exc})")

    def _close(self, session: _Session, clean: bool) -> None:
        node = self.nodes.get(session.node_rank)
        if node is None or node.session is not session:
            return  # replaced: the newer session speaks for the node
        node.session = None
        if clean:
            node.ended = True
        else:
            node.broke = True
            _log.info(
                f"node {session.node_rank}'s session broke; it is lost unless it comes back "
                f"within {self.lost_after_s:g} s of its last message"
            )

    # --- liveness ----------------------------------------------------------------------------
    async def check_lost(self) -> list[int]:
        """Mark lost every expected node silent for :attr:`lost_after_s`; the newly lost.

        The loss records are stored (:meth:`_store_losses`): a store that fails (a full disk)
        is said and retried with the next loss or resumption, and the watch goes on."""
        now_m, now = time.monotonic(), time.time()
        found = []
        for rank, node in sorted(self.nodes.items()):
            if node.ended or node.lost is not None:
                continue
            silent_s = now_m - node.last_heard_monotonic
            if silent_s <= self.lost_after_s:
                continue
            self._lose(rank, node, now, self.lost_after_s)
            found.append(rank)
            how = (
                "its session stream broke and did not come back"
                if node.session is None
                else "its session stream is still open but silent: its host was cut off, or "
                "its launcher or host stalled"
            )
            _log.warning(
                f"warning: node {rank} ({node.hostname or '?'}) lost: nothing from its launcher "
                f"for {silent_s:.0f} s ({how})"
            )
        if found:
            await self._store_losses()
        return found

    async def lose_unreported(self, exited) -> list[int]:
        """At the run's summary: mark lost every node whose session broke, did not come back,
        and reported no exit (not in ``exited``, node ranks), though the bound
        (:attr:`lost_after_s`) has not passed yet; the newly lost. Such a node's launcher was
        killed, or its host died or was cut off, as the run ended: its peers failed at once (a
        collective's peer vanished) and every rank ended before the bound, which would have
        left the summary silent about it. Its record's ``lost_after_s`` is the silence it was
        marked lost after, below the bound."""
        now_m, now = time.monotonic(), time.time()
        found = []
        for rank, node in sorted(self.nodes.items()):
            if not node.broke or node.ended or node.lost or rank in exited:
                continue
            silent_s = now_m - node.last_heard_monotonic
            self._lose(rank, node, now, round(silent_s, 1))
            found.append(rank)
            _log.warning(
                f"warning: node {rank} ({node.hostname or '?'}) lost: nothing from its launcher "
                f"for {silent_s:.0f} s (its session broke and it reported no exit before the "
                "summary)"
            )
        if found:
            await self._store_losses()
        return found

    def _lose(self, rank: int, node: _Node, now: float, silent_s: float) -> None:
        """Mark ``node`` (node ``rank``) lost at ``now`` (Unix s) after ``silent_s`` of
        silence: its record, in :attr:`losses` too."""
        node.lost = LostNode(
            node_rank=rank,
            hostname=node.hostname or None,
            last_heard_unix_s=round(node.last_heard_unix_s, 3),
            lost_unix_s=round(now, 3),
            resumed_unix_s=None,
            lost_after_s=silent_s,
        ).to_json()
        self.losses.append(node.lost)

    async def watch(self) -> None:
        """Run :meth:`check_lost` every :data:`LOST_CHECK_S` (until cancelled). A check that
        comes more than a whole period late (this process was stopped, or its event loop held)
        first moves every node's last message that much later: the nodes' messages of that
        time wait unread in its sockets, so a node is not blamed for the aggregator's own
        pause (each is heard again as they are read)."""
        checked_m = time.monotonic()
        while True:
            await asyncio.sleep(LOST_CHECK_S)
            late_s = time.monotonic() - checked_m - LOST_CHECK_S
            if late_s > LOST_CHECK_S:
                for node in self.nodes.values():
                    node.last_heard_monotonic += late_s
            await self.check_lost()
            checked_m = time.monotonic()
