"""The store's size under the retention policy (traceml_aggregator/retention.py), and what a
prune costs the writer.

1. Bytes a step row costs, measured on a real store: ``--ranks`` ranks' steps stored by
   :meth:`Store.write_batches` from wire batches as ranks send them (the seven fields of a CUDA
   step, the GPU-clock and memory fields one step in ten as the defaults read them), the file
   closed (WAL folded in), its size divided by the rows.
2. Bytes a rank's checkpoint costs: a rank's live steps state (window full, series and digest
   folded over ``--steps`` steps) pickled as the checkpoint pickles it.
3. The prune of that store with the default policy: rows kept, and the longest call on the
   writer's thread (the longest a transaction of batches waits behind the prune), run by the
   real :class:`Pruner` with its calls timed in line.
4. The sizing the defaults were chosen by: a run of ``--days`` days of ``--world`` ranks at
   ``--steps-per-s`` steps a second, kept whole (``--keep-all-steps``) and under the
   defaults (every rank's evidence at its cap, the worst case).

Usage::

    PYTHONPATH=. python benchmarks/retention.py
    PYTHONPATH=. python benchmarks/retention.py --ranks 64 --steps 20000 --world 8000 --days 3
"""

from __future__ import annotations

import argparse
import asyncio
import pickle
import statistics
import tempfile
import time
from pathlib import Path

from traceml import settings, wire
from traceml.wire.records import add_steps
from traceml_aggregator.aggregates import StepState, series_steps
from traceml_aggregator.live.analysis_process import WINDOW_STEPS
from traceml_aggregator.retention import Policy, Pruner, RankPlan, most_rows_kept
from traceml_aggregator.store import Store

#: Steps a batch of a rank carries (a rank's client sends about this many at 2 steps/s).
STEPS_PER_BATCH = 64
GIB = 2**30


def row(rank: int, i: int) -> dict[str, int]:
    """Step ``i`` of ``rank``: a CUDA step's fields, GPU clock and memory one step in ten."""
    jitter = (rank * 7 + i * 13) % 400
    out = {
        "step": i,
        "end_us": 1_700_000_000_000_000 + (i + 1) * 500_000,
        "step_us": 480_000 + jitter,
        "input_wait_us": 1_000 + jitter,
        "forward_us": 120_000 + jitter,
        "backward_us": 280_000,
        "optimizer_us": 40_000,
    }
    if i % 10 == 0:
        out |= {
            "gpu_step_us": 470_000 + jitter,
            "gpu_forward_us": 118_000,
            "gpu_backward_us": 279_000,
            "gpu_optimizer_us": 39_000,
            "peak_allocated_bytes": 60 * GIB + jitter,
            "peak_reserved_bytes": 70 * GIB,
        }
    return out


