"""Benchmark (d): one aggregator ingesting batched step records from many simulated ranks.

A real ``traceml-aggregator`` process; ``--procs`` client processes simulate the ranks, each
rank with its own gRPC channel (its own TCP connection, as a rank in its own process has) on
``grpc.aio``, so a few processes hold a thousand connections. A rank behaves like the SDK's
client: its first batch carries its identity, then one batch in flight at a time, the next one
sent when the previous one is acknowledged (a failed call is sent again, and counted). Each
rank count runs the wires side by side in the same run (``--wire``): ``stream``, the SDK's
(one bidirectional ``Stream`` per rank, a batch up and its Ack down, ended with the
``closing`` message), and ``unary`` (one ``Push`` call per batch, the wire before it).
``--relay`` (or ``--wire ... relay``) adds ``relay``: the same ranks as R/8 simulated nodes, each
node one ``Relay`` call (one channel, one TCP connection), as the launcher's node relay
(``traceml/launcher/relay.py``) carries its 8 local ranks' streams and its node sampler's to node
0: each interval one ``RelayUp`` whose frames are the 8 ranks' batches (channels 1..8, each rank's
own seq; the first carries its identity, as on the stream wire) and the node sampler's batch
(channel 9: two system samples), one ``RelayUp`` in flight, the next once its ``RelayDown`` came
(one per ``RelayUp``, a ``RelayAck`` per batch); a failed call is reopened and what was not
acknowledged sent again (counted), and each channel is ended (``closing``, then ``ended``). The
node session's heartbeats are a separate ``NodeSession`` stream in the product; ``--sessions``
simulates them (on any wire, against the aggregator: gRPC alone serves no ``NodeSession``):
each node of 8 ranks also holds its launcher's session on a connection of its own, its claim
and first heartbeat first (answered before the clock starts), then a heartbeat with its clock
exchange every ``NODE_HEARTBEAT_INTERVAL_S`` (2 s), each answered at once, while its ranks
stream, then its goodbye; on the relay wire the relay's ``RelayUp``s carry the heartbeats
instead, each answered in its ``RelayDown``, and the session's stream stays silent, as the
launcher's relay and session do; without it the sessions are left out.
``--interval-sec 1`` paces each rank to one batch a second (ack latency and aggregator CPU at
a realistic load), all ranks at the same instants, as the SDK's senders of ranks that start
and step together (``--spread``: each at a random phase of the interval, an alternative measured
in docs/scale.md); 0 sends as fast as acknowledgements come (records/s). ``--short`` is the CI smoke
run: 8 ranks, a few small batches, the three wires (the relay's: one node), both pacings; it must
finish, not reach the targets. Batches are encoded before the clock starts (the per-batch header
is joined to a pre-encoded block of records, a relay's frames to each other: protobuf allows
that), so the clients spend their CPU on gRPC, not on protobuf. ``--pace on`` has the senders
flush at node 0's pace, as the SDK's do (:func:`paced_case`: the pace the aggregator asks of as
many calls, ``traceml_aggregator/pace.py``, with the same steps a second; the run fails when
its Acks ask for another); ``--pace off on`` runs both side by side.

Reported per rank count: time until every channel is connected (READY) and every rank's first
batch acknowledged (on the relay: every node's first ``RelayUp``); records stored per second
while all ranks stream (target >= 200k/s), and the aggregator's CPU per record, per batch and per
message (a batch, or a ``RelayUp``: what a busy machine does not distort); ack latency (a
batch's, or a ``RelayUp``'s); aggregator RSS (peak, from /proc). Every record is checked in the
store afterwards (the relay's system samples too).

Every call carries the run token (``TRACEML_RUN_TOKEN``, set by ``_common``), as the SDK's do.
To see what the token check costs, run this same file against the tree before it and after it,
side by side (``PYTHONPATH=<other tree> python benchmarks/ingest.py``): a tree without the check
ignores the metadata.

With ``--viewers 0 4 --trials N`` the same run goes N times without and with 4 live viewers
(``Summarize`` at 1 Hz each, open from the connections on, as a ``--mode cli`` view is from the
job's start: the analysis process's one-off start-up, ~0.6 s of CPU, then comes before the
streaming, not in its 7 s), alternating, and the medians of ingest rate and ack p99 are
printed side by side with their ratios, and the median of the ratios of each back-to-back pair
(which a machine whose speed drifts during the trials distorts less) (target: within 5 %).
``--scrapers 0 8`` does the same with Prometheus scrapers instead: each ``GET /metrics`` (the
run token as bearer) once a second, all at the same instants, from the connections on (the
aggregator serves ``--metrics-port`` in every run of that comparison) (target: ack p99 within
10 %).

Usage: ``python benchmarks/ingest.py [--ranks 1024 4096] [--batches 20] [--records 100]
[--interval-sec 0 1] [--wire stream unary relay] [--relay] [--viewers 0 4] [--scrapers 0 8]
[--trials 3] [--transport-floor] [--sessions] [--pace off on] [--short]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil
from _common import LiveAggregator, free_port, median, p99
from transport_floor import TransportFloor

from traceml.core.heap import SERVING_TALLY

RUN = "ingest-bench"
PUSH = "/traceml.wire.v1.Aggregator/Push"
STREAM = "/traceml.wire.v1.Aggregator/Stream"
RELAY = "/traceml.wire.v1.Aggregator/Relay"
SESSION = "/traceml.wire.v1.Aggregator/NodeSession"
WIRES = ("stream", "unary", "relay")
#: Ranks of a simulated node on the relay wire (its channels 1..8; its sampler's is the next).
NODE_RANKS = 8


def node_count(world: int) -> int:
    """The simulated nodes of ``world`` ranks, :data:`NODE_RANKS` a node (on the straight wire
    the last one may hold fewer)."""
    return -(-world // NODE_RANKS)


#: System samples in a node sampler's batch (a sample a second, a batch every 2 s).
NODE_SAMPLES = 2
#: The run token's metadata key (traceml.core.transport.TOKEN_METADATA_KEY), spelled out so the
#: file also runs against a tree from before the token.
TOKEN_METADATA = (("traceml-run-token", os.environ.get("TRACEML_RUN_TOKEN", "")),)


def step_blocks(batches: int, records: int) -> list[bytes]:
    """Batch ``b``'s encoded steps field: records b*R .. b*R+R-1 of a plausible CPU rank."""
    from traceml import wire
    from traceml.wire.records import add_steps

    blocks = []
    for b in range(batches):
        batch = wire.Batch()
        add_steps(
            batch,
            (
                {
                    "step": i,
                    "end_us": 1_000_000 + 25_000 * i,
                    "step_us": 25_000 + i % 997,
                    "input_wait_us": 600 + i % 50,
                    "dataloader_next_us": 500 + i % 40,
                    "forward_us": 800,
                    "backward_us": 13_000 + i % 300,
                    "optimizer_us": 1_200,
                }
                for i in range(b * records, (b + 1) * records)
            ),
        )
        blocks.append(batch.SerializeToString())
    return blocks


