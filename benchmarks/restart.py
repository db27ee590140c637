"""Time to serving of a replacement aggregator on a long run's store, with and without the
live aggregates' checkpoint (traceml_aggregator/checkpoint.py).

The store is built straight into SQLite (:func:`build_store`: the steps of ``--ranks`` ranks
as a run stores them, interleaved in batches, with their identities, streams and samples), then
a real ``traceml-aggregator`` process is started on it, as the launcher restarts one, and timed
from its start to its health service saying SERVING:

* ``replay``: the store without a checkpoint (an older store, or a first start): every stored
  step is folded in before serving;
* ``checkpoint``: the store with the checkpoint a real aggregator wrote at its clean stop,
  plus ``--after`` steps stored after it (those a replacement folds in).

and ``--finalize-only`` on the same store from the same checkpoint, timed with its peak RSS
(and its RSS after its imports: the difference is what finalizing added).

Medians of ``--repeat`` starts each. With ``--baseline DIR`` (another TraceML source tree, e.g.
``git archive 225540e | tar -x -C /tmp/base``) every timing is also taken with that tree, on
the same store with a checkpoint of its own, the two alternating. Usage::

    PYTHONPATH=. python benchmarks/restart.py --steps 10000000 --repeat 3
    PYTHONPATH=. python benchmarks/restart.py --steps 100000000 --repeat 3 --replay-repeat 0
    PYTHONPATH=. python benchmarks/restart.py --ranks 1024 --simulate --baseline /tmp/base

``--replay-repeat 0`` skips the replay timings (at 100 M steps one takes ~15 min here).
The first start on a store without a checkpoint writes one when it stops; at 100 M steps that
start is the replay itself, so a store is built once per size and kept in ``--dir``.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import pickle
import re
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import ROOT, LiveAggregator, median  # noqa: E402
from sample_load import START_US, gpu_row, process_row, rows_of, system_row  # noqa: E402

from traceml.core import records  # noqa: E402
from traceml.core.phases import STEP_FIELDS  # noqa: E402
from traceml_aggregator.store import Store  # noqa: E402

#: Steps of one rank per stored batch (a sender's batch of ~1 s at ~50 steps/s).
STEPS_PER_BATCH = 50
#: One process sample per rank, and one system sample (8 GPU samples) per node, every this
#: many steps.
SAMPLE_EVERY_STEPS = 100
#: Ranks per node (GPUs per node).
RANKS_PER_NODE = 8
#: Steps per rank of the short run whose checkpoint ``--simulate`` puts on a long run's store.
SIMULATED_STEPS = 4_000
#: Rows per transaction while building.
BUILD_ROWS_PER_COMMIT = 1_000_000


def _step_rows(first: int, count: int, ranks: int, seed: int) -> tuple[list[list], list[str]]:
    """Steps ``first .. first + count - 1`` of ranks ``0 .. ranks - 1`` as the store's rows
    ``(rank, restart 0, *fields)``, in the order a run stores them: batches of
    :data:`STEPS_PER_BATCH` steps, the ranks' batches interleaved; µs values drawn from
    ``seed``. Returns the rows and the step fields they hold, in order."""
    rng = np.random.default_rng(seed)
    step = np.arange(first, first + count, dtype=np.int64)
    shape = (ranks, count)
    rank = np.repeat(np.arange(ranks, dtype=np.int64)[:, None], count, axis=1)
    steps = np.broadcast_to(step, shape)
    cols = {
        "step": steps,
        "end_us": (steps + 1) * 100_000 + rank,
        "step_us": rng.integers(90_000, 110_000, shape),
        "input_wait_us": rng.integers(1_000, 5_000, shape),
        "dataloader_next_us": rng.integers(500, 2_000, shape),
        "h2d_us": rng.integers(100, 900, shape),
        "forward_us": rng.integers(20_000, 30_000, shape),
        "backward_us": rng.integers(40_000, 60_000, shape),
        "optimizer_us": rng.integers(5_000, 9_000, shape),
        "gpu_step_us": rng.integers(80_000, 100_000, shape),
        "peak_allocated_bytes": (rank + 1) * 1_000_000_000 + steps,
    }
    names = [n for n in STEP_FIELDS if n in cols]
    table = np.stack([rank, np.zeros(shape, np.int64)] + [cols[n] for n in names], axis=-1)
    # (ranks, count, width) -> batches of STEPS_PER_BATCH steps, each batch's ranks in turn
    batches = -(-count // STEPS_PER_BATCH)
    padded = np.full((ranks, batches * STEPS_PER_BATCH, table.shape[-1]), -1, np.int64)
    padded[:, :count] = table
    ordered = padded.reshape(ranks, batches, STEPS_PER_BATCH, -1).transpose(1, 0, 2, 3)
    rows = ordered.reshape(-1, table.shape[-1])
    return rows[rows[:, 2] >= 0].tolist(), names


def build_store(
    run_dir: Path,
    run_name: str,
    ranks: int,
    steps_per_rank: int,
    *,
    first_step: int = 0,
    seed: int = 0,
) -> int:
    """Store ``steps_per_rank`` steps (indices ``first_step`` on) of each of ``ranks`` ranks
    in ``run_dir``'s store, straight into SQLite, as an aggregator would have stored them:
    batches of :data:`STEPS_PER_BATCH` steps, ranks interleaved; with each rank's identity,
    stream (``stored_seq``) and process samples, each node's system and GPU samples
    (``benchmarks/sample_load.py``'s rows), every :data:`SAMPLE_EVERY_STEPS` steps. Called
    again with a later ``first_step``, it appends (the run went on). ~10 µs a step on the
    loaded 2-core machine (97 s for 10 M); returns the rows of ``steps`` stored in all.

    Raises:
        sqlite3.Error: the disk (full, ...).
    """
    Store(run_dir / "telemetry.sqlite").close()  # the schema, as the aggregator makes it
    db = sqlite3.connect(run_dir / "telemetry.sqlite", isolation_level=None)
    try:
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=OFF")
        db.execute("INSERT OR REPLACE INTO meta VALUES ('run_name', ?)", (run_name,))
        db.execute("INSERT OR REPLACE INTO meta VALUES ('world_size', ?)", (str(ranks),))
        nodes = max(1, -(-ranks // RANKS_PER_NODE))
        db.executemany(
            records.insert(records.Identity),
            rows_of(
                records.Identity,
                (
                    {
                        "rank": r,
                        "restart": 0,
                        "node_rank": r // RANKS_PER_NODE,
                        "local_rank": r % RANKS_PER_NODE,
                        "world_size": ranks,
                        "local_world_size": RANKS_PER_NODE,
                        "hostname": f"node{r // RANKS_PER_NODE}",
                        "pid": 1000 + r,
                        "start_unix_us": START_US,
                        "torch_version": "2.4",
                        "cuda_version": "12.4",
                        "backend": "nccl",
                        "parallelism": "ddp",
                        "device": f"cuda:{r % RANKS_PER_NODE}",
                        "gpu_uuid": f"GPU-{r}",
                    }
                    for r in range(ranks)
                ),
            ),
        )
        db.execute("BEGIN")
        chunk = max(
            STEPS_PER_BATCH, BUILD_ROWS_PER_COMMIT // ranks // STEPS_PER_BATCH * STEPS_PER_BATCH
        )
        for start in range(first_step, first_step + steps_per_rank, chunk):
            count = min(chunk, first_step + steps_per_rank - start)
            rows, names = _step_rows(start, count, ranks, seed * 1_000_003 + start)
            marks = ", ".join("?" * (2 + len(names)))
            db.executemany(
                f"INSERT INTO steps (rank, restart, {', '.join(names)}) VALUES ({marks})", rows
            )
            del rows
            sampled = range(start - start % -SAMPLE_EVERY_STEPS, start + count, SAMPLE_EVERY_STEPS)
            interval_us = SAMPLE_EVERY_STEPS * 100_000  # a step is ~100 ms
            for i in (s // SAMPLE_EVERY_STEPS for s in sampled):
                for record, rows in (
                    (records.ProcessSample, (process_row(r, i, interval_us) for r in range(ranks))),
                    (records.SystemSample, (system_row(n, i, interval_us) for n in range(nodes))),
                    (
                        records.GpuSample,
                        (
                            gpu_row(n, g, i, interval_us)
                            for n in range(nodes)
                            for g in range(RANKS_PER_NODE)
                        ),
                    ),
                ):
                    db.executemany(records.insert(record), rows_of(record, rows))
            db.execute("COMMIT")
            db.execute("BEGIN")
        batches = -(-(first_step + steps_per_rank) // STEPS_PER_BATCH)
        db.executemany(
            "INSERT OR REPLACE INTO streams VALUES ('rank', ?, 0, ?)",
            [(r, batches) for r in range(ranks)],
        )
        db.execute("COMMIT")
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        return db.execute("SELECT max(rowid) FROM steps").fetchone()[0] or 0
    finally:
        db.close()


#: The store's tables that hold the live aggregates' checkpoint (the ranks' rows since its
#: layout 3, their series since 6, their windows since 7; :func:`build_store` makes them all,
#: with this tree's schema, whatever tree is timed).
CHECKPOINT_TABLES = (
    "live_checkpoint",
    "live_checkpoint_ranks",
    "live_checkpoint_series",
    "live_checkpoint_window",
)


def drop_checkpoint(run_dir: Path) -> None:
    """Remove the store's checkpoint (the store as an older TraceML left it)."""
    with contextlib.closing(sqlite3.connect(run_dir / "telemetry.sqlite")) as db:
        for table in CHECKPOINT_TABLES:
            db.execute(f"DELETE FROM {table}")
        db.commit()


def save_checkpoint(run_dir: Path, path: Path) -> None:
    """Copy the rows of the store's checkpoint to the file ``path``."""
    with contextlib.closing(sqlite3.connect(run_dir / "telemetry.sqlite")) as db:
        rows = {t: db.execute(f"SELECT * FROM {t}").fetchall() for t in CHECKPOINT_TABLES}
    path.write_bytes(pickle.dumps(rows, 5))


def restore_checkpoint(run_dir: Path, path: Path) -> None:
    """Make the store's checkpoint the one :func:`save_checkpoint` copied to ``path``."""
    rows = pickle.loads(path.read_bytes())
    with contextlib.closing(sqlite3.connect(run_dir / "telemetry.sqlite")) as db:
        for table in CHECKPOINT_TABLES:
            db.execute(f"DELETE FROM {table}")
            _insert(db, table, rows.get(table, []))
        db.commit()


def _insert(db: sqlite3.Connection, table: str, rows: list[tuple]) -> None:
    """Insert (or replace) ``rows``, whole rows of ``table``."""
    for row in rows:
        db.execute(f"INSERT OR REPLACE INTO {table} VALUES ({', '.join('?' * len(row))})", row)


def _env(tree: Path | None) -> dict[str, str]:
    """The environment of a process run from the TraceML source tree ``tree`` (None: this
    one, as the benchmark itself runs): ``tree`` first on its path, and not the working
    directory (``PYTHONSAFEPATH``: ``-m`` and ``-c`` would put it first)."""
    return {} if tree is None else {"PYTHONPATH": str(tree), "PYTHONSAFEPATH": "1"}


def time_to_serving(
    run_dir: Path, run_name: str, world: int, timeout_s: float, tree: Path | None = None
) -> float:
    """Seconds from starting a ``traceml-aggregator`` process (of the source tree ``tree``,
    None: this one) on ``run_dir`` to SERVING; it is stopped cleanly after (SIGTERM: it writes
    its checkpoint). With ``--keep-all-steps``: the store is built whole, as no run under the
    retention defaults leaves it, and a stop's prune of 100 M rows (minutes) is not what is
    timed."""
    agg = LiveAggregator(
        run_dir,
        run_name,
        world_size=world,
        extra_args=("--finalize-timeout-sec", "5", "--keep-all-steps"),
        env=_env(tree),
    )
    started = time.monotonic()
    try:
        agg.start(timeout_s)
        took = time.monotonic() - started
        agg.stop(timeout_s)
    finally:
        agg.__exit__(None, None, None)  # killed if it still runs (a failure)
    return took


#: Runs ``traceml-aggregator`` with argv[1:], then prints its peak RSS (MiB) and that after
#: its imports, on stderr (``finalize_only`` reads them). The peak is the kernel's high-water
#: mark of this process image (``VmHWM``; ``ru_maxrss`` would carry the parent's over exec).
_MEASURED = """
import re, sys
import traceml_aggregator.server, traceml_aggregator.reports  # what every run imports
from traceml_aggregator.cli import main
def hwm():
    with open("/proc/self/status") as f:
        return int(re.search(r"VmHWM:\\s+(\\d+) kB", f.read()).group(1)) / 1024
imported = hwm()
code = main(sys.argv[1:])  # what python -m traceml_aggregator runs
print(f"rss after imports {imported:.0f} MiB, peak {hwm():.0f} MiB", file=sys.stderr)
sys.exit(code)
"""


def finalize_only(
    run_dir: Path, run_name: str, world: int, tree: Path | None = None
) -> tuple[float, float, float, float]:
    """Run ``traceml-aggregator --finalize-only`` (of the source tree ``tree``, None: this
    one) on ``run_dir`` (it writes ``final_summary.*`` there); returns the seconds it took in
    all, those its seeding took (its own log line), its peak RSS and its RSS after its imports
    (MiB: the difference is what finalizing the run added).

    Raises:
        RuntimeError: it exited non-zero (its stderr in the message).
    """
    started = time.monotonic()
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            _MEASURED,
            "--run-dir",
            str(run_dir),
            "--run-name",
            run_name,
            "--world-size",
            str(world),
            "--finalize-only",
        ],
        capture_output=True,
        text=True,
        timeout=3600,
        env={**os.environ, **_env(tree)},
    )
    took = time.monotonic() - started
    if result.returncode != 0:
        raise RuntimeError(f"--finalize-only exited {result.returncode}: {result.stderr}")
    seeded = re.search(r"live aggregates seeded in ([\d.]+) s", result.stderr)
    rss = re.search(r"rss after imports (\d+) MiB, peak (\d+) MiB", result.stderr)
    peak, imported = (float(rss.group(2)), float(rss.group(1))) if rss else (math.nan, math.nan)
    return took, float(seeded.group(1)) if seeded else math.nan, peak, imported


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10_000_000, help="stored steps in all")
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument(
        "--after", type=int, default=50, help="steps per rank stored after the checkpoint"
    )
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--replay-repeat", type=int, default=None, help="replay starts [default: --repeat]"
    )
    parser.add_argument("--dir", type=Path, default=None, help="keep the stores here")
    parser.add_argument("--timeout-s", type=float, default=3600.0)
    parser.add_argument(
        "--simulate",
        action="store_true",
        help="make the checkpoint from a short run of the same ranks instead "
        "of a replay of the whole store (see simulate_checkpoint)",
    )
    parser.add_argument(
        "--baseline",
        type=Path,
        default=None,
        help="another TraceML source tree (e.g. git archive main | tar -x -C /tmp/base), "
        "timed the same way with its own checkpoint, the trials alternating",
    )
    args = parser.parse_args(argv)
    replays = args.repeat if args.replay_repeat is None else args.replay_repeat
    per_rank = args.steps // args.ranks
    run_name = "restart-bench"
    trees: dict[str, Path | None] = {"this tree": None}
    if args.baseline:
        trees["baseline"] = args.baseline.resolve()
    with contextlib.ExitStack() as stack:
        base = args.dir or Path(stack.enter_context(tempfile.TemporaryDirectory()))
        run_dir = base / f"run-{args.ranks}x{per_rank}"
        run_dir.mkdir(parents=True, exist_ok=True)
        if not (run_dir / "built").exists():
            t = time.monotonic()
            rows = build_store(run_dir, run_name, args.ranks, per_rank - args.after)
            (run_dir / "built").write_text(str(rows))
            print(f"built {rows:,} steps in {time.monotonic() - t:.0f} s", flush=True)
        saved = {name: run_dir / f"checkpoint-{name.replace(' ', '-')}.pickle" for name in trees}
        for name, tree in trees.items():  # each tree's checkpoint (layouts differ)
            if saved[name].exists():
                continue
            if (run_dir / "appended").exists():
                raise SystemExit(f"{run_dir} has no checkpoint of {name}: use a new --dir")
            drop_checkpoint(run_dir)
            if args.simulate:
                simulate_checkpoint(run_dir, run_name, args.ranks, base / "simulated", tree)
                print(f"{name}: checkpoint simulated (see --simulate)", flush=True)
            else:  # one start replays the store and writes the checkpoint at its stop
                took = time_to_serving(run_dir, run_name, args.ranks, args.timeout_s, tree)
                print(f"{name}: first start (replay, checkpoint at stop): {took:.1f} s", flush=True)
            save_checkpoint(run_dir, saved[name])
        if not (run_dir / "appended").exists():
            build_store(
                run_dir, run_name, args.ranks, args.after, first_step=per_rank - args.after, seed=1
            )
            (run_dir / "appended").write_text("1")
        stored = (
            sqlite3.connect(run_dir / "telemetry.sqlite")
            .execute("SELECT max(rowid) FROM steps")
            .fetchone()[0]
        )
        serving: dict[str, list[float]] = {name: [] for name in trees}
        finalize: dict[str, list[tuple[float, float, float, float]]] = {name: [] for name in trees}
        for _ in range(args.repeat):  # each start from the same checkpoint
            for name, tree in trees.items():
                restore_checkpoint(run_dir, saved[name])
                serving[name].append(
                    time_to_serving(run_dir, run_name, args.ranks, args.timeout_s, tree)
                )
                print(f"  {name}: checkpoint: {serving[name][-1]:.2f} s", flush=True)
        for _ in range(args.repeat):
            for name, tree in trees.items():
                restore_checkpoint(run_dir, saved[name])
                finalize[name].append(finalize_only(run_dir, run_name, args.ranks, tree))
                took, seeding, peak, imported = finalize[name][-1]
                print(
                    f"  {name}: --finalize-only: {took:.2f} s (seeding {seeding:.2f} s), "
                    f"peak RSS {peak:.0f} MiB ({imported:.0f} after its imports)",
                    flush=True,
                )
        replay = []
        for _ in range(replays):
            drop_checkpoint(run_dir)
            replay.append(time_to_serving(run_dir, run_name, args.ranks, args.timeout_s))
            print(f"  replay: {replay[-1]:.2f} s", flush=True)
        restore_checkpoint(run_dir, saved["this tree"])
        print(
            f"{stored:,} stored steps, {args.ranks} ranks, {args.ranks * args.after:,} after "
            "the checkpoint:"
        )
        for name in trees:
            times, runs = serving[name], finalize[name]
            print(
                f"  {name} (checkpoint {saved[name].stat().st_size / 2**20:.1f} MiB): time to "
                f"serving median {median(times):.2f} s of {len(times)} "
                f"({', '.join(f'{t:.2f}' for t in times)}); --finalize-only median "
                f"{median(r[0] for r in runs):.2f} s "
                f"({', '.join(f'{r[0]:.2f}' for r in runs)}), of which seeding "
                f"{median(r[1] for r in runs):.2f} s, peak RSS "
                f"{median(r[2] for r in runs):.0f} MiB, "
                f"+{median(r[2] - r[3] for r in runs):.0f} MiB over its imports"
            )
        if replay:
            print(
                f"  time to serving, replay: median {median(replay):.2f} s of "
                f"{len(replay)} ({', '.join(f'{t:.2f}' for t in replay)})"
            )
    return 0


