"""Benchmark (f): finalization's analysis of a large store: load the steps, build the summary.

Builds one SQLite store through the aggregator's own write path (``Store.write_batches``, as
batches from the ranks arrive) holding ``--ranks`` ranks of ``--steps`` steps each (a plausible
CPU rank: input wait, DataLoader, forward, backward, optimizer; a CUDA memory reading every 10
steps), then times, each in a fresh process so that no run warms the next:

* ``load``: :func:`traceml_aggregator.load.load`, the store read into :class:`RunData`;
* ``summary``: :func:`traceml.analysis.summary.build_summary` of that RunData;

and the process's peak RSS. With ``--baseline DIR`` (another source tree of TraceML, e.g.
``git archive main | tar -x -C /tmp/base``), the same store is also analysed by that tree,
the trials alternating A/B so that a busy machine slows both alike; the medians and ratios are
printed.

Usage: ``python benchmarks/finalize.py [--ranks 8] [--steps 125000] [--trials 3]
[--baseline DIR]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

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


def build_store(path: Path, ranks: int, steps: int, per_batch: int = 512) -> None:
    """Write ``ranks`` x ``steps`` steps to a new store at ``path``, in SDK-sized batches."""
    sys.path.insert(0, str(ROOT))
    from traceml import wire
    from traceml.wire.records import add_steps
    from traceml_aggregator.store import Store

    store = Store(path)
    store.set_meta("run_name", "finalize-bench")
    store.set_meta("world_size", str(ranks))
    for rank in range(ranks):
        ident = wire.RankIdentity(
            run_name="finalize-bench", rank=rank, world_size=ranks, hostname="sim",
            start_unix_us=1_700_000_000_000_000, device="cpu", parallelism="ddp",
        )
        batches = [wire.Batch(run_name="finalize-bench", rank=rank, seq=1, identity=ident)]
        for seq, start in enumerate(range(0, steps, per_batch), start=2):
            batch = wire.Batch(run_name="finalize-bench", rank=rank, seq=seq)
            add_steps(batch, (_step(i, rank) for i in range(start, min(start + per_batch, steps))))
            batches.append(batch)
        store.write_batches(batches, received_unix_us=0)
    store.close()


def _step(i: int, rank: int) -> dict:
    step = {"step": i, "end_us": 25_000 * (i + 1), "step_us": 25_000 + (i * 7919 + rank) % 997,
            "input_wait_us": 600 + i % 50, "dataloader_next_us": 500 + i % 40,
            "forward_us": 8_000 + rank * 10, "backward_us": 13_000 + i % 300,
            "optimizer_us": 1_200}
    if i % 10 == 0:
        step["peak_allocated_bytes"] = 2**31 + (i % 1000) * 4096
        step["peak_reserved_bytes"] = 2**32
    return step


def trial(tree: Path, store: Path) -> dict:
    """One timed analysis of ``store`` by the TraceML source tree ``tree``, in a new process."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    out = subprocess.run([sys.executable, "-c", _CHILD, str(store)], env=env, check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--steps", type=int, default=125_000, help="steps per rank")
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--baseline", type=Path, help="another TraceML source tree to compare with")
    args = p.parse_args()
    trees = {"this tree": ROOT} | ({"baseline": args.baseline.resolve()} if args.baseline else {})
    with tempfile.TemporaryDirectory() as tmp:
        store = Path(tmp) / "telemetry.sqlite"
        build_store(store, args.ranks, args.steps)
        print(f"{args.ranks} ranks x {args.steps} steps = {args.ranks * args.steps} steps, "
              f"store {store.stat().st_size / 2**20:.0f} MiB")
        results: dict[str, list[dict]] = {name: [] for name in trees}
        for _ in range(args.trials):
            for name, tree in trees.items():
                results[name].append(trial(tree, store))
    medians = {
        name: {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        for name, rs in results.items()
    }
    for name, m in medians.items():
        print(f"{name:>10}: load {m['load_s']:.2f} s, summary {m['summary_s']:.2f} s, "
              f"total {m['load_s'] + m['summary_s']:.2f} s, peak RSS {m['rss_mib']:.0f} MiB "
              f"(medians of {args.trials})")
    if args.baseline:
        a, b = medians["this tree"], medians["baseline"]
        print("this tree / baseline: " + ", ".join(
            f"{k} {a[k] / b[k]:.2f}" for k in ("load_s", "summary_s", "rss_mib")
        ) + f", total {(a['load_s'] + a['summary_s']) / (b['load_s'] + b['summary_s']):.2f}")


if __name__ == "__main__":
    main()
