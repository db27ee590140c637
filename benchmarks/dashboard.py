"""(i) What one dashboard refresh costs the aggregator, by world size.

The live aggregates (``traceml_aggregator/live/windows.py``) are filled through their own
``on_batch`` with real wire batches: every rank a full window (512 steps) and 256 process
samples. Then, median over ``--reps`` runs each:

* ``loop``: what one refresh costs the event loop, ms: the delta shipped to the live analysis
  process after one new step per rank (the only part on the loop: the share of the loop one
  refresh a second takes while a page is open and the run changes);
* ``snapshot``: building the :class:`~traceml_aggregator.dashboard.frames.Snapshot` from the
  windows, ms (done in the analysis process, at nice 19, off the aggregator's GIL);
* ``first`` / ``next``: a new viewer's first frame and a viewer's next frame after one new step
  per rank, ms to build and encode (on the loop), and their JSON size, KiB;
* ``refresh``: one whole refresh as the page's event stream runs it, after one new step per
  rank: the delta shipped to the real live analysis process, the snapshot built there, and one
  viewer's next frame encoded. ``hold`` is the event loop's longest hold at one go (its
  thread's CPU time between two turns of a 1 ms ticker, as ``tests/test_metrics.py`` measures
  it), ``loop cpu`` all the CPU time the loop's thread spent on the refresh (measured in a run
  without the ticker), ``wall`` the refresh's wall time.

With ``--browser N``: a real aggregator (``--dashboard-port``) fed ``N`` simulated ranks over
gRPC (``benchmarks/simulated_world.py``), its page open in headless Chromium
(``benchmarks/headless_chromium.py``); after each of ``--reps`` more steps per rank, what the
page took for the frame that brought them (``document.body.dataset.drawMs``): its script
(parse and draw) and the time from the message to the page painted with it, ms; and the CPU
time of Chromium's processes per frame (wall times stretch on a loaded machine, CPU time much
less). ``--ranks`` with no value skips the in-process part.

The issue's bounds at :data:`TARGET_RANKS` ranks are printed with the figures they bound:
the loop's CPU time over one refresh ≤ :data:`LOOP_TARGET_MS`, the page's time from a
frame's message to the page painted ≤ :data:`DRAW_TARGET_MS`.

Usage::

    .venv/bin/python benchmarks/dashboard.py --ranks 8 64 256 1024 --reps 5
    .venv/bin/python benchmarks/dashboard.py --ranks --browser 1024 --reps 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from loop_hold import LoopHold  # noqa: E402

from traceml import wire  # noqa: E402
from traceml.wire.records import add_steps  # noqa: E402
from traceml_aggregator.dashboard.frames import Cursor, Snapshot  # noqa: E402
from traceml_aggregator.live import WINDOW_SAMPLES, WINDOW_STEPS, LiveAggregates  # noqa: E402

#: World size the bounds below are for.
TARGET_RANKS = 1024
#: Most CPU time of the event loop's thread over one refresh, ms.
LOOP_TARGET_MS = 20.0
#: Most time from a frame's message to the page painted with it, ms.
DRAW_TARGET_MS = 100.0


def _against(value: float, bound: float) -> str:
    return f"(bound {bound:.0f} ms: {'met' if value <= bound else 'MISSED'})"


def _steps(first: int, count: int) -> list[dict]:
    return [
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
        for i in range(first, first + count)
    ]


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
    """Median ms of the delta after one new step per rank (the analysis process's start and
    the first, whole delta, shipped once per analysis process, not counted)."""
    await live.metrics()
    times = []
    for _ in range(reps):
        grow(live, ranks)
        t0 = time.perf_counter()
        await live._delta(whole=False, records={})
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


async def _refresh(live: LiveAggregates, cursor: Cursor) -> bytes:
    """One refresh of one viewer (what the event stream does): the snapshot, the frame."""
    snapshot = await live.snapshot(None, live.version)
    return snapshot.encode(cursor)


async def refresh_cost(live: LiveAggregates, ranks: int, reps: int) -> tuple[float, float, float]:
    """Medians over ``reps`` refreshes after one new step per rank: the loop's longest hold,
    the loop thread's CPU time and the wall time, ms (the analysis process's start and the
    first, whole delta not counted)."""
    cursor = Cursor()
    await _refresh(live, cursor)
    holds, cpus, walls = [], [], []
    for _ in range(reps):
        grow(live, ranks)
        cpu0, wall0 = time.thread_time(), time.perf_counter()
        await _refresh(live, cursor)
        cpus.append((time.thread_time() - cpu0) * 1000)
        walls.append((time.perf_counter() - wall0) * 1000)
        grow(live, ranks)
        async with LoopHold(settle_s=0.01) as hold:
            await _refresh(live, cursor)
        holds.append(hold.max_s * 1000)
    return statistics.median(holds), statistics.median(cpus), statistics.median(walls)


def browser(ranks: int, reps: int) -> dict[str, float]:
    """What the page costs to draw a frame at ``ranks`` simulated ranks (see the module
    docstring), ms: ``first_script`` and ``first_painted``, its first frame's script (parse
    and draw) and time from the message to the page painted with it; then medians over
    ``reps`` frames, each after one more batch of 8 steps per rank: ``script``, ``painted``,
    and ``cpu``, the CPU time all of Chromium's processes spent from the batch to 1 s after
    the frame was painted, per frame drawn, less what they spend while this benchmark polls an
    idle page (the wall times stretch on a loaded machine; the CPU time much less)."""
    from aggregator_process import LiveAggregator, free_port
    from headless_chromium import DevTools
    from simulated_world import push, rank_batches

    start_us = int(time.time() * 1e6)
    with tempfile.TemporaryDirectory() as tmp:
        port = free_port()
        agg = LiveAggregator(
            Path(tmp) / "run", "bench", world_size=ranks, extra_args=("--dashboard-port", str(port))
        )
        with agg:
            push(agg.target, rank_batches("bench", ranks, range(128), 1, ranks // 2, start_us))
            chrome = DevTools(Path(tmp) / "profile")
            try:
                page = chrome.open_page(
                    f"http://127.0.0.1:{port}/?token={os.environ['TRACEML_RUN_TOKEN']}", 1400
                )
                first = _drawn(chrome, page, 1)[1][0]
                cpus, later = [], []
                # Chromium's CPU time while this benchmark polls the page between two frames
                # (once the first one settled), s per s
                idle = math.inf
                while idle == math.inf:
                    time.sleep(3.0)
                    frames, idle0, t0 = _drawn(chrome, page, 1)[0], _cpu_s(chrome), time.monotonic()
                    if _drawn(chrome, page, 10**9, timeout_s=3.0, quiet=True)[0] == frames:
                        idle = (_cpu_s(chrome) - idle0) / (time.monotonic() - t0)
                for seq in range(2, reps + 2):
                    frames, cpu0, t0 = _drawn(chrome, page, 1)[0], _cpu_s(chrome), time.monotonic()
                    steps = range(128 + 8 * (seq - 2), 128 + 8 * (seq - 1))
                    push(agg.target, rank_batches("bench", ranks, steps, seq, ranks // 2, start_us))
                    _drawn(chrome, page, frames + 1)
                    time.sleep(1.0)
                    now, drawn = _drawn(chrome, page, frames + 1)
                    busy = _cpu_s(chrome) - cpu0 - idle * (time.monotonic() - t0)
                    cpus.append(busy * 1000 / (now - frames))
                    later.extend(drawn[-(now - frames) :])
            finally:
                chrome.close()
    return {
        "first_script": first[0],
        "first_painted": first[1],
        "script": statistics.median(c[0] for c in later),
        "painted": statistics.median(c[1] for c in later),
        "cpu": statistics.median(cpus),
    }


def _cpu_s(chrome) -> float:
    """CPU time (user + system, s) of Chromium's processes so far."""
    browser_process = psutil.Process(chrome.proc.pid)
    total = 0.0
    for p in [browser_process, *browser_process.children(recursive=True)]:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def _drawn(
    chrome, page: str, count: int, timeout_s: float = 300.0, quiet: bool = False
) -> tuple[int, list]:
    """``(frames, costs)`` once the page drew and painted ``count`` frames: the frames drawn
    so far, and the last 20's costs, ``(script, painted)`` ms each. Raises TimeoutError
    after ``timeout_s`` unless ``quiet`` (then returns what it saw last)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        frames, drawn = json.loads(
            chrome.evaluate(
                page,
                "JSON.stringify([+(document.body.dataset.frames || 0), "
                "document.body.dataset.drawMs || ''])",
            )
        )
        costs = [tuple(map(float, v.split("/"))) for v in drawn.split(",") if v]
        if frames >= count and len(costs) >= min(frames, 20):
            return frames, costs
        time.sleep(0.2)
    if quiet:
        return frames, costs
    raise TimeoutError(f"the page drew fewer than {count} frames in {timeout_s} s")


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
    p.add_argument("--ranks", type=int, nargs="*", default=[8, 64, 256])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--browser", type=int, metavar="N", help="also the page at N ranks")
    args = p.parse_args()
    print(
        "ranks  loop ms  snapshot ms  first ms  first KiB  next ms  next KiB"
        "  refresh: hold ms  loop cpu ms  wall ms"
    )
    for ranks in args.ranks:
        live = filled(ranks)
        loop_ms = asyncio.run(refresh_deltas(live, ranks, args.reps))
        run = live.run_data()
        snap_ms, snap = timed(lambda run=run: Snapshot(run, None, live=True, version=1), args.reps)

        def first(snap: Snapshot = snap) -> bytes:
            return snap.encode(Cursor())

        first_ms, first_body = timed(first, args.reps)
        cursor = Cursor()
        snap.frame(cursor)
        grow(live, ranks)
        later = Snapshot(live.run_data(), None, live=True, version=2)

        def next_frame(cursor: Cursor = cursor, later: Snapshot = later) -> bytes:
            c = Cursor(dict(cursor.steps), dict(cursor.memory), dict(cursor.system), cursor.phases)
            return later.encode(c)

        next_ms, next_body = timed(next_frame, args.reps)
        hold, cpu, wall = asyncio.run(refresh_cost(live, ranks, args.reps))
        print(
            f"{ranks:5d}  {loop_ms:7.1f}  {snap_ms:11.1f}  {first_ms:8.1f}  "
            f"{len(first_body) / 1024:9.0f}  {next_ms:7.1f}  {len(next_body) / 1024:8.0f}"
            f"  {hold:16.1f}  {cpu:11.1f}  {wall:7.0f}"
            + (f"  loop cpu {_against(cpu, LOOP_TARGET_MS)}" if ranks == TARGET_RANKS else ""),
            flush=True,
        )
        live.close()
    if args.browser:
        b = browser(args.browser, args.reps)
        print(
            f"browser at {args.browser} ranks, ms: first frame {b['first_script']:.0f} script, "
            f"{b['first_painted']:.0f} to painted; next frames (medians of {args.reps}): "
            f"{b['script']:.0f} script, {b['painted']:.0f} to painted"
            + (f" {_against(b['painted'], DRAW_TARGET_MS)}" if args.browser == TARGET_RANKS else "")
            + f", {b['cpu']:.0f} of Chromium's CPU time"
        )


if __name__ == "__main__":
    main()