async def rank_task(
    channel,
    rank: int,
    world: int,
    blocks: list[bytes],
    go: asyncio.Event,
    t: dict,
    wire_kind: str,
    interval_s: float,
    spread: bool,
) -> None:
    """One simulated rank: connect, identity batch, then its batches one by one (one every
    ``interval_s`` at most), on one stream or one Push per batch (``wire_kind``). Paced, every
    rank sends at the same instants, as the SDK's senders of ranks that start and step together
    do; ``spread``, each rank's first batch comes a random fraction of the interval later (an
    alternative the SDK does not take: docs/scale.md)."""
    send = (StreamSender if wire_kind == "stream" else _PushSender)(channel)
    await channel.channel_ready()
    t["ready"] = max(t["ready"], time.time())
    await until_acked(send, identity_batch(RUN, rank, world), 1, t, None)
    t["first_acked"] = max(t["first_acked"], time.time())
    await go.wait()
    next_at = time.perf_counter() + (random.Random(rank).uniform(0, interval_s) if spread else 0.0)
    for seq, block in enumerate(blocks, start=2):
        await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
        next_at += interval_s
        paces = t["paces_ms"] if seq == 2 else None  # every stream is open yet
        await until_acked(send, rank_batch(rank, seq, block), seq, t, t["ack_s"], paces=paces)
    await send.close()
    t["done"] = max(t["done"], time.time())


async def node_task(
    channel,
    node: int,
    ups: list[dict],
    closing: bytes,
    go: asyncio.Event,
    t: dict,
    interval_s: float,
    spread: bool,
    sessions: bool,
) -> None:
    """One simulated node's relay (the relay wire): connect, then ``ups`` (its pre-encoded
    messages: :func:`node_messages`) one by one on one ``Relay`` call, the first (the ranks'
    identities) before ``go``, the others paced as :func:`rank_task`'s batches; ``closing``
    at the end. With ``sessions`` each of the others carries the node's heartbeat, as the
    launcher's relay does (:func:`relayed_heartbeat`)."""
    send = RelaySender(channel, closing)
    await channel.channel_ready()
    t["ready"] = max(t["ready"], time.time())
    await until_relayed(send, ups[0], t, None)
    t["first_acked"] = max(t["first_acked"], time.time())
    await go.wait()
    next_at = time.perf_counter() + (random.Random(node).uniform(0, interval_s) if spread else 0.0)
    for seq, frames in enumerate(ups[1:], start=2):
        await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
        next_at += interval_s
        paces = t["paces_ms"] if seq == 2 else None  # every call is open yet
        await until_relayed(send, frames, t, t["ack_s"], node if sessions else None, paces)
    await send.close()
    t["done"] = max(t["done"], time.time())


async def session_task(
    channel, node: int, nodes: int, go: asyncio.Event, stop: asyncio.Event, t, relayed: bool
):
    """One simulated node's launcher session (``--sessions``): its claim, then a heartbeat
    with its clock exchange every ``NODE_HEARTBEAT_INTERVAL_S`` (and one at ``go``) until
    ``stop``, each answer awaited (the aggregator answers at once), then its goodbye and a
    half-close; heartbeats from ``go`` on counted in ``t["heartbeats"]``. When ``relayed``
    (the relay wire), from ``go`` on its node's relay carries its heartbeats
    (:func:`relayed_heartbeat`) and its stream says nothing more until its goodbye, as the
    launcher's does while node 0 answers them; before ``go`` (the relay idle) it sends its
    own, as the launcher's does when no ``RelayUp`` carried one. A session that fails is
    opened again with its claim after the launcher's backoff (counted in ``t["errors"]`` as
    ``session <code>``)."""
    import socket

    import grpc

    from traceml import wire
    from traceml.core.transport import NODE_HEARTBEAT_INTERVAL_S

    open_session = channel.stream_stream(SESSION, response_deserializer=wire.NodeDown.FromString)
    claim = wire.NodeUp(
        claim=wire.NodeClaim(
            run_name=RUN,
            node_rank=node,
            nnodes=nodes,
            hostname=socket.gethostname(),
            launcher_pid=node,
        )
    ).SerializeToString()
    backoff_s = 0.1
    while True:
        call = open_session(metadata=TOKEN_METADATA)
        try:
            await call.write(claim)
            reply = await call.read()
            assert reply is not grpc_aio_eof() and reply.claim.accepted, reply
            backoff_s = 0.1
            while not stop.is_set():
                after_go = go.is_set()
                if relayed and after_go:
                    break  # its node's relay carries them from now on
                beat = wire.NodeHeartbeat(sent_unix_ns=time.time_ns())
                await call.write(wire.NodeUp(heartbeat=beat).SerializeToString())
                down = await call.read()
                while down is not grpc_aio_eof() and down.WhichOneof("kind") != "clock":
                    down = await call.read()  # what is pushed comes before its echo
                assert down is not grpc_aio_eof(), "the aggregator ended the session"
                if after_go:
                    t["heartbeats"] += 1
                try:  # the next one in an interval; the first after go at go
                    await asyncio.wait_for(
                        (stop if after_go else go).wait(), NODE_HEARTBEAT_INTERVAL_S
                    )
                except asyncio.TimeoutError:
                    pass
            await stop.wait()
            await call.write(wire.NodeUp(goodbye=wire.NodeGoodbye()).SerializeToString())
            await call.done_writing()
            await call.code()
            return
        except (grpc.RpcError, asyncio.InvalidStateError) as exc:
            code = f"session {exc.code().name if isinstance(exc, grpc.RpcError) else 'ENDED'}"
            t["errors"][code] = t["errors"].get(code, 0) + 1
            call.cancel()
            await asyncio.sleep(backoff_s)  # the launcher's backoff: 0.1 s doubling to 2 s
            backoff_s = min(2.0, 2 * backoff_s)


