"""The store's size under the retention policy (traceml_aggregator/retention.py), and what a
prune costs the writer.

1. Bytes a step row costs, measured on a real store: ``--ranks`` ranks' steps stored by
   :meth:`Store.write_batches` from wire batches as ranks send them (the seven fields of a CUDA
   step, the GPU-clock and memory fields one step in ten as the defaults read them), the file
   closed (WAL folded in), its size divided by the rows.
2. Bytes a rank's checkpoint costs: a rank's live steps state (window full, series and digest
   folded over ``--steps`` steps) pickled whole (a checkpoint keeps it in three rows, the
   rank's, its series' and its window's, about as many bytes when the window is written whole).
3. The prune of that store with the default policy: rows kept, and the longest call on the
   writer's thread (the longest a transaction of batches waits behind the prune), run by the
   real :class:`Pruner` with its calls timed in line.
4. Bytes a sample row costs, per sample table, on a real store: ``--ranks`` ranks' process
   samples and ``--nodes`` nodes' system samples with ``--gpus`` GPUs each, ``--samples``
   sample times a group, stored by :meth:`Store.write_batches` from wire batches as the
   clients send them (``benchmarks/sample_load.py``'s values), the table's pages (SQLite's
   ``dbstat``) divided by its rows; a group's series as the checkpoint packs it; and the prune
   of those rows (:class:`SamplePruner`, the real series of the store folded by a
   :class:`Checkpoint`), rows kept and its longest writer call.
5. The sizing the defaults were chosen by: a run of ``--days`` days of ``--world`` ranks at
   ``--steps-per-s`` steps a second, kept whole (``--keep-all-steps``) and under the
   defaults (every rank's evidence at its cap, the worst case); its samples, one a second
   (``--samples-per-s``) of each rank and of each node of ``--gpus-per-node`` GPUs (a node a
   ``--gpus-per-node`` ranks), likewise.

Usage::

    PYTHONPATH=. python benchmarks/retention.py
    PYTHONPATH=. python benchmarks/retention.py --ranks 64 --steps 20000 --world 8000 --days 3
"""

from __future__ import annotations

import argparse
import asyncio
import pickle
import sqlite3
import statistics
import tempfile
import time
from pathlib import Path

from sample_load import gpu_row, process_row, system_row  # benchmarks/

from traceml import settings, wire
from traceml.core.records import SAMPLES, GpuSample, ProcessSample, SystemSample
from traceml.wire.records import add_steps
from traceml_aggregator.aggregates import StepState, series_steps
from traceml_aggregator.checkpoint import Checkpoint
from traceml_aggregator.live.analysis_process import WINDOW_STEPS
from traceml_aggregator.retention import (
    Policy,
    Pruner,
    RankPlan,
    SamplePruner,
    most_rows_kept,
    most_sample_times_kept,
)
from traceml_aggregator.sample_series import pack
from traceml_aggregator.store import Store

#: Steps a batch of a rank carries (a rank's client sends about this many at 2 steps/s).
STEPS_PER_BATCH = 64
#: Sample times a batch carries (a client's batch of 32 s at one sample a second).
SAMPLES_PER_BATCH = 32
#: The samplers' interval (µs): one sample a second, the default.
SAMPLE_INTERVAL_US = 1_000_000
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


def build_samples(path: Path, ranks: int, nodes: int, gpus: int, times: int) -> dict[str, int]:
    """Store ``times`` sample times of each of ``ranks`` ranks' processes and ``nodes``
    nodes (``gpus`` GPUs each) at ``path``, as the clients send them; returns each sample
    table's bytes per row (its b-tree pages and its indexes', from ``dbstat``)."""
    store = Store(path)
    for seq, start in enumerate(range(0, times, SAMPLES_PER_BATCH), 1):
        span = range(start, min(times, start + SAMPLES_PER_BATCH))
        batches = []
        for rank in range(ranks):
            batch = wire.Batch(run_name="r", rank=rank, seq=seq)
            for i in span:
                row = process_row(rank, i, SAMPLE_INTERVAL_US)
                del row["rank"], row["restart"]  # the batch's
                batch.process_samples.add(**row)
            batches.append(batch)
        for node in range(nodes):
            batch = wire.Batch(run_name="r", node_rank=node, seq=seq)
            for i in span:
                sample = batch.system_samples.add(**system_row(node, i, SAMPLE_INTERVAL_US))
                for g in range(gpus):
                    row = gpu_row(node, g, i, SAMPLE_INTERVAL_US)
                    del row["node_rank"], row["unix_us"]  # the system sample's
                    sample.gpus.add(**row)
            batches.append(batch)
        store.write_batches(batches, 0)
    store.close()
    db = sqlite3.connect(path)
    try:
        out = {}
        for record in SAMPLES:
            (pages,) = db.execute(
                "SELECT sum(pgsize) FROM dbstat WHERE name IN "
                "(SELECT name FROM sqlite_master WHERE tbl_name = ?)",
                (record.TABLE,),
            ).fetchone()
            (rows,) = db.execute(f"SELECT count(*) FROM {record.TABLE}").fetchone()
            out[record.TABLE] = round(pages / rows)
    finally:
        db.close()
    return out


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


