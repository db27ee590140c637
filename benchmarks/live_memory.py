"""The live aggregates' memory: what node 0's aggregator holds per rank once its windows fill.

Each rank's live state (:class:`~traceml_aggregator.live.windows.RankLive`: its window of the
latest :data:`~traceml_aggregator.live.analysis_process.WINDOW_STEPS` steps, one packed int64
column per step field measured, its series and digest) grows with the steps stored until the
window and the series are full, then stays. A short benchmark run (``ingest.py``'s 30 s at 1
step/s) sees 30-step windows; a long run, full ones. This folds ``--steps`` steps of each of
``--ranks`` ranks (the ingest benchmark's steps: 8 fields measured, 2 steps a batch, through
:meth:`LiveAggregates.on_batch`, as the writer hands them over), each world in a fresh
process (memory an earlier world freed would be reused, not counted), and prints the RSS it
added (MiB, and KiB a rank), read from ``/proc`` after a garbage collection. The aggregator's
own RSS is this plus its imports, gRPC and the batches in flight (``ingest.py`` prints it).

Target (issue 26): the aggregator process at 8,000 ranks <= 1.5 GiB of RSS.

Usage: ``python benchmarks/live_memory.py [--ranks 1024 8000] [--steps 30 512]``.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import subprocess
import sys

import psutil
from ingest import rank_batch, step_blocks

from traceml import wire
from traceml_aggregator.live.analysis_process import WINDOW_STEPS
from traceml_aggregator.live.windows import LiveAggregates

#: Steps in each rank's batch.
STEPS_PER_BATCH = 2


def live_rss_mib(ranks: int, steps: int) -> float:
    """MiB of RSS that the live aggregates of ``ranks`` ranks add once ``steps`` steps of each
    were folded in."""
    blocks = step_blocks(max(1, steps // STEPS_PER_BATCH), STEPS_PER_BATCH)
    gc.collect()
    before = psutil.Process().memory_info().rss

    async def fold() -> LiveAggregates:
        live = LiveAggregates("live-memory", ranks)
        for seq, block in enumerate(blocks, start=1):
            for rank in range(ranks):
                live.on_batch(wire.Batch.FromString(rank_batch(rank, seq, block)))
        return live

    live = asyncio.run(fold())
    gc.collect()
    added = psutil.Process().memory_info().rss - before
    assert len(live.ranks) == ranks
    return added / 2**20


def measured_mib(ranks: int, steps: int) -> float:
    """:func:`live_rss_mib` in a fresh process."""
    out = subprocess.run(
        [sys.executable, __file__, "--one", str(ranks), str(steps)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return float(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1024, 8000])
    parser.add_argument("--steps", type=int, nargs="+", default=[30, WINDOW_STEPS])
    parser.add_argument("--one", type=int, nargs=2, help=argparse.SUPPRESS)  # ranks, steps
    args = parser.parse_args()
    if args.one:
        print(live_rss_mib(*args.one))
        return
    print(
        f"live aggregates' RSS, {STEPS_PER_BATCH} steps a batch, 8 step fields measured "
        f"(window: {WINDOW_STEPS} steps a rank; target, issue 26: the aggregator <= 1.5 GiB "
        "at 8,000 ranks)"
    )
    for ranks in args.ranks:
        for steps in args.steps:
            mib = measured_mib(ranks, steps)
            print(
                f"  {ranks:6d} ranks x {steps:4d} steps: {mib:7.0f} MiB "
                f"({mib * 1024 / ranks:5.1f} KiB a rank)"
            )


if __name__ == "__main__":
    main()
