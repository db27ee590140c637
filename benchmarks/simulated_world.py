"""A large simulated world for the dashboard's scale views: every rank's batches pushed straight
to a real aggregator over gRPC, one planted input straggler among them.

Used by ``benchmarks/dashboard.py --browser`` and ``tests/test_dashboard_scale.py``. Each rank
steps every :data:`STEP_US` µs: input wait 1 ms, forward 6 ms, backward 14 ms, optimizer 2 ms
(plus a little jitter, rank by rank), the rest outside every phase; the planted rank waits
:data:`SLOW_INPUT_US` µs more for its input every step. Ranks sit :data:`RANKS_PER_NODE` to a
node (``node_rank = rank // RANKS_PER_NODE``, host ``node<N>``). Needs only the package.
"""

from __future__ import annotations

import concurrent.futures

from traceml import wire
from traceml.core.transport import open_channel
from traceml.wire.records import add_steps

#: A balanced rank's step time, µs.
STEP_US = 25_000
#: The planted straggler's extra input wait a step, µs.
SLOW_INPUT_US = 12_000
#: Ranks per node.
RANKS_PER_NODE = 8
#: Each simulated step ends this long after the previous one, µs (the planted rank's pace).
PERIOD_US = STEP_US + SLOW_INPUT_US
#: Steps between two process samples of a rank.
SAMPLE_EVERY = 16


def _row(rank: int, i: int, slow: bool) -> dict[str, int]:
    jitter = (rank * 7 + i * 13) % 400  # µs, deterministic
    extra = SLOW_INPUT_US if slow else 0
    step_us = STEP_US + jitter + extra
    return {
        "step": i,
        "end_us": (i + 1) * PERIOD_US,
        "step_us": step_us,
        "input_wait_us": 1_000 + extra,
        "forward_us": 6_000 + jitter,
        "backward_us": 14_000,
        "optimizer_us": 2_000,
    }


def rank_batches(
    run_name: str, world: int, steps: range, seq: int, slow_rank: int | None, start_unix_us: int
) -> list[wire.Batch]:
    """Batch ``seq`` of every rank of a ``world``-rank run that started at ``start_unix_us``
    (µs since the epoch): steps ``steps``, a process sample every :data:`SAMPLE_EVERY` steps,
    and (``seq`` 1) the rank's identity."""
    out = []
    for rank in range(world):
        batch = wire.Batch(run_name=run_name, rank=rank, seq=seq)
        if seq == 1:
            node = rank // RANKS_PER_NODE
            batch.identity.CopyFrom(
                wire.RankIdentity(
                    run_name=run_name,
                    rank=rank,
                    local_rank=rank % RANKS_PER_NODE,
                    node_rank=node,
                    world_size=world,
                    hostname=f"node{node}",
                    start_unix_us=start_unix_us,
                )
            )
        add_steps(batch, (_row(rank, i, rank == slow_rank) for i in steps))
        for i in steps[::SAMPLE_EVERY]:  # RSS growing 1 MiB every SAMPLE_EVERY steps
            batch.process_samples.add(
                unix_us=start_unix_us + (i + 1) * PERIOD_US,
                cpu_percent=95.0,
                rss_bytes=(2 << 30) + (i // SAMPLE_EVERY << 20) + rank * 4096,
            )
        out.append(batch)
    return out


def push(target: str, batches: list[wire.Batch], threads: int = 4) -> None:
    """Push ``batches`` to the aggregator at ``target`` (one channel, ``threads`` at a time).

    Raises:
        AssertionError: a batch was not stored or was refused.
        grpc.RpcError: a call failed.
    """
    with open_channel(target) as channel:
        stub = wire.AggregatorStub(channel)

        def one(batch: wire.Batch) -> None:
            ack = stub.Push(batch, timeout=60.0)
            assert ack.stored_seq == batch.seq and not ack.rejected, ack

        with concurrent.futures.ThreadPoolExecutor(threads) as pool:
            list(pool.map(one, batches))