def build(path: Path, ranks: int, steps: int) -> int:
    """Store ``steps`` steps of each of ``ranks`` ranks at ``path``; returns the file's bytes
    per step row (the empty store's bytes left out)."""
    store = Store(path)
    store.close()
    empty = path.stat().st_size
    store = Store(path)
    for start in range(0, steps, STEPS_PER_BATCH):
        batches = []
        for rank in range(ranks):
            batch = wire.Batch(run_name="r", rank=rank, seq=start // STEPS_PER_BATCH + 1)
            add_steps(batch, (row(rank, i) for i in range(start, min(steps, start + 64))))
            batches.append(batch)
        store.write_batches(batches, 0)
    store.close()
    return round((path.stat().st_size - empty) / (ranks * steps))


def checkpoint_bytes(world: int, steps: int) -> int:
    """A rank's checkpointed steps state, pickled, after ``steps`` steps (``world`` ranks)."""
    state = StepState(WINDOW_STEPS, series_steps(world))
    names = tuple(row(0, 0))
    for start in range(0, steps, STEPS_PER_BATCH):
        rows = [row(0, i) for i in range(start, min(steps, start + STEPS_PER_BATCH))]
        state.fold(names, [[r.get(n) for r in rows] for n in names])
    return len(pickle.dumps(state, 5))


class _Timed:
    """The writer's ``call`` and ``store``, each call run in line and timed."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.took: list[float] = []

    async def call(self, fn, *args):
        started = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.took.append(time.perf_counter() - started)


def prune(path: Path, ranks: int, steps: int, policy: Policy) -> tuple[int, list[float], float]:
    """Prune the store at ``path`` as an aggregator would once a checkpoint covers it all;
    returns (rows kept, seconds of each call on the writer's thread, seconds in all)."""
    store = Store(path)
    try:
        level = max(0, (steps - 1) // series_steps(ranks)).bit_length()
        plans = {r: RankPlan(0, steps - 1, level, 480_000.0) for r in range(ranks)}
        writer = _Timed(store)
        started = time.perf_counter()
        asyncio.run(Pruner(store, policy).prune(writer, store.max_rowid("steps"), plans))
        took = time.perf_counter() - started
        kept = store.query("SELECT count(*) FROM steps", by_name=False)[0][0]
    finally:
        store.close()
    return kept, writer.took, took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=16, help="ranks of the measured store")
    parser.add_argument("--steps", type=int, default=20_000, help="steps per rank stored")
    parser.add_argument("--world", type=int, default=8_000, help="ranks of the sized run")
    parser.add_argument("--days", type=float, default=3.0, help="length of the sized run")
    parser.add_argument("--steps-per-s", type=float, default=2.0, help="each rank's pace")
    args = parser.parse_args()
    policy = Policy()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "telemetry.sqlite"
        row_bytes = build(path, args.ranks, args.steps)
        kept, calls, took = prune(path, args.ranks, args.steps, policy)
    rank_ckpt = checkpoint_bytes(args.world, args.steps)
    print(f"measured store: {args.ranks} ranks x {args.steps} steps")
    print(f"  bytes per step row                 {row_bytes}")
    print(f"  rows kept by the defaults          {kept} of {args.ranks * args.steps}")
    print(f"  prune: writer calls                {len(calls)}")
    print(f"  prune: longest call (ingest waits) {max(calls) * 1000:.1f} ms")
    print(f"  prune: median call                 {statistics.median(calls) * 1000:.1f} ms")
    print(f"  prune: rows/s                      {args.ranks * args.steps / took:,.0f}")
    print(f"  checkpoint bytes per rank          {rank_ckpt}")
    run_steps = int(args.days * 86_400 * args.steps_per_s)
    per_rank = most_rows_kept(policy, run_steps, series_steps(args.world))
    ckpt = args.world * rank_ckpt
    print(
        f"sized run: {args.world} ranks x {args.days:g} days at {args.steps_per_s:g} steps/s "
        f"= {run_steps} steps a rank"
    )
    print(f"  defaults: {', '.join(f'{k.name}={k.default}' for k in _KNOBS)}")
    every_row = args.world * run_steps * row_bytes
    print(f"  --keep-all-steps: steps            {every_row / GIB:,.1f} GiB")
    print(f"  defaults: rows kept a rank (max)   {per_rank}")
    kept_bytes = args.world * per_rank * row_bytes
    print(f"  defaults: steps                    {kept_bytes / GIB:,.1f} GiB")
    print(f"  checkpoint (one row)               {ckpt / GIB:,.1f} GiB")
    print(
        f"  defaults: steps + checkpoint       "
        f"{(kept_bytes + ckpt) / GIB:,.1f} GiB (target <= 20 GiB)"
    )


_KNOBS = (
    settings.STORE_FIRST_STEPS,
    settings.STORE_LAST_STEPS,
    settings.STORE_SAMPLE_EVERY,
    settings.STORE_EVIDENCE_STEPS,
)

if __name__ == "__main__":
    main()
