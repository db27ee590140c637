"""(i) What one dashboard refresh costs the aggregator, by world size.

The live aggregates (``traceml_aggregator/live.py``) are filled through their own ``on_batch``
with real wire batches: every rank a full window (512 steps) and 256 process samples. Then,
median over ``--reps`` runs each:

* ``loop``: what one refresh costs the event loop, ms: the delta shipped to the live analysis
  process after one new step per rank (the only part on the loop: the share of the loop one
  refresh a second takes while a page is open and the run changes);
* ``snapshot``: building the :class:`~traceml_aggregator.dashboard.frames.Snapshot` from the
  windows, ms (done in the analysis process, at nice 19, off the aggregator's GIL);
* ``first`` / ``next``: a new viewer's first frame and a viewer's next frame after one new step
  per rank, ms to build and encode (on the loop), and their JSON size, KiB.

Usage::

    .venv/bin/python benchmarks/dashboard.py --ranks 8 64 256 1024 --reps 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from traceml import wire  # noqa: E402
from traceml.wire.records import add_steps  # noqa: E402
from traceml_aggregator.dashboard.frames import Cursor, Snapshot  # noqa: E402
from traceml_aggregator.live import WINDOW_SAMPLES, WINDOW_STEPS, LiveAggregates  # noqa: E402


def _steps(first: int, count: int) -> list[dict]:
    return [
        {"step": i, "end_us": 1_000_000 + 25_000 * i, "step_us": 25_000 + i % 997,
         "input_wait_us": 600 + i % 50, "dataloader_next_us": 500 + i % 40,
         "forward_us": 800, "backward_us": 13_000 + i % 300, "optimizer_us": 1_200}
        for i in range(first, first + count)
    ]  # fmt: skip


def filled(ranks: int) -> LiveAggregates:
    """Live aggregates of ``ranks`` ranks (8 a node), each with full windows."""
    live = LiveAggregates("bench", ranks)
    for r in range(ranks):
        batch = wire.Batch(run_name="bench", rank=r, seq=1)
        batch.identity.rank = r
        batch.identity.node_rank = r // 8
        batch.identity.world_size = ranks
        batch.identity.start_unix_us = 1_700_000_000_000_000
        add_steps(batch, _steps(0, WINDOW_STEPS))
        for i in range(WINDOW_SAMPLES):
            s = batch.process_samples.add(unix_us=1_700_000_000_000_000 + 1_000_000 * i)
            s.cpu_percent, s.rss_bytes = 90.0, 2**31
        live.on_batch(batch)
    return live


def grow(live: LiveAggregates, ranks: int) -> None:
    """One more step per rank."""
    for r in range(ranks):
        batch = wire.Batch(run_name="bench", rank=r, seq=2)
        add_steps(batch, _steps(WINDOW_STEPS, 1))
        live.on_batch(batch)


async def refresh_deltas(live: LiveAggregates, ranks: int, reps: int) -> float:
    """Median ms of the delta after one new step per rank (the first, whole delta not
    counted: it is shipped once per analysis process)."""
    await live._delta(whole=True, records={})
    times = []
    for _ in range(reps):
        grow(live, ranks)
        t0 = time.perf_counter()
        await live._delta(whole=False, records={})
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def timed(fn, reps: int) -> tuple[float, object]:
    """Median ms of ``fn()`` over ``reps`` calls, and its last result."""
    times, out = [], None
    for _ in range(reps):
        t0 = time.perf_counter()
        out = fn()
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times), out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ranks", type=int, nargs="+", default=[8, 64, 256])
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args()
    print("ranks  loop ms  snapshot ms  first ms  first KiB  next ms  next KiB")
    for ranks in args.ranks:
        live = filled(ranks)
        loop_ms = asyncio.run(refresh_deltas(live, ranks, args.reps))
        run = live.run_data()
        snap_ms, snap = timed(lambda: Snapshot(run, None, live=True, version=1), args.reps)

        def first():
            return json.dumps(snap.frame(Cursor()), separators=(",", ":")).encode()

        first_ms, first_body = timed(first, args.reps)
        cursor = Cursor()
        snap.frame(cursor)
        grow(live, ranks)
        later = Snapshot(live.run_data(), None, live=True, version=2)

        def next_frame():
            c = Cursor(dict(cursor.steps), dict(cursor.memory), dict(cursor.system))
            return json.dumps(later.frame(c), separators=(",", ":")).encode()

        next_ms, next_body = timed(next_frame, args.reps)
        print(f"{ranks:5d}  {loop_ms:7.1f}  {snap_ms:11.1f}  {first_ms:8.1f}  "
              f"{len(first_body) / 1024:9.0f}  {next_ms:7.1f}  {len(next_body) / 1024:8.0f}")
        live.close()


if __name__ == "__main__":
    main()