def node_messages(
    node: int, world: int, blocks: list[bytes], samples: int
) -> tuple[list[dict], bytes]:
    """Node ``node``'s ``RelayUp`` messages, pre-encoded: one per seq (1: each rank's identity
    batch, as on the stream wire; then a batch of each of ``blocks``), each a dict channel ->
    ``(seq, its frame)`` (:func:`relay_frame`); ranks ``node * 8 ..`` on channels 1..8, the node
    sampler on 9, a batch of ``samples`` system samples at every seq (:func:`node_samples`).
    And the last message: every channel's ``closing``, then its ``ended``."""
    from traceml import wire

    ranks = range(node * NODE_RANKS, (node + 1) * NODE_RANKS)
    sampler = NODE_RANKS + 1
    ups = [{c: (1, relay_frame(c, identity_batch(RUN, r, world))) for c, r in enumerate(ranks, 1)}]
    for seq, block in enumerate(blocks, start=2):
        ups.append(
            {c: (seq, relay_frame(c, rank_batch(r, seq, block))) for c, r in enumerate(ranks, 1)}
        )
    for seq, frames in enumerate(ups, start=1):
        frames[sampler] = (seq, relay_frame(sampler, sampler_batch(node, seq, samples)))
    channels = range(1, sampler + 1)
    closing = b"".join(
        relay_frame(c, wire.Batch(closing=True).SerializeToString()) for c in channels
    )
    ended = [wire.RelayFrame(channel=c, ended=True) for c in channels]
    return ups, closing + wire.RelayUp(frames=ended).SerializeToString()


def relay_frame(channel: int, batch: bytes) -> bytes:
    """A ``RelayUp`` of one frame: ``batch`` (encoded) on ``channel``. Encoded ``RelayUp``s
    joined are one ``RelayUp`` of all their frames (protobuf appends repeated fields), so a
    message is its frames joined, and a resend the frames not acknowledged."""
    from traceml import wire

    frame = wire.RelayFrame(channel=channel)
    frame.batch.MergeFromString(batch)
    return wire.RelayUp(frames=[frame]).SerializeToString()


def node_samples(interval_s: float) -> int:
    """System samples in a node sampler's batch sent every ``interval_s``: a sample a second,
    :data:`NODE_SAMPLES` at the least."""
    return max(NODE_SAMPLES, round(interval_s))


def sampler_batch(node: int, seq: int, count: int) -> bytes:
    """Batch ``seq`` of node ``node``'s sampler: ``count`` system samples, a second apart."""
    from traceml import wire

    samples = [
        wire.SystemSample(
            unix_us=1_000_000 * (count * seq + i),
            node_rank=node,
            hostname="sim",
            cpu_percent=40.0 + i,
            ram_used_bytes=64 << 30,
            ram_total_bytes=512 << 30,
        )
        for i in range(count)
    ]
    return wire.Batch(
        run_name=RUN, node_rank=node, seq=seq, system_samples=samples
    ).SerializeToString()


def relayed_heartbeat(node: int) -> bytes:
    """A ``RelayUp`` that holds only node ``node``'s heartbeat with a clock exchange (its t0
    now), encoded: joined to a message's frames, it rides that message, as the launcher's
    relay carries its session's heartbeats."""
    from traceml import wire

    beat = wire.NodeHeartbeat(sent_unix_ns=time.time_ns())
    return wire.RelayUp(heartbeat=beat, node_rank=node).SerializeToString()


async def until_relayed(
    send: RelaySender,
    frames: dict,
    t: dict,
    ack_s: list | None,
    beat_of: int | None = None,
    paces: list[int] | None = None,
) -> None:
    """As the node relay's ranks do, through it: send ``frames`` (channel -> ``(seq, frame)``)
    as one ``RelayUp``, then again those whose ``RelayAck`` did not cover them (pushed back:
    after the longest ``retry_after_ms``; the call failed: at once, on a new call) until every
    one is acknowledged; failures and pushbacks counted in ``t["errors"]``, each
    ``RelayDown``'s seconds in ``ack_s``. With ``beat_of`` (a node rank) the first ``RelayUp``
    also carries that node's heartbeat (:func:`relayed_heartbeat`); each answered is counted
    in ``t["relayed_heartbeats"]``. The paces its Acks ask for go to ``paces`` (:func:`paced`),
    when given."""
    import grpc

    pending = dict(frames)
    beat = relayed_heartbeat(beat_of) if beat_of is not None else b""
    while pending:
        try:
            sent = time.perf_counter()
            down = await send(b"".join(frame for _, frame in pending.values()) + beat)
            if down.HasField("clock"):
                t["relayed_heartbeats"] += 1
                beat = b""
            if ack_s is not None:
                ack_s.append(time.perf_counter() - sent)
        except (grpc.RpcError, RuntimeError) as exc:
            failed(t, exc)
            continue
        wait_ms = 0
        for relay_ack in down.acks:
            ack, (seq, _) = relay_ack.ack, pending.get(relay_ack.channel, (None, b""))
            if paces is not None:
                paced(paces, ack)
            if ack.retry_after_ms:
                count(t, "PUSHED_BACK")
                wait_ms = max(wait_ms, ack.retry_after_ms)
            elif seq is not None and ack.stored_seq >= seq:
                del pending[relay_ack.channel]
        if pending and wait_ms:
            await asyncio.sleep(wait_ms / 1000)


def rank_batch(rank: int, seq: int, block: bytes) -> bytes:
    """Batch ``seq`` of ``rank``, encoded: its header joined to ``block`` (its records,
    encoded: :func:`step_blocks`)."""
    from traceml import wire

    return wire.Batch(run_name=RUN, rank=rank, seq=seq).SerializeToString() + block


