"""Benchmark (h): finalization of a large run: today's path (every stored step re-read and
re-analysed) side by side with the summary from the live aggregates (O(ranks)).

Builds one SQLite store through the aggregator's own write path (``Store.write_batches``, as
batches from the ranks arrive) holding ``--ranks`` ranks of ``--steps`` steps each (a plausible
CPU rank: input wait, DataLoader, forward, backward, optimizer; a CUDA memory reading every 10
steps), and folds every batch into :class:`traceml_aggregator.live.LiveAggregates` as the
writer does after each commit (the fold's CPU per step is printed). Then it times:

* ``store path``: :func:`traceml_aggregator.load.load` (every stored step) and
  :func:`traceml.analysis.summary.build_summary` of that RunData, in a fresh process (the
  path before the aggregates; ``--no-store-path`` skips it: at 10M steps it needs ~110 s and
  several GiB);
* ``aggregates``: what the aggregator's finalization does now: ``final_steps()`` of the live
  aggregates, the store read without its steps, ``build_summary``;
* ``offline``: ``--finalize-only``'s path: the aggregates seeded from the store (one scan of the
  steps), then the same summary; it must equal the aggregates' (checked);

and, with ``--simulate-steps N``, the aggregates' finalization after N steps (e.g. 100M) folded
straight into the aggregates of ``--ranks`` ranks, without a store (what a week-long run would
leave). With ``--baseline DIR`` (another source tree of TraceML, e.g. ``git archive main | tar
-x -C /tmp/base``), the store path is also timed with that tree, the trials alternating A/B.

Usage: ``python benchmarks/finalize.py [--ranks 1024] [--steps 10000] [--trials 1]
[--simulate-steps 100000000] [--no-store-path] [--baseline DIR]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import ROOT, in_tree  # noqa: E402

#: Timed in the child process: argv[1] is the store; prints one JSON line.
_CHILD = """
import json, resource, sys, time
from traceml_aggregator.load import load
from traceml_aggregator.store import Store
from traceml.analysis.summary import build_summary
store = Store(sys.argv[1])
t0 = time.perf_counter()
run = load(store, [])
t1 = time.perf_counter()
build_summary(run)
t2 = time.perf_counter()
print(json.dumps({"load_s": t1 - t0, "summary_s": t2 - t1,
                  "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def build_store(path: Path, ranks: int, steps: int, per_batch: int = 512, live=None) -> float:
    """Write ``ranks`` x ``steps`` steps to a new store at ``path``, in SDK-sized batches, each
    also folded into ``live`` (LiveAggregates) when given; the fold's CPU seconds."""
    sys.path.insert(0, str(ROOT))
    from traceml import wire
    from traceml.wire.records import add_steps
    from traceml_aggregator.store import Store

    fold_s = 0.0
    store = Store(path)
    store.set_meta("run_name", "finalize-bench")
    store.set_meta("world_size", str(ranks))
    for rank in range(ranks):
        ident = wire.RankIdentity(
            run_name="finalize-bench",
            rank=rank,
            world_size=ranks,
            hostname="sim",
            start_unix_us=1_700_000_000_000_000,
            device="cpu",
            parallelism="ddp",
        )
        batches = [wire.Batch(run_name="finalize-bench", rank=rank, seq=1, identity=ident)]
        for seq, start in enumerate(range(0, steps, per_batch), start=2):
            batch = wire.Batch(run_name="finalize-bench", rank=rank, seq=seq)
            add_steps(batch, (_step(i, rank) for i in range(start, min(start + per_batch, steps))))
            batches.append(batch)
        store.write_batches(batches, received_unix_us=0)
        if live is not None:
            started = time.process_time()
            for batch in batches:
                live.on_batch(batch)
            fold_s += time.process_time() - started
    store.close()
    return fold_s


def _step(i: int, rank: int) -> dict:
    step = {
        "step": i,
        "end_us": 25_000 * (i + 1),
        "step_us": 25_000 + (i * 7919 + rank) % 997,
        "input_wait_us": 600 + i % 50,
        "dataloader_next_us": 500 + i % 40,
        "forward_us": 8_000 + rank * 10,
        "backward_us": 13_000 + i % 300,
        "optimizer_us": 1_200,
    }
    if i % 10 == 0:
        step["peak_allocated_bytes"] = 2**31 + (i % 1000) * 4096
        step["peak_reserved_bytes"] = 2**32
    return step


def trial(tree: Path, store: Path) -> dict:
    """One timed analysis of ``store`` by the TraceML source tree ``tree``, in a new process."""
    return in_tree(tree, ["-c", _CHILD, str(store)])


def _comparable(summary: dict) -> dict:
    return {k: v for k, v in summary.items() if k != "generated_unix_s"}


def aggregates_finalize(live, store_path: Path | None) -> tuple[float, dict]:
    """The aggregator's finalization from ``live``: seconds and the summary."""
    from traceml.analysis.summary import build_summary
    from traceml_aggregator.live import with_steps
    from traceml_aggregator.load import load
    from traceml_aggregator.store import Store

    started = time.perf_counter()
    steps = live.final_steps()
    if store_path is None:
        from traceml.analysis.rundata import RunData

        run = RunData("finalize-bench", len(steps), {}, {}, {}, {}, [])
    else:
        store = Store(store_path)
        run = load(store, [], steps=False)
        store.close()
    summary = build_summary(with_steps(run, steps))
    return time.perf_counter() - started, summary


def simulate(ranks: int, total_steps: int, chunk: int = 65_536) -> tuple[float, float, object]:
    """``total_steps`` steps over ``ranks`` ranks folded straight into new LiveAggregates (the
    columns of :func:`_step`, made with NumPy); (fold CPU s, wall s, the aggregates)."""
    import numpy as np

    from traceml import wire
    from traceml_aggregator.live import LiveAggregates

    live = LiveAggregates("finalize-bench", ranks)
    per_rank = total_steps // ranks
    started, cpu = time.perf_counter(), 0.0
    names = (
        "step",
        "end_us",
        "step_us",
        "input_wait_us",
        "dataloader_next_us",
        "forward_us",
        "backward_us",
        "optimizer_us",
    )
    for rank in range(ranks):
        identity = wire.RankIdentity(
            run_name="finalize-bench",
            rank=rank,
            world_size=ranks,
            hostname="sim",
            start_unix_us=1_700_000_000_000_000,
            device="cpu",
            parallelism="ddp",
        )
        live.on_batch(wire.Batch(run_name="finalize-bench", rank=rank, seq=1, identity=identity))
        for start in range(0, per_rank, chunk):
            i = np.arange(start, min(per_rank, start + chunk), dtype=np.int64)
            columns = [
                i,
                25_000 * (i + 1),
                25_000 + (i * 7919 + rank) % 997,
                600 + i % 50,
                500 + i % 40,
                np.full(len(i), 8_000 + rank * 10),
                13_000 + i % 300,
                np.full(len(i), 1_200),
            ]
            columns = [c.tolist() for c in columns]
            t = time.process_time()
            live.ranks[rank].fold_steps(names, columns)
            cpu += time.process_time() - t
    return cpu, time.perf_counter() - started, live


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, default=1024)
    p.add_argument("--steps", type=int, default=10_000, help="steps per rank")
    p.add_argument("--trials", type=int, default=1)
    p.add_argument(
        "--simulate-steps",
        type=int,
        default=0,
        help="also finalize after this many steps (all ranks) folded without a store",
    )
    p.add_argument("--no-store-path", action="store_true", help="skip the store path's timing")
    p.add_argument("--baseline", type=Path, help="another TraceML source tree to compare with")
    args = p.parse_args()
    sys.path.insert(0, str(ROOT))
    from traceml_aggregator.live import LiveAggregates
    from traceml_aggregator.store import Store

    trees = {"this tree": ROOT} | ({"baseline": args.baseline.resolve()} if args.baseline else {})
    total = args.ranks * args.steps
    with tempfile.TemporaryDirectory() as tmp:
        store = Path(tmp) / "telemetry.sqlite"
        live = LiveAggregates("finalize-bench", args.ranks)
        fold_s = build_store(store, args.ranks, args.steps, live=live)
        print(
            f"{args.ranks} ranks x {args.steps} steps = {total} stored steps, store "
            f"{store.stat().st_size / 2**20:.0f} MiB; folding them into the live aggregates "
            f"cost {fold_s / total * 1e6:.2f} µs of CPU a step (at ingest)"
        )
        agg_s, live_summary = aggregates_finalize(live, store)
        started = time.perf_counter()
        offline = LiveAggregates("finalize-bench", args.ranks)
        db = Store(store)
        offline.seed(db)
        db.close()
        seed_s = time.perf_counter() - started
        offline_s, offline_summary = aggregates_finalize(offline, store)
        assert _comparable(offline_summary) == _comparable(live_summary), "offline != live"
        print(f"  aggregates: finalize {agg_s:.2f} s (target <= 5 s at 10M stored steps)")
        print(
            f"  offline (--finalize-only): seed from the store {seed_s:.2f} s "
            f"({seed_s / total * 1e6:.2f} µs a stored step), then finalize {offline_s:.2f} s;"
            " the same summary as the live one"
        )
        if not args.no_store_path:
            results: dict[str, list[dict]] = {name: [] for name in trees}
            for _ in range(args.trials):
                for name, tree in trees.items():
                    results[name].append(trial(tree, store))
            for name, rs in results.items():
                m = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
                t = m["load_s"] + m["summary_s"]
                print(
                    f"  store path ({name}): load {m['load_s']:.2f} s, summary "
                    f"{m['summary_s']:.2f} s, total {t:.2f} s ({t / total * 1e6:.2f} µs a "
                    f"stored step), peak RSS {m['rss_mib']:.0f} MiB (medians of {args.trials});"
                    f" aggregates / store path: {agg_s / t:.3f}"
                )
    if args.simulate_steps:
        cpu, wall, sim = simulate(args.ranks, args.simulate_steps)
        sim_s, _ = aggregates_finalize(sim, None)
        steps = args.simulate_steps // args.ranks * args.ranks
        print(
            f"  simulated {steps} steps over {args.ranks} ranks (folded in {wall:.0f} s, "
            f"{cpu / steps * 1e6:.2f} µs of CPU a step): aggregates finalize {sim_s:.2f} s "
            "(target <= 10 s at 100M); the store path would read every one of them "
            "(~10 µs a step: ~1,000 s at 100M)"
        )


if __name__ == "__main__":
    main()