def checkpoint_version(tree: Path) -> int:
    """The checkpoint layout the source tree ``tree`` writes (its ``CHECKPOINT_VERSION``):
    read from its source, as a baseline of another layout writes its own."""
    source = (tree / "traceml_aggregator" / "checkpoint.py").read_text()
    found = re.search(r"^CHECKPOINT_VERSION = (\d+)$", source, re.MULTILINE)
    if found is None:
        raise SystemExit(f"{tree}: no CHECKPOINT_VERSION in traceml_aggregator/checkpoint.py")
    return int(found.group(1))


def simulate_checkpoint(
    run_dir: Path, run_name: str, ranks: int, scratch: Path, tree: Path | None = None
) -> None:
    """Give ``run_dir``'s store a checkpoint without replaying it (a replay of 100 M steps
    takes ~15 min here): a real aggregator (of the source tree ``tree``, None: this one)
    checkpoints a short run of the same ranks (:data:`SIMULATED_STEPS` each, built once in
    ``scratch``: windows, series and digests full, so the checkpoint has the size and shape of
    a long run's), whose marks are then set to the store's last rows; a checkpoint of the
    layout its tree writes (:func:`checkpoint_version`: a baseline's too, where this tree's
    layout is another) gets the sample windows and series of the long run's own samples (read
    whole here, as the aggregator would have folded them in checkpoint by checkpoint). Only
    the time to serving and the finalization's cost mean anything on such a store (the step
    figures the checkpoint holds are the short run's); that a checkpoint's aggregates equal a
    replay's is tested apart (tests/test_checkpoint.py)."""
    from traceml_aggregator import checkpoint

    scratch.mkdir(parents=True, exist_ok=True)
    if not (scratch / "built").exists():
        build_store(scratch, run_name, ranks, SIMULATED_STEPS)
        (scratch / "built").write_text("1")
    drop_checkpoint(scratch)
    time_to_serving(scratch, run_name, ranks, 600.0, tree)  # writes its checkpoint at the stop
    with contextlib.closing(sqlite3.connect(scratch / "telemetry.sqlite")) as db:
        written, data = db.execute("SELECT written_unix_us, state FROM live_checkpoint").fetchone()
        rank_rows = db.execute("SELECT rank, state FROM live_checkpoint_ranks").fetchall()
        # the rows a rank's row names, copied as they are (series from layout 6, windows 7)
        copied = {t: db.execute(f"SELECT * FROM {t}").fetchall() for t in CHECKPOINT_TABLES[2:]}
    state = checkpoint.loads(data)
    current = state.version == checkpoint_version(tree or ROOT)
    if current:  # the long run's own sample windows and series, marks at its last rows
        state.windows, state.series = {}, {}
        store = Store(run_dir / "telemetry.sqlite")
        state.advance_windows(store)
        store.close()
    with contextlib.closing(sqlite3.connect(run_dir / "telemetry.sqlite")) as db:
        top = {
            t: db.execute(f"SELECT max(rowid) FROM {t}").fetchone()[0] or 0
            for t in ("steps", "process_samples", "system_samples", "gpu_samples")
        }
        state.steps_from = top["steps"]
        if hasattr(state, "ranks"):  # layouts before 3: the ranks' states in the one row
            state.ranks = {r: (top["steps"], part) for r, (_, part) in state.ranks.items()}
        db.executemany(
            "INSERT OR REPLACE INTO live_checkpoint_ranks VALUES (?, ?, ?)",
            [(r, top["steps"], part) for r, part in rank_rows],
        )
        for table, rows in copied.items():
            _insert(db, table, rows)
        if not current:
            state.windows = {t: (top[t], w) for t, (_, w) in state.windows.items()}
        db.execute(
            "INSERT OR REPLACE INTO live_checkpoint VALUES (0, ?, ?)",
            (written, pickle.dumps(state, 5)),
        )
        db.commit()


if __name__ == "__main__":
    sys.exit(main())
