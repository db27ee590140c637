"""Fuzzing a running aggregator: thousands of random, mutated and adversarial messages on
every method, with the run token, without it and with a wrong one (hypothesis). The two
streaming methods (a rank's or sampler's ``Stream``, a launcher's ``NodeSession``) get streams
of one to four such messages, then a half-close.

Afterwards the aggregator is alive and serving, nothing it was sent without the token reached
the store, nothing invalid with the token did either (no row names a rank >= the world size or
another world size), and a real 2-rank job under plain torchrun through the same aggregator
stores exactly its steps.

One exception keeps the last check meaningful: a message that parses as a batch of this run
from rank 0 or 1 is not sent with the token. It could be valid, and then it is rightly stored
as that rank's stream (a higher attempt, a sequence number ahead), which the real ranks'
batches would then meet as an older attempt or as duplicates.
"""

from __future__ import annotations

import subprocess
import sys
import time

import grpc
import pytest
from conftest import SCRIPTS, TEST_RUN_TOKEN, free_port, traceml_env
from helpers.batches import rank_batch
from helpers.waiting import LOADED_CALL_S
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from live_aggregator import LiveAggregator

from traceml import wire
from traceml.core.transport import MAX_MESSAGE_BYTES, Credentials, open_channel
from traceml.launcher.aggregator import wait_serving

RUN, WORLD = "fuzz", 2
STEPS = 12
METHODS = ("Push", "ReportNodeExit", "Finalize", "Summarize")
STREAMS = ("Stream", "NodeSession")
TOKENS = {"valid": TEST_RUN_TOKEN, "none": "", "wrong": TEST_RUN_TOKEN[::-1]}
U32, U64 = st.integers(0, 2**32 - 1), st.integers(0, 2**64 - 1)
# Small values most of the time, the edges sometimes.
SMALL_U32 = st.one_of(st.integers(0, 4), U32)
NAMES = st.sampled_from([RUN, "other", "", "fuzz\x00", "f" * 200])


def _seed_messages() -> dict[str, list[bytes]]:
    """Valid messages of each method, the starting points of the mutations."""
    batch = rank_batch(
        1,
        range(4),
        rank=5,
        run_name=RUN,
        row=lambda i: {"step": i, "end_us": 1000 * i, "step_us": 900, "forward_us": 100},
        identity=wire.RankIdentity(run_name=RUN, rank=5, world_size=WORLD, pid=9),
        finish=wire.RankFinish(last_seq=1, steps_completed=4),
    )
    sampler = wire.Batch(run_name=RUN, node_rank=3, seq=2)
    sampler.system_samples.add(node_rank=3, unix_us=1, hostname="h", cpu_percent=5.0)
    sampler.process_samples.add(rank=7, unix_us=1, rss_bytes=10)
    node_exit = wire.NodeExit(
        run_name=RUN,
        node_rank=4,
        exit_code=1,
        ranks=[
            wire.RankEnd(
                rank=6, local_rank=0, end_state=wire.EndState.END_STATE_FAILED, exit_code=1
            )
        ],
    )
    node_ups = [
        wire.NodeUp(
            claim=wire.NodeClaim(run_name=RUN, node_rank=3, nnodes=4, hostname="h", launcher_pid=9)
        ),
        wire.NodeUp(heartbeat=wire.NodeHeartbeat()),
        wire.NodeUp(exit=node_exit),
        wire.NodeUp(finalize=wire.FinalizeRequest(run_name=RUN, timeout_s=0.5)),
        wire.NodeUp(goodbye=wire.NodeGoodbye()),
    ]
    return {
        "Push": [batch.SerializeToString(), sampler.SerializeToString()],
        "Stream": [
            batch.SerializeToString(),
            sampler.SerializeToString(),
            wire.Batch(closing=True).SerializeToString(),
        ],
        "NodeSession": [up.SerializeToString() for up in node_ups],
        "ReportNodeExit": [node_exit.SerializeToString()],
        "Finalize": [wire.FinalizeRequest(run_name=RUN, timeout_s=0.5).SerializeToString()],
        "Summarize": [wire.SummarizeRequest(run_name=RUN).SerializeToString()],
    }


