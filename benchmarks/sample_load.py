"""Benchmark: loading a long run's samples (process, system, GPU) and summarising them.

Builds a store straight into SQLite (``executemany`` into the sample tables of a store the
aggregator's :class:`~traceml_aggregator.store.Store` created, no wire, no batches): ``--ranks``
ranks on nodes of ``--gpus-per-node`` GPUs, one process sample per rank, one system sample per
node and one GPU sample per GPU every ``--interval-s`` seconds (the node sampler's pace is ~1 s)
for ``--hours`` hours. Then, in a fresh process, it times :func:`traceml_aggregator.load.load`
and :func:`traceml.analysis.summary.build_summary` and reports the peak RSS above the process's
RSS before the load (``extra_rss_mib``, sampled every 5 ms). ``--baseline DIR`` runs the same child
with another
source tree (e.g. ``git archive <commit> | tar -x -C DIR``), alternating.

``tests/test_sample_load.py`` uses :func:`build_sample_store` for its short CI variant.

Measured here (2 cores shared with other work, so slow in absolute terms): 8 GPUs for 34.7 h
(1.0 M process, 1.0 M GPU and 125 k system rows) loaded and summarised in 103.8 + 21.0 s with
+1,180 MiB with a dict per row, 30.0 + 2.3 s with +197 MiB as NumPy columns. About half of the
load is SQLite's own row fetch (``fetchmany``: a Python tuple per row), ~7 µs a row here: a
1,024-rank 3-day run at one sample a second (265 M process rows alone) cannot load every sample
within 10 s this way; it needs the samples kept compactly per rank (issue 25, item 1).

Usage: ``python benchmarks/sample_load.py [--ranks 8] [--hours 35] [--interval-s 1]
[--gpus-per-node 8] [--baseline DIR]``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
START_US = 1_700_000_000_000_000

#: Run in the child: argv[1] is the store; prints one JSON line.
CHILD = """
import json, sys, threading, time
import psutil
from traceml_aggregator.load import load
from traceml_aggregator.store import Store
from traceml.analysis.summary import build_summary
proc = psutil.Process()
store = Store(sys.argv[1], read_only=True)
before = proc.memory_info().rss
peak, done = [before], threading.Event()
def watch():  # ru_maxrss would count the imports' peak too: sample the RSS instead
    while not done.wait(0.005):
        peak[0] = max(peak[0], proc.memory_info().rss)
watcher = threading.Thread(target=watch, daemon=True)
watcher.start()
t0 = time.perf_counter()
run = load(store, [])
t1 = time.perf_counter()
doc = build_summary(run)
t2 = time.perf_counter()
done.set()
watcher.join()
print(json.dumps({"load_s": t1 - t0, "summary_s": t2 - t1,
                  "extra_rss_mib": (max(peak[0], proc.memory_info().rss) - before) / 2**20,
                  "ranks": [r["process"] for r in doc["ranks"]],
                  "nodes": [n["system"] for n in doc["nodes"]]}))