def identity_batch(run: str, rank: int, world: int) -> bytes:
    """A simulated rank's first batch (seq 1): its identity, no records."""
    from traceml import wire

    return wire.Batch(
        run_name=run,
        rank=rank,
        seq=1,
        identity=wire.RankIdentity(run_name=run, rank=rank, world_size=world, hostname="sim"),
    ).SerializeToString()


async def until_acked(
    send,
    data: bytes,
    seq: int,
    t: dict,
    ack_s: list | None,
    backoff=None,
    paces: list[int] | None = None,
) -> None:
    """As the SDK does: send ``data`` (batch ``seq``) again until an acknowledgement covers
    it; failures and pushbacks counted in ``t["errors"]``, each ack's seconds in ``ack_s``.
    With ``backoff`` (a :class:`traceml.core.backoff.Backoff`, the SDK's), a failed call waits
    its next step before the batch goes again (without, at once). The paces its Acks ask for
    go to ``paces`` (:func:`paced`), when given."""
    import grpc

    while True:
        try:
            sent = time.perf_counter()
            ack = await send(data)
            if ack_s is not None:
                ack_s.append(time.perf_counter() - sent)
        except (grpc.RpcError, RuntimeError) as exc:
            failed(t, exc)
            if backoff is not None:
                await asyncio.sleep(backoff.next())
            continue
        if backoff is not None:
            backoff.reset()
        if paces is not None:
            paced(paces, ack)
        if ack.retry_after_ms:
            count(t, "PUSHED_BACK")
            await asyncio.sleep(ack.retry_after_ms / 1000)
        elif ack.stored_seq >= seq:
            return


def paced(paces: list[int], ack) -> None:
    """Note in ``paces`` the pace node 0 asked for in ``ack`` (an Ack that stored a batch:
    ``flush_interval_ms``), once each value (:mod:`traceml_aggregator.pace`)."""
    pace = getattr(ack, "flush_interval_ms", 0)  # 0 from a tree before the pace
    if not (ack.retry_after_ms or ack.rejected) and pace not in paces:
        paces.append(pace)


def failed(t: dict, exc: Exception) -> None:
    """Count the failed call ``exc`` (a ``grpc.RpcError``, or a sender's ``RuntimeError``)."""
    import grpc

    count(t, exc.code().name if isinstance(exc, grpc.RpcError) else str(exc))


def count(t: dict, code: str) -> None:
    """One more failure or pushback ``code`` in ``t["errors"]``."""
    t["errors"][code] = t["errors"].get(code, 0) + 1


class _PushSender:
    """A batch per unary Push."""

    def __init__(self, channel) -> None:
        from traceml import wire

        self._push = channel.unary_unary(PUSH, response_deserializer=wire.Ack.FromString)

    async def __call__(self, data: bytes):
        return await self._push(data, timeout=120, metadata=TOKEN_METADATA)

    async def close(self) -> None:
        pass


class StreamSender:
    """A batch up and its Ack down on one Stream, reopened after a failure; ended with the
    ``closing`` message and a half-close, as the SDK ends it. With ``ack_timeout_s``, as the
    SDK's ``TRACEML_RPC_TIMEOUT_SEC``: an Ack that does not come within it cancels the stream
    (``RuntimeError("NO_ACK")``; the batch goes again on a new one)."""

    def __init__(
        self, channel, ack_timeout_s: float | None = None, method: str = STREAM, reply=None
    ) -> None:
        from traceml import wire

        self._open = channel.stream_stream(
            method, response_deserializer=(reply or wire.Ack).FromString
        )
        self._call = None
        self._closing = wire.Batch(closing=True).SerializeToString()
        self._ack_timeout_s = ack_timeout_s

    async def __call__(self, data: bytes):
        if self._call is None:
            self._call = self._open(metadata=TOKEN_METADATA)
        call = self._call
        try:
            if self._ack_timeout_s is None:
                await call.write(data)
                ack = await call.read()
            else:
                ack = await asyncio.wait_for(_exchange(call, data), self._ack_timeout_s)
        except asyncio.TimeoutError:
            call.cancel()
            self._call = None
            raise RuntimeError("NO_ACK") from None
        except asyncio.InvalidStateError:  # a write on a stream the aggregator's death ended
            self._call = None
            raise RuntimeError("ENDED") from None
        except Exception:
            self._call = None
            raise
        if ack is grpc_aio_eof():
            self._call = None
            raise RuntimeError("ENDED")
        return ack

    async def close(self) -> None:
        if self._call is not None:
            await self._call.write(self._closing)
            await self._half_close()

    async def _half_close(self) -> None:
        await self._call.done_writing()
        assert await self._call.read() is grpc_aio_eof()  # the aggregator ended it
        await self._call.code()


class RelaySender(StreamSender):
    """A simulated node's relay: a ``RelayUp`` (encoded) up and its ``RelayDown`` down on one
    ``Relay`` call, reopened after a failure; ended with ``closing`` (a ``RelayUp`` that closes
    and ends every channel: nothing in it is acknowledged, but it has its ``RelayDown``, empty)
    and a half-close."""

    def __init__(self, channel, closing: bytes) -> None:
        from traceml import wire

        super().__init__(channel, method=RELAY, reply=wire.RelayDown)
        self._closing = closing

    async def close(self) -> None:
        if self._call is not None:
            await self._call.write(self._closing)
            down = await self._call.read()
            assert down is not grpc_aio_eof() and not down.acks, down
            await self._half_close()


async def _exchange(call, data: bytes):
    """Write ``data`` on the stream ``call`` and read the next message back."""
    await call.write(data)
    return await call.read()


def grpc_aio_eof():
    """grpc.aio's end-of-stream marker (what ``read()`` returns once the server ended it)."""
    import grpc

    return grpc.aio.EOF