def prune_samples(path: Path, policy: Policy) -> dict:
    """Fold the sample rows at ``path`` into a checkpoint's series, then prune them as the
    aggregator's clean stop would (every row covered); returns each table's rows kept and
    stored, each group's series as the checkpoint packs it (bytes), and the writer calls'
    seconds."""
    store = Store(path)
    try:
        checkpoint = Checkpoint()
        checkpoint.advance_windows(store)
        marks = checkpoint.series_times()
        writer = _Timed(store)
        out: dict = {"calls": writer.took}
        for record in SAMPLES:
            (stored,) = store.query(f"SELECT count(*) FROM {record.TABLE}", by_name=False)[0]
            mark, series = marks[record.TABLE]
            pruner = SamplePruner(store, record, policy)
            asyncio.run(pruner.prune(writer, mark, series, final=True))
            (kept,) = store.query(f"SELECT count(*) FROM {record.TABLE}", by_name=False)[0]
            groups = checkpoint.series[record.TABLE]
            series_bytes = len(pickle.dumps(pack(groups), 5)) / len(groups)
            out[record.TABLE] = (kept, stored, round(series_bytes))
    finally:
        store.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=16, help="ranks of the measured store")
    parser.add_argument("--steps", type=int, default=20_000, help="steps per rank stored")
    parser.add_argument("--world", type=int, default=8_000, help="ranks of the sized run")
    parser.add_argument("--days", type=float, default=3.0, help="length of the sized run")
    parser.add_argument("--steps-per-s", type=float, default=2.0, help="each rank's pace")
    parser.add_argument("--nodes", type=int, default=2, help="nodes of the measured samples")
    parser.add_argument("--gpus", type=int, default=8, help="GPUs a measured node")
    parser.add_argument("--samples", type=int, default=4_000, help="sample times a group")
    parser.add_argument("--samples-per-s", type=float, default=1.0, help="the sized samplers")
    parser.add_argument("--gpus-per-node", type=int, default=8, help="of the sized run")
    args = parser.parse_args()
    policy = Policy()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "telemetry.sqlite"
        row_bytes = build(path, args.ranks, args.steps)
        kept, calls, took = prune(path, args.ranks, args.steps, policy)
        samples_path = Path(tmp) / "samples.sqlite"
        sample_bytes = build_samples(samples_path, args.ranks, args.nodes, args.gpus, args.samples)
        pruned = prune_samples(samples_path, policy)
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

    print(
        f"measured samples: {args.ranks} ranks' processes, {args.nodes} nodes x {args.gpus} "
        f"GPUs, {args.samples} sample times a group"
    )
    for record in SAMPLES:
        table = record.TABLE
        kept_rows, stored, series_bytes = pruned[table]
        print(f"  {table}: bytes per row {sample_bytes[table]:>4}")
        print(f"  {table}: rows kept by the defaults {kept_rows} of {stored}")
        print(f"  {table}: series a group (checkpoint) {series_bytes} bytes")
    sample_calls = pruned["calls"]
    print(f"  prune: longest call (ingest waits) {max(sample_calls) * 1000:.1f} ms")
    nodes = -(-args.world // args.gpus_per_node)
    times = int(args.days * 86_400 * args.samples_per_s)
    groups = {  # groups of each table, rows a sample time of a group
        ProcessSample.TABLE: (args.world, 1),
        SystemSample.TABLE: (nodes, 1),
        GpuSample.TABLE: (nodes, args.gpus_per_node),
    }
    per_time = sum(n * rows * sample_bytes[t] for t, (n, rows) in groups.items())
    times_kept = most_sample_times_kept(policy, times)
    measured = {ProcessSample.TABLE: 1, SystemSample.TABLE: 1, GpuSample.TABLE: args.gpus}
    series = sum(n * pruned[t][2] * rows / measured[t] for t, (n, rows) in groups.items())
    held = sum(n * rows for n, rows in groups.values()) * policy.last_samples * 16
    print(
        f"sized run's samples: {args.world} ranks, {nodes} nodes x {args.gpus_per_node} GPUs, "
        f"{args.samples_per_s:g} sample/s, {times} sample times a group"
    )
    print(f"  defaults: {', '.join(f'{k.name}={k.default}' for k in _SAMPLE_KNOBS)}")
    print(f"  --keep-all-steps: samples          {times * per_time / GIB:,.1f} GiB")
    print(f"  defaults: sample times a group (max) {times_kept}")
    print(f"  defaults: samples                  {times_kept * per_time / GIB:,.1f} GiB")
    print(f"  series in the checkpoint           {series / GIB:,.2f} GiB")
    print(f"  held rows' ids (aggregator memory) {held / 2**20:,.0f} MiB")
    total = kept_bytes + ckpt + times_kept * per_time + series
    print(f"  defaults: steps + samples + checkpoint {total / GIB:,.1f} GiB (target <= 20 GiB)")


_KNOBS = (
    settings.STORE_FIRST_STEPS,
    settings.STORE_LAST_STEPS,
    settings.STORE_SAMPLE_EVERY,
    settings.STORE_EVIDENCE_STEPS,
)
_SAMPLE_KNOBS = (settings.STORE_FIRST_SAMPLES, settings.STORE_LAST_SAMPLES)

if __name__ == "__main__":
    main()
