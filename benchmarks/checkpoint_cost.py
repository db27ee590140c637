"""What a periodic checkpoint of the live aggregates costs node 0's aggregator in steady state
(traceml_aggregator/checkpoint.py), per rank: CPU (the event loop's pickling and the writer
thread's SQLite, together) and bytes written to the store.

In one process, as the aggregator keeps them: a real :class:`~traceml_aggregator.store.Store`,
its :class:`~traceml_aggregator.writer.Writer` folding each committed batch into
:class:`~traceml_aggregator.live.LiveAggregates`, and a
:class:`~traceml_aggregator.checkpoint.Checkpointer`. ``--ranks`` ranks of a world of
``--world-size`` (8,000 by default: each rank's final series bounded at 128 steps, as at 1,000
nodes x 8) each store ``--warm-steps`` steps (digests, samples and windows full), then the
first checkpoint is taken (every rank's row written whole); then ``--repeat`` times each rank
stores ``--steps-between`` more steps (30: one checkpoint interval of the default 30 s at 1
step/s) and a checkpoint is taken: those are the steady state's, whose means are printed (CPU
ms per checkpoint and µs per rank, bytes per rank; the first checkpoint's beside them): each
rank's window is written whole again every
:data:`~traceml_aggregator.checkpoint.WINDOW_ROWS` checkpoints (16, the default ``--repeat``,
covers two of those), so the mean is what checkpoints cost over time. After each steady-state
checkpoint it also times what a restart would read of it (the ranks' rows, their series and
windows: :func:`~traceml_aggregator.checkpoint.read_ranks`), CPU µs a rank, the mean and the
most (a rank's window in the most rows).
The steps' µs values are drawn at random (a fixed seed), so the digests' sketches are as wide
as a real run's.

With ``--baseline DIR`` (another TraceML source tree, e.g. ``git worktree add /tmp/base
<commit>``) the same measurement runs with that tree too, in a subprocess before this tree's,
and the ratios are printed. Usage::

    PYTHONPATH=. python benchmarks/checkpoint_cost.py [--ranks 1024] [--baseline /tmp/base]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import ROOT, in_tree  # noqa: E402

#: Steps a rank's batch carries while warming up (a sender's batch of ~1 s at ~50 steps/s).
WARM_STEPS_PER_BATCH = 64


def measure(ranks: int, world_size: int, warm_steps: int, between: int, repeat: int) -> dict:
    """The checkpoints' costs with the tree this process imports (see the module)."""
    from traceml import wire
    from traceml.wire.records import add_steps
    from traceml_aggregator.checkpoint import Checkpointer, read_ranks
    from traceml_aggregator.live import LiveAggregates
    from traceml_aggregator.store import Store
    from traceml_aggregator.writer import Writer

    rng = random.Random(1)
    seqs = [0] * ranks

    def batch(rank: int, first: int, count: int) -> wire.Batch:
        seqs[rank] += 1
        b = wire.Batch(run_name="bench", rank=rank, seq=seqs[rank])
        add_steps(
            b,
            (
                {
                    "step": i,
                    "end_us": 100_000 * (i + 1),
                    "step_us": rng.randint(80_000, 120_000),
                    "forward_us": rng.randint(20_000, 40_000),
                    "backward_us": rng.randint(40_000, 60_000),
                    "optimizer_us": rng.randint(5_000, 9_000),
                    "input_wait_us": rng.randint(100, 3_000),
                }
                for i in range(first, first + count)
            ),
        )
        return b

    async def run(directory: str) -> dict:
        store = Store(Path(directory) / "telemetry.sqlite")
        live = LiveAggregates("bench", world_size)
        writer = Writer(store, live.on_batch)
        checkpointer = Checkpointer(live.seed(store), live, writer)
        writer.start()
        stored = 0

        async def store_steps(count: int, per_batch: int) -> None:
            nonlocal stored
            for first in range(stored, stored + count, per_batch):
                n = min(per_batch, stored + count - first)
                await asyncio.gather(
                    *(writer.queue_batch(batch(r, first, n)) for r in range(ranks))
                )
            stored += count

        async def checkpoint() -> tuple[float, int]:
            cpu = time.process_time()
            await checkpointer.write()
            return (time.process_time() - cpu) * 1000, checkpointer.last_bytes

        async def restart_read() -> float:
            cpu = time.process_time()
            await writer.call(read_ranks, store)
            return (time.process_time() - cpu) * 1000

        await store_steps(warm_steps, WARM_STEPS_PER_BATCH)
        first_ms, first_bytes = await checkpoint()
        steady, reads = [], []
        for _ in range(repeat):
            await store_steps(between, between)
            steady.append(await checkpoint())
            reads.append(await restart_read())
        await writer.close()  # closes the store
        return {
            "first_ms": first_ms,
            "first_bytes": first_bytes,
            "ms": statistics.mean(ms for ms, _ in steady),
            "bytes": statistics.mean(b for _, b in steady),
            "read_ms": statistics.mean(reads),
            "read_max_ms": max(reads),
        }

    with tempfile.TemporaryDirectory() as directory:
        return asyncio.run(run(directory))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--world-size", type=int, default=8000)
    parser.add_argument("--warm-steps", type=int, default=2048)
    parser.add_argument("--steps-between", type=int, default=30)
    parser.add_argument("--repeat", type=int, default=16)
    parser.add_argument("--baseline", type=Path, help="another TraceML source tree")
    parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)  # one tree's run
    args = parser.parse_args()
    sizes = (args.ranks, args.world_size, args.warm_steps, args.steps_between, args.repeat)
    if args.json:
        print(json.dumps(measure(*sizes)))
        return 0
    trees = {"this": ROOT} | ({"baseline": args.baseline.resolve()} if args.baseline else {})
    results = {}
    for name, tree in reversed(trees.items()):  # the baseline first, then this tree
        results[name] = r = in_tree(tree, [__file__, "--json", *sys.argv[1:]])
        per_rank = {k: v / args.ranks for k, v in r.items()}
        print(
            f"{name}: steady state {r['ms']:.0f} ms of CPU a checkpoint, "
            f"{per_rank['ms'] * 1000:.0f} µs a rank, {per_rank['bytes'] / 1024:.1f} KiB a rank "
            f"(the first: {per_rank['first_ms'] * 1000:.0f} µs, "
            f"{per_rank['first_bytes'] / 1024:.1f} KiB a rank); a restart reads a rank's rows in "
            f"{per_rank['read_ms'] * 1000:.0f} µs (at most {per_rank['read_max_ms'] * 1000:.0f})",
            flush=True,
        )
    if args.baseline:
        this, base = results["this"], results["baseline"]
        print(
            f"this / baseline: CPU {this['ms'] / base['ms']:.2f}, "
            f"bytes {this['bytes'] / base['bytes']:.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