SEEDS = _seed_messages()


@st.composite
def mutated(draw, method: str) -> bytes:
    """A seed message of ``method`` with bytes flipped, inserted, deleted or cut off."""
    data = bytearray(draw(st.sampled_from(SEEDS[method])))
    for _ in range(draw(st.integers(1, 6))):
        op = draw(st.sampled_from(("flip", "insert", "delete", "truncate")))
        pos = draw(st.integers(0, max(0, len(data) - 1)))
        if op == "flip" and data:
            data[pos] ^= 1 << draw(st.integers(0, 7))
        elif op == "insert":
            data[pos:pos] = draw(st.binary(min_size=1, max_size=8))
        elif op == "delete" and data:
            del data[pos]
        elif op == "truncate":
            del data[pos:]
    return bytes(data)


@st.composite
def adversarial_batch(draw) -> bytes:
    """A well-formed Batch with hostile values: any sender, attempt and sequence number,
    64-bit extremes, columns of uneven length, identities of other ranks and world sizes."""
    b = wire.Batch(run_name=draw(NAMES), restart_count=draw(SMALL_U32), seq=draw(U64))
    if draw(st.booleans()):
        b.rank = draw(SMALL_U32)
    else:
        b.node_rank = draw(SMALL_U32)
    if draw(st.booleans()):
        b.identity.CopyFrom(
            wire.RankIdentity(
                run_name=draw(NAMES),
                rank=draw(SMALL_U32),
                world_size=draw(SMALL_U32),
                node_rank=draw(SMALL_U32),
                restart_count=draw(SMALL_U32),
                pid=draw(U32),
                hostname=draw(st.text(max_size=20)),
            )
        )
    for _ in range(draw(st.integers(0, 2))):
        group = b.step_groups.add()
        for name in draw(
            st.lists(st.sampled_from(("step", "end_us", "step_us", "forward_us")), unique=True)
        ):
            getattr(group, name).extend(draw(st.lists(U64, max_size=5)))
    if draw(st.booleans()):
        b.process_samples.add(rank=draw(SMALL_U32), unix_us=draw(U64))
    if draw(st.booleans()):
        b.system_samples.add(node_rank=draw(SMALL_U32), unix_us=draw(U64))
    if draw(st.booleans()):
        b.finish.CopyFrom(wire.RankFinish(last_seq=draw(U64), steps_completed=draw(U64)))
    return b.SerializeToString()


@st.composite
def adversarial_node_exit(draw) -> bytes:
    """A well-formed NodeExit of any node, naming any ranks."""
    return wire.NodeExit(
        run_name=draw(NAMES),
        node_rank=draw(SMALL_U32),
        exit_code=draw(st.integers(-5, 300)),
        ranks=[
            wire.RankEnd(
                rank=draw(SMALL_U32), local_rank=draw(SMALL_U32), end_state=draw(st.integers(0, 4))
            )
            for _ in range(draw(st.integers(0, 3)))
        ],
    ).SerializeToString()


@st.composite
def adversarial_node_up(draw) -> bytes:
    """A well-formed NodeUp: a claim of any node and node count (refused by its launcher or
    not), an adversarial exit, a finalization request of any budget, a heartbeat, a goodbye."""
    kind = draw(st.sampled_from(("claim", "exit", "finalize", "heartbeat", "goodbye")))
    if kind == "claim":
        return wire.NodeUp(
            claim=wire.NodeClaim(
                run_name=draw(NAMES),
                node_rank=draw(SMALL_U32),
                nnodes=draw(SMALL_U32),
                hostname=draw(st.text(max_size=20)),
                launcher_pid=draw(U32),
                refusal=draw(st.sampled_from(("", "refused by its launcher"))),
            )
        ).SerializeToString()
    if kind == "exit":
        report = wire.NodeExit.FromString(draw(adversarial_node_exit()))
        return wire.NodeUp(exit=report).SerializeToString()
    if kind == "finalize":
        return wire.NodeUp(
            finalize=wire.FinalizeRequest(
                run_name=draw(NAMES), timeout_s=draw(st.floats(-1.0, 0.5))
            )
        ).SerializeToString()
    if kind == "heartbeat":
        return wire.NodeUp(heartbeat=wire.NodeHeartbeat()).SerializeToString()
    return wire.NodeUp(goodbye=wire.NodeGoodbye()).SerializeToString()