async def client_main(
    target: str,
    senders: list[int],
    world: int,
    batches: int,
    records: int,
    wire_kind: str,
    interval_s: float,
    spread: bool,
    sessions: bool,
) -> dict:
    """A client process: its senders' channels and tasks (ranks, or nodes on the relay wire),
    with ``sessions`` its nodes' sessions (:func:`session_task`: each node's first rank's
    process holds it); the times it saw (Unix s)."""
    import grpc

    from traceml.core.transport import channel_options

    blocks = step_blocks(batches, records)
    if wire_kind == "relay":
        samples = node_samples(interval_s)
        messages = {node: node_messages(node, world, blocks, samples) for node in senders}
    # a real sender's options (keepalive, message bounds, no bandwidth probe), one TCP
    # connection per sender
    options = [*channel_options(), ("grpc.use_local_subchannel_pool", 1)]
    print("ready", flush=True)
    sys.stdin.readline()  # the parent's "connect"
    t = {
        "connect_start": time.time(),
        "ready": 0.0,
        "first_acked": 0.0,
        "done": 0.0,
        "errors": {},
        "ack_s": [],
        "heartbeats": 0,
        "relayed_heartbeats": 0,
        "paces_ms": [],
    }
    go, stop = asyncio.Event(), asyncio.Event()
    channels = [grpc.aio.insecure_channel(target, options=options) for _ in senders]
    if not sessions:
        nodes = []
    elif wire_kind == "relay":
        nodes = list(senders)
    else:
        nodes = [s // NODE_RANKS for s in senders if not s % NODE_RANKS]
    session_channels = [grpc.aio.insecure_channel(target, options=options) for _ in nodes]
    held = [
        asyncio.create_task(
            session_task(ch, n, node_count(world), go, stop, t, wire_kind == "relay")
        )
        for ch, n in zip(session_channels, nodes, strict=True)
    ]
    t["created"] = time.time()
    tasks = [
        asyncio.create_task(
            node_task(ch, s, *messages[s], go, t, interval_s, spread, sessions)
            if wire_kind == "relay"
            else rank_task(ch, s, world, blocks, go, t, wire_kind, interval_s, spread)
        )
        for ch, s in zip(channels, senders, strict=True)
    ]
    if not await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline):  # "go"
        raise SystemExit("the benchmark's process is gone: nothing to send")
    t["go"] = time.time()
    go.set()
    await asyncio.gather(*tasks)
    stop.set()
    await asyncio.gather(*held)
    await asyncio.gather(*(ch.close() for ch in channels + session_channels))
    return t


def peak_rss_bytes(pid: int) -> int:
    """VmHWM of a live process: its peak resident set."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM")


def viewer(target: str, stop: threading.Event, calls: list[float]) -> None:
    """A live view: ``Summarize`` once a second until ``stop``; each call's seconds appended."""
    from traceml.launcher.aggregator import summarize

    while not stop.is_set():
        started = time.perf_counter()
        reply = summarize(target, RUN, 60.0)
        assert not reply.error, reply.error
        calls.append(time.perf_counter() - started)
        stop.wait(max(0.0, 1.0 - (time.perf_counter() - started)))


def scraper(url: str, stop: threading.Event, calls: list[float]) -> None:
    """A Prometheus scraper: ``GET url`` (the run token as bearer) once a second, on the
    second, until ``stop``; each answered scrape's seconds appended to ``calls``, a scrape
    answered 503 (no text within the aggregator's bound) as None."""
    request = urllib.request.Request(
        url, headers={"Authorization": f"Bearer {os.environ['TRACEML_RUN_TOKEN']}"}
    )
    while not stop.is_set():
        started = time.perf_counter()
        try:
            with urllib.request.urlopen(request, timeout=60) as reply:
                assert b"traceml_steps_total" in reply.read()
            calls.append(time.perf_counter() - started)
        except urllib.error.HTTPError as exc:
            assert exc.code == 503, exc
            calls.append(None)
        stop.wait(1.0 - time.time() % 1.0)