"""


def process_row(rank: int, i: int, interval_us: int) -> dict:
    """``process_samples`` row ``i`` of ``rank`` (column -> value): CPU 90-99 %, RSS growing
    4 KiB a sample."""
    return {
        "rank": rank,
        "restart": 0,
        "unix_us": START_US + i * interval_us,
        "cpu_percent": 90.0 + (i + rank) % 10,
        "rss_bytes": 2**30 + 4096 * i,
        "gpu_allocated_bytes": 2**31,
        "gpu_reserved_bytes": 2**32,
    }


def gpu_row(node: int, index: int, i: int, interval_us: int) -> dict:
    """``gpu_samples`` row ``i`` of GPU ``index`` of ``node`` (column -> value): utilisation
    50-99 %."""
    return {
        "node_rank": node,
        "unix_us": START_US + i * interval_us,
        "nvml_index": index,
        "uuid": f"GPU-{node}-{index}",
        "util_percent": 50.0 + (i * 7 + index) % 50,
        "memory_used_bytes": 2**33 + i % 1000,
        "memory_total_bytes": 80 * 2**30,
        "temperature_c": 60.0 + i % 20,
        "power_w": 300.0 + i % 100,
    }


def system_row(node: int, i: int, interval_us: int) -> dict:
    """``system_samples`` row ``i`` of ``node`` (column -> value): CPU 30-69 %, RAM 25 %
    used."""
    return {
        "node_rank": node,
        "unix_us": START_US + i * interval_us,
        "hostname": f"host{node}",
        "cpu_percent": 30.0 + i % 40,
        "ram_used_bytes": 2**34,
        "ram_total_bytes": 2**36,
    }


def rows_of(record, rows):
    """``rows`` (column -> value mappings) as the store's rows of ``record`` (a
    :mod:`traceml.core.records` class: tuples in its column order, None for a column a
    mapping lacks), to bind to ``records.insert(record)``."""
    names = record.names()
    return ([row.get(name) for name in names] for row in rows)


def build_sample_store(
    path: Path, ranks: int, samples: int, gpus_per_node: int = 8, interval_s: float = 1.0
) -> int:
    """Write ``samples`` samples of each rank, node and GPU (``ranks`` ranks, one GPU each, on
    ``ceil(ranks / gpus_per_node)`` nodes) into a new store at ``path``; returns the rows
    written. Straight into SQLite, in 100,000-row statements."""
    sys.path.insert(0, str(ROOT))
    from traceml.core import records
    from traceml_aggregator.store import Store

    interval_us = int(interval_s * 1e6)
    nodes = -(-ranks // gpus_per_node)
    store = Store(path)
    store.set_meta("run_name", "samples-bench")
    store.set_meta("world_size", str(ranks))
    db = store._db  # the benchmark writes the tables directly: no batch, no wire
    tables = (
        (
            records.ProcessSample,
            (process_row(r, i, interval_us) for i in range(samples) for r in range(ranks)),
        ),
        (
            records.GpuSample,
            (
                gpu_row(r // gpus_per_node, r % gpus_per_node, i, interval_us)
                for i in range(samples)
                for r in range(ranks)
            ),
        ),
        (
            records.SystemSample,
            (system_row(n, i, interval_us) for i in range(samples) for n in range(nodes)),
        ),
    )
    rows = 0
    for record, generator in tables:
        sql = records.insert(record)
        generator = rows_of(record, generator)
        while chunk := list(itertools.islice(generator, 100_000)):
            db.execute("BEGIN")
            db.executemany(sql, chunk)
            db.execute("COMMIT")
            rows += len(chunk)
    store.close()
    return rows


def measure(tree: Path, store: Path) -> dict:
    """Load and summarise ``store`` with the TraceML of ``tree`` in a fresh process."""
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(store)],
        check=True,
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin"},
        cwd=tree,  # -c imports from cwd
    )
    return json.loads(out.stdout.splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--hours", type=float, default=35.0)
    parser.add_argument("--interval-s", type=float, default=1.0)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--trials", type=int, default=1)
    parser.add_argument("--baseline", type=Path, default=None)
    args = parser.parse_args()
    samples = int(args.hours * 3600 / args.interval_s)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "telemetry.sqlite"
        started = time.perf_counter()
        rows = build_sample_store(path, args.ranks, samples, args.gpus_per_node, args.interval_s)
        print(
            f"built {rows:,} sample rows in {time.perf_counter() - started:.1f} s "
            f"({path.stat().st_size / 2**20:.0f} MiB)"
        )
        trees = [("this tree", ROOT)] + ([("baseline", args.baseline)] if args.baseline else [])
        for trial in range(args.trials):
            for name, tree in trees:
                r = measure(tree, path)
                print(
                    f"{name} (trial {trial + 1}): load {r['load_s']:.2f} s, summary "
                    f"{r['summary_s']:.2f} s, extra RSS {r['extra_rss_mib']:.0f} MiB"
                )


if __name__ == "__main__":
    main()