def payloads(method: str):
    """Random bytes, mutated seeds and (Push, Stream, ReportNodeExit, NodeSession) adversarial
    messages."""
    options = [st.binary(max_size=512), mutated(method)]
    if method in ("Push", "Stream"):
        options.append(adversarial_batch())
    if method == "ReportNodeExit":
        options.append(adversarial_node_exit())
    if method == "NodeSession":
        options.append(adversarial_node_up())
    return st.one_of(options)


@st.composite
def claim_of_this_run(draw) -> bytes:
    """A NodeUp claim of this run by any of 8 nodes of a run of any size up to 8 (accepted or
    refused by the aggregator): what opens a session past its first check."""
    return wire.NodeUp(
        claim=wire.NodeClaim(
            run_name=RUN,
            node_rank=draw(st.integers(0, 7)),
            nnodes=draw(st.integers(0, 8)),
            hostname="fuzz",
            launcher_pid=draw(U32),
        )
    ).SerializeToString()


def requests(method: str):
    """One call's request: a message, or (a streaming method) a list of one to four; half the
    node sessions begin with a claim of this run."""
    if method == "NodeSession":
        return st.one_of(
            st.lists(payloads(method), min_size=1, max_size=4),
            st.tuples(claim_of_this_run(), st.lists(payloads(method), max_size=3)).map(
                lambda first_rest: [first_rest[0], *first_rest[1]]
            ),
        )
    if method == "Stream":
        return st.lists(payloads(method), min_size=1, max_size=4)
    return payloads(method)


CALL = st.sampled_from(METHODS + STREAMS).flatmap(
    lambda m: st.tuples(st.just(m), st.sampled_from(sorted(TOKENS)), requests(m))
)


def could_be_a_real_ranks_batch(data: bytes) -> bool:
    """Whether ``data`` parses as a batch of this run from rank 0 or 1 (see the docstring)."""
    try:
        batch = wire.Batch.FromString(data)
    except Exception:
        return False
    return (
        batch.run_name == RUN
        and batch.WhichOneof("sender") in (None, "rank")
        and (batch.rank < WORLD)
    )