def start_clients(
    script: str, target: str, senders: int, procs: int, *args: str
) -> list[subprocess.Popen]:
    """``procs`` client processes ``script --client TARGET SENDERS *args`` (process p's senders,
    ranks or nodes: p, p + procs, ... below ``senders``, as JSON), pipes both ways, once each
    said ``ready``."""
    clients = [
        subprocess.Popen(
            [
                sys.executable,
                script,
                "--client",
                target,
                json.dumps(list(range(p, senders, procs))),
                *args,
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for p in range(procs)
    ]
    for c in clients:
        assert c.stdout.readline().strip() == "ready"
    return clients


def tell(clients: list[subprocess.Popen], line: str) -> None:
    """Write ``line`` to every client's standard input."""
    for c in clients:
        c.stdin.write(line + "\n")
        c.stdin.flush()


def run_world(
    world: int,
    procs: int,
    batches: int,
    records: int,
    viewers: int,
    wire_kind: str = "stream",
    interval_s: float = 0.0,
    summary_at_stop: bool = True,
    spread: bool = False,
    server: str = "aggregator",
    scrapers: int = 0,
    metrics: bool = False,
    sessions: bool = False,
    pace_ms: int | None = None,
) -> dict:
    """One run of ``world`` ranks on ``wire_kind`` (``stream``, ``unary``, or ``relay``: as
    ``world / 8`` nodes, :func:`node_task`), each sending at most a batch every ``interval_s``
    (all at the same instants unless ``spread``: see :func:`rank_task`), with ``viewers`` live
    viewers and ``scrapers`` Prometheus scrapers (``metrics``: the aggregator serves
    ``/metrics``, scraped or not), against ``server`` (``aggregator``, or ``transport``:
    :mod:`transport_floor`, gRPC alone); prints and returns its figures (records/s, ack median
    and p99 in s, connect s, server CPU % of a core and µs a batch and a message, RSS bytes).
    Without ``summary_at_stop`` the aggregator writes no summary when stopped. With
    ``sessions`` (against the aggregator only) each node also holds its launcher's session
    (:func:`session_task`). With ``pace_ms`` (:func:`paced_case`) the aggregator's Acks must
    have asked for that pace while the senders streamed, or the run fails."""
    nodes = world // NODE_RANKS
    if wire_kind == "relay" and nodes * NODE_RANKS != world:
        raise SystemExit(f"the relay wire simulates nodes of {NODE_RANKS} ranks: not {world}")
    senders = nodes if wire_kind == "relay" else world
    metrics_port = free_port()
    # Every step stays (the store's count is checked below); the retention's prune is timed by
    # benchmarks/retention.py.
    extra = ("--keep-all-steps",) + (() if summary_at_stop else ("--no-summary-at-stop",))
    extra += ("--metrics-port", str(metrics_port)) if metrics or scrapers else ()
    with (
        tempfile.TemporaryDirectory() as tmp,
        (
            LiveAggregator(Path(tmp) / "run", RUN, world_size=world, extra_args=extra)
            if server == "aggregator"
            else TransportFloor(free_port())
        ) as agg,
    ):
        rss_idle = peak_rss_bytes(agg.process.pid)
        clients = start_clients(
            __file__,
            agg.target,
            senders,
            min(procs, senders),
            str(world),
            str(batches),
            str(records),
            wire_kind,
            str(interval_s),
            str(int(spread)),
            str(int(sessions and server == "aggregator")),
        )
        start = time.time()
        tell(clients, "connect")
        stop, calls, scrapes = threading.Event(), [], []
        threads = [
            threading.Thread(target=viewer, args=(agg.target, stop, calls)) for _ in range(viewers)
        ]
        url = f"http://127.0.0.1:{metrics_port}/metrics"
        threads += [
            threading.Thread(target=scraper, args=(url, stop, scrapes)) for _ in range(scrapers)
        ]
        for thread in threads:  # views open from the job's start, as --mode cli's
            thread.start()
        time.sleep(max(3.0, world / 200))  # every rank connected and identified, surely
        aggregator = psutil.Process(agg.process.pid)
        cpu_before = sum(aggregator.cpu_times()[:2])
        calls.clear()
        scrapes.clear()
        tell(clients, "go")
        times = [json.loads(c.communicate()[0].splitlines()[-1]) for c in clients]
        stop.set()
        for thread in threads:
            thread.join()
        assert all(c.returncode == 0 for c in clients)
        cpu_s = sum(aggregator.cpu_times()[:2]) - cpu_before
        rss_peak = peak_rss_bytes(agg.process.pid)
        stop_start = time.perf_counter()
        assert agg.stop(timeout_s=600) == 0
        stop_s = time.perf_counter() - stop_start
        total = world * batches * records
        collector = ""
        if server == "aggregator":  # gRPC alone stores nothing (every client ended: all acked)
            log = agg.log()
            found = re.search(rf"{re.escape(SERVING_TALLY)}: ([^\n]*)", log)
            collector = f"; its cyclic GC while serving: {found.group(1)}" if found else ""
            if sessions:  # a node silent for NODE_LOST_AFTER_S: the run would report it
                collector += f"; nodes marked lost: {log.count('lost: nothing from its')}"
            stored = agg.query("SELECT COUNT(*) FROM steps")[0][0]
            assert stored == total, (stored, total)
            if wire_kind == "relay":  # the node samplers' (the identity message's and each)
                samples = agg.query("SELECT COUNT(*) FROM system_samples")[0][0]
                expected = nodes * (batches + 1) * node_samples(interval_s)
                assert samples == expected, (samples, expected)

    created = max(t["created"] for t in times) - start
    connected = max(t["ready"] for t in times) - start
    identified = max(t["first_acked"] for t in times) - start
    go = min(t["go"] for t in times)
    streaming = max(t["done"] for t in times) - go
    errors: dict[str, int] = {}
    for t in times:
        for code, n in t["errors"].items():
            errors[code] = errors.get(code, 0) + n
    acks = [a for t in times for a in t["ack_s"]]
    asked = sorted({p for t in times for p in t["paces_ms"]})  # of each sender's first batch
    if pace_ms is not None and server == "aggregator" and asked != [pace_ms]:
        raise SystemExit(f"node 0's Acks asked for a flush every {asked} ms, not {pace_ms} ms")
    figures = {
        "rate": total / streaming,
        "ack_median": median(acks),
        "ack_p99": p99(acks),
        "identified_s": identified,
        "cpu_pct": 100 * cpu_s / streaming,
        "cpu_batch_us": 1e6 * cpu_s / (world * batches),
        "cpu_message_us": 1e6 * cpu_s / (senders * batches),  # a batch, or a RelayUp
        "connected_s": connected,
        "rss_peak": rss_peak,
    }
    view = (
        f"{viewers} viewers ({len(calls)} Summarize calls, median {median(calls) * 1000:.0f} ms)"
        if calls
        else f"{viewers} viewers"
    )
    answered = [s for s in scrapes if s is not None]
    if scrapers:
        took = f", median {median(answered) * 1000:.0f} ms" if answered else ""
        view += (
            f", {scrapers} scrapers ({len(answered)} scrapes answered{took}, "
            f"{len(scrapes) - len(answered)} answered 503)"
        )
    pacing = " (spread)" if spread and interval_s else ""
    asking = (
        f"; node 0's Acks asked for {' and '.join(_pace_text(p) for p in asked)}"
        if server == "aggregator"
        else ""
    )
    alone = ", gRPC transport alone" if server == "transport" else ""
    relayed, message, sampled = "", "", ""
    heartbeats = sum(t["heartbeats"] for t in times)
    carried = sum(t["relayed_heartbeats"] for t in times)
    beats = (
        f"{heartbeats} heartbeats on {node_count(world)} node sessions"
        + (f", {carried} carried by the relays" if carried else "")
        if heartbeats or carried
        else "no node sessions"
    )
    if wire_kind == "relay":
        relayed = (
            f"{nodes} node{'s' if nodes > 1 else ''}, one Relay call each, a RelayUp of "
            f"{NODE_RANKS} ranks' batches and the node sampler's every {interval_s:g} s, "
            f"{beats}; "
        )
        message = f"{figures['cpu_message_us']:.0f} µs a RelayUp, "
        sampled = f" (and {nodes * (batches + 1) * node_samples(interval_s)} system samples)"
    elif heartbeats:
        view += f", {beats}"
    print(
        f"  {wire_kind:>6} {world:>5} ranks, a batch every {interval_s:g} s{pacing}, "
        f"{view}{alone}: {relayed}"
        f"channels created {created:.2f} s, all connected {connected:.2f} s, "
        f"all identified {identified:.2f} s; "
        f"{total} records in {streaming:.2f} s = {total / streaming / 1000:.0f}k records/s"
        f"{sampled} "
        f"(server CPU {cpu_s / total * 1e6:.1f} µs a record, {message}"
        f"{figures['cpu_batch_us']:.0f} µs a batch, "
        f"{cpu_s / streaming:.0%} of a core); "
        f"server RSS {rss_idle / 2**20:.0f} MiB idle, {rss_peak / 2**20:.0f} MiB peak"
        f"{collector}; "
        f"failed calls sent again: {errors or 0}; server stop (SIGTERM to exit) {stop_s:.1f} s; "
        f"ack{' (a RelayUp)' if relayed else ''} median {figures['ack_median'] * 1000:.1f} ms, "
        f"p99 {figures['ack_p99'] * 1000:.1f} ms{asking}"
    )
    return figures


def _pace_text(pace_ms: int) -> str:
    return f"a flush every {pace_ms / 1000:g} s" if pace_ms else "no pace"


def paced_case(
    world: int, wire_kind: str, interval_s: float, records: int, batches: int
) -> tuple[float, int, int, int]:
    """``(interval_s, records, batches, pace_ms)`` of ``world`` ranks on ``wire_kind`` whose
    senders flush at node 0's pace, as the SDK's do (:mod:`traceml_aggregator.pace`: the pace
    of as many calls as the wire opens, a ``Stream`` a rank or a ``Relay`` a node; ``Push``
    opens none that stays): the longer of ``interval_s`` and the pace, the records of a batch
    scaled to send the same steps a second, and the batches to take about as long; unchanged
    when the pace is not longer, or ``interval_s`` is 0 (as fast as acknowledged)."""
    from traceml import settings
    from traceml.core.transport import NODE_LOST_AFTER_S
    from traceml_aggregator.pace import flush_pace_s

    calls = {"relay": world // NODE_RANKS, "stream": world}.get(wire_kind, 0)
    budget = settings.read(settings.AGGREGATOR_MESSAGES_PER_SEC)
    pace_s = flush_pace_s(calls, budget, NODE_LOST_AFTER_S)
    pace_ms = round(pace_s * 1000)
    if not interval_s or pace_s <= interval_s:
        return interval_s, records, batches, pace_ms
    scale = pace_s / interval_s
    return pace_s, round(records * scale), max(2, round(batches / scale)), pace_ms


def ratio(a: float, b: float) -> str:
    """``a / b`` as ``x1.23``; ``x-`` when ``b`` is 0 (a CPU time below the clock's 10 ms tick,
    as in a ``--short`` run)."""
    return f"x{a / b:.2f}" if b else "x-"


def main() -> None:
    if sys.argv[1:2] == ["--client"]:
        target, senders, world, batches, records, wire_kind, interval_s, spread, sessions = (
            sys.argv[2:]
        )
        t = asyncio.run(
            client_main(
                target,
                json.loads(senders),
                int(world),
                int(batches),
                int(records),
                wire_kind,
                float(interval_s),
                spread == "1",
                sessions == "1",
            )
        )
        print(json.dumps(t))
        return
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--batches", type=int, default=20, help="batches per rank (+ identity)")
    parser.add_argument("--records", type=int, default=100, help="step records per batch")
    parser.add_argument("--procs", type=int, default=2, help="client processes")
    parser.add_argument(
        "--viewers",
        type=int,
        nargs="+",
        default=[0],
        help="live viewers (Summarize at 1 Hz); each count is one run a trial",
    )
    parser.add_argument(
        "--scrapers",
        type=int,
        nargs="+",
        default=[0],
        help="Prometheus scrapers (GET /metrics at 1 Hz, together); each count is one run a trial",
    )
    parser.add_argument(
        "--trials",
        type=int,
        default=1,
        help="runs of each viewer or scraper count, alternating; medians are compared",
    )
    parser.add_argument(
        "--wire",
        nargs="+",
        choices=WIRES,
        help="the wires to run side by side, in this order (default: stream unary; relay: "
        "each rank count as nodes of 8 ranks and a sampler, a Relay call each)",
    )
    parser.add_argument(
        "--relay", action="store_true", help="also the relay wire (after those of --wire)"
    )
    parser.add_argument(
        "--interval-sec",
        type=float,
        nargs="+",
        default=[0.0],
        help="least seconds between two batches of a rank; each is one run",
    )
    parser.add_argument(
        "--pace",
        nargs="+",
        choices=("off", "on"),
        default=["off"],
        help="on: the senders flush at the pace node 0's Acks ask of that many calls "
        "(traceml_aggregator/pace.py), the longer of it and --interval-sec, with as many "
        "records a second; each is one run, side by side",
    )
    parser.add_argument(
        "--spread",
        action="store_true",
        help="paced ranks start at random phases of the interval, not together",
    )
    parser.add_argument(
        "--no-summary",
        action="store_true",
        help="the aggregator writes no summary at stop (ingest figures only)",
    )
    parser.add_argument(
        "--transport-floor",
        action="store_true",
        help="also run each case against gRPC alone (transport_floor.py)",
    )
    parser.add_argument(
        "--sessions",
        action="store_true",
        help="each node of 8 ranks also holds its launcher's NodeSession (a heartbeat every "
        "2 s), against the aggregator",
    )
    parser.add_argument(
        "--short",
        action="store_true",
        help="the CI smoke run: 8 ranks, 3 batches of 10 records, 0 and 0.2 s, the three wires "
        "unless --wire says",
    )
    args = parser.parse_args()
    if args.short:
        args.ranks, args.batches, args.records, args.interval_sec = [8], 3, 10, [0.0, 0.2]
        args.transport_floor = True
        args.relay = args.relay or args.wire is None
    args.wire = args.wire or ["stream", "unary"]
    args.wire += ["relay"] if args.relay and "relay" not in args.wire else []
    print(
        f"(d) ingest on loopback, {args.batches} batches x {args.records} records per rank, "
        f"{args.procs} client processes, wires {' and '.join(args.wire)} side by side "
        "(targets, streaming: >= 400k records/s at 4,096 ranks, 4,096 connected and identified "
        "<= 2 s; at a batch a second: ack p99 <= 200 ms and aggregator CPU <= 20 % of a core "
        "at 1,024 ranks)"
        + (
            "; relay: each 8 ranks one simulated node relay, one Relay call carrying its ranks' "
            "and its node sampler's batches (the node sessions, and the heartbeats the relay "
            "carries for them, only with --sessions)"
            if "relay" in args.wire
            else ""
        )
    )
    by_pace: dict[tuple, dict] = {}
    for world in args.ranks:
        for interval_s, paced in [(i, p) for i in args.interval_sec for p in args.pace]:
            side, floor = {}, {}
            for wire_kind in args.wire:
                # The aggregator with each viewer count, then gRPC alone (no viewers: it serves
                # no Summarize), alternating: a busy machine slows each alike.
                kinds = [("aggregator", v, s) for v in args.viewers for s in args.scrapers]
                kinds += [("transport", 0, 0)] if args.transport_floor else []
                runs: dict[tuple, list[dict]] = {kind: [] for kind in kinds}
                case_interval_s, case_records, case_batches, pace_ms = (
                    paced_case(world, wire_kind, interval_s, args.records, args.batches)
                    if paced == "on"
                    else (interval_s, args.records, args.batches, None)
                )
                metrics = any(args.scrapers)
                for _ in range(args.trials):
                    for server, viewers, scrapers in kinds:
                        runs[server, viewers, scrapers].append(
                            run_world(
                                world,
                                args.procs,
                                case_batches,
                                case_records,
                                viewers,
                                wire_kind,
                                case_interval_s,
                                not args.no_summary,
                                args.spread,
                                server,
                                scrapers,
                                metrics and server == "aggregator",
                                args.sessions,
                                pace_ms,
                            )
                        )
                medians = {
                    kind: {k: median([f[k] for f in fs]) for k in fs[0]}
                    for kind, fs in runs.items()
                }
                first = ("aggregator", args.viewers[0], args.scrapers[0])
                base = side[wire_kind] = by_pace[world, interval_s, wire_kind, paced] = medians[
                    first
                ]
                if args.transport_floor:
                    alone = floor[wire_kind] = medians["transport", 0, 0]
                    message = "a RelayUp" if wire_kind == "relay" else "a batch"
                    print(
                        f"        {wire_kind}, the aggregator against gRPC alone (medians of "
                        f"{args.trials}): CPU {base['cpu_message_us']:.0f} against "
                        f"{alone['cpu_message_us']:.0f} µs {message} "
                        f"({ratio(base['cpu_message_us'], alone['cpu_message_us'])}), "
                        f"{base['cpu_pct']:.0f} % against {alone['cpu_pct']:.0f} % of a core, "
                        f"ack p99 {base['ack_p99'] * 1000:.0f} against "
                        f"{alone['ack_p99'] * 1000:.0f} ms, records/s "
                        f"{ratio(base['rate'], alone['rate'])}"
                    )
                for kind, m in medians.items():
                    if kind == first or kind[0] == "transport":
                        continue
                    pairs = list(zip(runs[kind], runs[first], strict=True))
                    paired = {
                        k: median([a[k] / b[k] for a, b in pairs]) for k in ("rate", "ack_p99")
                    }
                    target = "within 5 %" if kind[1] != first[1] else "ack p99 within 10 %"
                    print(
                        f"        {wire_kind}, {kind[1]} viewers and {kind[2]} scrapers against "
                        f"{first[1]} and {first[2]} (medians of {args.trials}): ack p99 "
                        f"{m['ack_p99'] * 1000:.1f} against {base['ack_p99'] * 1000:.1f} ms, "
                        f"ingest rate x{m['rate'] / base['rate']:.3f}, "
                        f"ack p99 x{m['ack_p99'] / base['ack_p99']:.3f}; median of the "
                        f"{args.trials} back-to-back pairs' ratios: ingest rate "
                        f"x{paired['rate']:.3f}, ack p99 x{paired['ack_p99']:.3f} "
                        f"(target: {target})"
                    )
            for new, old in (("stream", "unary"), ("relay", "stream")):
                if new in side and old in side:
                    against(new, old, world, interval_s, side, floor)
            if paced == args.pace[-1] != args.pace[0]:
                for wire_kind in args.wire:
                    a = by_pace[world, interval_s, wire_kind, "on"]
                    b = by_pace[world, interval_s, wire_kind, "off"]
                    print(
                        f"        {wire_kind}, {world} ranks, at node 0's pace against a batch "
                        f"every {interval_s:g} s: aggregator CPU {a['cpu_pct']:.0f} % against "
                        f"{b['cpu_pct']:.0f} % of a core ({ratio(a['cpu_pct'], b['cpu_pct'])}), "
                        f"ack p99 {a['ack_p99'] * 1000:.0f} against {b['ack_p99'] * 1000:.0f} ms, "
                        f"RSS peak {a['rss_peak'] / 2**20:.0f} against "
                        f"{b['rss_peak'] / 2**20:.0f} MiB"
                    )


def against(new: str, old: str, world: int, interval_s: float, side: dict, floor: dict) -> None:
    """Print wire ``new``'s figures against wire ``old``'s (medians, in ``side``; gRPC alone's
    in ``floor``, when it ran) as ratios, side by side."""
    a, b = side[new], side[old]
    acks = " (a RelayUp's against a batch's)" if new == "relay" else ""
    line = (
        f"        {new} against {old}, {world} ranks, a batch every {interval_s:g} s: "
        f"records/s x{a['rate'] / b['rate']:.2f}, ack p99{acks} "
        f"x{a['ack_p99'] / b['ack_p99']:.2f}, aggregator CPU "
        f"{ratio(a['cpu_pct'], b['cpu_pct'])} ({a['cpu_batch_us']:.0f} against "
        f"{b['cpu_batch_us']:.0f} µs a rank's batch), RSS peak "
        f"x{a['rss_peak'] / b['rss_peak']:.2f}, connected in {a['connected_s']:.2f} s against "
        f"{b['connected_s']:.2f} s, identified in "
        f"{a['identified_s']:.2f} s against {b['identified_s']:.2f} s"
    )
    if new in floor and old in floor:
        fa, fb = floor[new], floor[old]
        line += (
            f"; gRPC alone: CPU {ratio(fa['cpu_pct'], fb['cpu_pct'])} ({fa['cpu_batch_us']:.0f} "
            f"against {fb['cpu_batch_us']:.0f} µs a rank's batch), ack p99 "
            f"x{fa['ack_p99'] / fb['ack_p99']:.2f}"
        )
    print(line)


if __name__ == "__main__":
    main()