@pytest.mark.torchrun
@pytest.mark.aggregator
@pytest.mark.slow
def test_fuzzed_aggregator_stays_up_stores_nothing_invalid_and_serves_a_real_run(tmp_path):
    with LiveAggregator(
        tmp_path / "run", RUN, world_size=WORLD, extra_args=("--finalize-timeout-sec", "0.05")
    ) as agg:
        channels = {
            name: open_channel(agg.target, credentials=Credentials(token=token))
            for name, token in TOKENS.items()
        }
        calls = {
            (name, method): channel.unary_unary(f"/traceml.wire.v1.Aggregator/{method}")
            for name, channel in channels.items()
            for method in METHODS
        }
        calls.update(
            {
                (name, method): channel.stream_stream(f"/traceml.wire.v1.Aggregator/{method}")
                for name, channel in channels.items()
                for method in STREAMS
            }
        )
        sent = {"valid": 0, "none": 0, "wrong": 0}
        codes: dict[str, set] = {name: set() for name in TOKENS}
        stream_codes: dict[str, set] = {method: set() for method in STREAMS}  # with the token

        @settings(
            max_examples=400, deadline=None, database=None, suppress_health_check=list(HealthCheck)
        )
        @given(st.lists(CALL, min_size=4, max_size=10))
        def feed(batch_of_calls):
            in_flight = []  # the calls of one example go out together
            for method, token, data in batch_of_calls:
                if method in STREAMS:
                    data = [
                        m
                        for m in data
                        if not (
                            token == "valid"
                            and method == "Stream"
                            and could_be_a_real_ranks_batch(m)
                        )
                    ]
                    if data:  # a stream's call starts at once, reading the list on its own
                        in_flight.append(
                            (method, token, data, calls[token, method](iter(data), timeout=10))
                        )
                    continue
                if token == "valid" and method == "Push" and could_be_a_real_ranks_batch(data):
                    continue
                in_flight.append(
                    (method, token, data, calls[token, method].future(data, timeout=10))
                )
            for method, token, data, future in in_flight:
                if method in STREAMS:
                    try:
                        for _ in future:  # every reply, until the aggregator ends the stream
                            pass
                    except grpc.RpcError:
                        pass
                code = future.code()
                sent[token] += 1
                codes[token].add(code)
                if method in STREAMS and token == "valid":
                    stream_codes[method].add(code)
                if token != "valid":
                    assert code == grpc.StatusCode.UNAUTHENTICATED, (method, data)

        started = time.monotonic()
        feed()
        # One message above the wire's bound, with the token: refused by gRPC, not parsed.
        with pytest.raises(grpc.RpcError) as oversized:
            calls["valid", "Push"](b"\x0a" + b"\xff" * MAX_MESSAGE_BYTES, timeout=30)
        assert oversized.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        fuzz_s = time.monotonic() - started
        for channel in channels.values():
            channel.close()
        assert sum(sent.values()) >= 2000, sent
        assert min(sent.values()) >= 500, sent
        assert codes["none"] == codes["wrong"] == {grpc.StatusCode.UNAUTHENTICATED}
        # Streams with the token were served to their end, and some were refused.
        assert grpc.StatusCode.OK in stream_codes["Stream"], stream_codes
        assert {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT} <= stream_codes[
            "NodeSession"
        ], stream_codes  # refused: a session not begun by a claim
        print(
            f"fuzz: {sent} calls in {fuzz_s:.1f} s; codes with the token: "
            f"{sorted(c.name for c in codes['valid'])}; of its streams: "
            f"{ {m: sorted(c.name for c in cs) for m, cs in stream_codes.items()} }"
        )

        # Alive and serving.
        assert agg.process.poll() is None
        wait_serving(agg.target, LOADED_CALL_S, agg.process)

        # A real 2-rank job through it.
        env = traceml_env(
            {
                "TRACEML_AGGREGATOR": agg.target,
                "TRACEML_RUN_NAME": RUN,
                "TRACEML_FLUSH_INTERVAL_SEC": "0.2",
            }
        )
        job = subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nproc-per-node=2",
                f"--master-port={free_port()}",
                "--master-addr=127.0.0.1",
                str(SCRIPTS / "faulty_ddp.py"),
                "--steps",
                str(STEPS),
            ],
            env=env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=240,
        )
        assert job.returncode == 0, job.stderr[-3000:]
        assert agg.stop() == 0

    assert agg.query(
        "SELECT rank, restart, COUNT(*), COUNT(DISTINCT step) FROM steps GROUP BY rank, restart"
    ) == [(0, 0, STEPS, STEPS), (1, 0, STEPS, STEPS)]
    assert agg.query("SELECT rank, restart, world_size FROM ranks ORDER BY rank") == [
        (0, 0, WORLD),
        (1, 0, WORLD),
    ]
    assert agg.query("SELECT rank, steps_completed FROM rank_finish ORDER BY rank") == [
        (0, STEPS),
        (1, STEPS),
    ]
    # Nothing stored names a rank outside the run, whatever was sent.
    for table in ("process_samples", "rank_ends"):
        assert agg.query(f"SELECT COUNT(*) FROM {table} WHERE rank >= {WORLD}") == [(0,)], table
    assert "Traceback" not in agg.log()
