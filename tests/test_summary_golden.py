"""final_summary.json stays byte-for-byte what it was (apart from ``generated_unix_s``).

Golden files in tests/golden/, first written by the code before the summary became typed
(commit 75970b8; see git log for the commit that added them):

* ``<scenario>.json``: :func:`build_summary` of each hand-built run of :data:`SCENARIOS`
  (tests/rundata_factory.py);
* ``runs/<name>.sql.gz`` + ``runs/<name>.json``: the SQLite store of a real 2-rank run under
  ``traceml run`` (tests/scripts: planted_ddp.py ``--scenario input_straggler``, faulty_ddp.py
  ``--fail exit3``, fail_once.py with one restart), as an SQL dump, and the
  final_summary.json its finalization wrote; the store is loaded back through the aggregator's
  loader and analysed again.

Only a deliberate change of the document may change them: then bump SCHEMA_VERSION if the
layout changed, and rewrite the golden documents (the stores stay) with
``python tests/test_summary_golden.py``. The merge of issue 15's diagnosis and issue 14's run
status and telemetry health onto the typed summary rewrote them: every difference was a field
or figure those features add (checked against the dict-based summary of main at 486c7ad, which
gives the same documents key for key).
"""

from __future__ import annotations

import gzip
import json
import sqlite3
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from rundata_factory import (
    MIB,
    counts,
    gpu_sample,
    rank,
    rich_run,
    run_of,
    step,
    steps,
    system_sample,
)

from traceml.analysis.summary import build_summary
from traceml.report import to_json

GOLDEN = Path(__file__).resolve().parent / "golden"


def _cpu_input_straggler():
    ranks = [rank(r, steps(input_wait=30_000 if r == 2 else 1000), node=r // 2) for r in range(4)]
    system = {
        n: [system_sample(1_000_000 + k * 500_000, node=n, cpu=95.0) for k in range(4)]
        for n in (0, 1)
    }
    exits = {n: {"exit_code": 0, "hostname": f"host{n}", "restart_count": 0} for n in (0, 1)}
    return run_of(ranks, system=system, exits=exits), False


def _health():
    """A 2-node run: rank 3 exits 7, rank 2 is stopped, rank 1 never finishes."""
    ranks = [rank(r, steps(), node=r // 2) for r in range(4)]
    ranks[3] = rank(3, steps(), node=1, end="failed", exit_code=7, finish=False)
    ranks[2] = rank(2, steps(), node=1, end="terminated", exit_code=None, finish=False)
    ranks[1].end = ranks[1].finish = None
    exits = {
        0: {"exit_code": 0, "hostname": "host0", "restart_count": 0},
        1: {"exit_code": 7, "hostname": "host1", "restart_count": 0},
    }
    return run_of(ranks, missing=[1], exits=exits), False


def _dropped_restarted():
    r0 = rank(0, steps(), restart=1, earlier_attempts={0: 12})
    dropped = 45 - len(r0.steps)
    r0.finish = replace(
        r0.finish, steps_completed=45, records_dropped=dropped, steps_gpu_unresolved=2, last_seq=12
    )
    # the counts of r0's last batch, the one with its finish marker
    r0.counts = counts(
        0,
        seq=12,
        records_produced=45,
        records_dropped=dropped,
        steps_produced=45,
        steps_dropped=dropped,
    )
    r1 = rank(1, [], finish=False)
    r1.end = None
    # r1 was killed without a finish marker: 4 steps dropped, 3 still buffered when last heard
    r1.counts = counts(
        1, seq=9, records_produced=7, records_dropped=4, steps_produced=7, steps_dropped=4
    )
    return run_of([r0, r1]), False


def _live():
    r1 = rank(1, steps(), finish=False)
    r1.end = None
    return run_of([rank(0, steps()), r1]), True


def _zero_code():
    system = {
        0: [
            system_sample(t, reason="NVML Shared Library Not Found")
            for t in range(0, 5_000_000, 1_000_000)
        ]
    }
    return run_of([rank(0, [], finish=False), rank(1, [], finish=False)], system=system), False


def _memory():
    big = [step(i, alloc=(70_000 + i * 100) * MIB) for i in range(60)]
    small = steps(60, alloc=20_000 * MIB)
    gpus = {
        0: [
            gpu_sample(t, g, 30.0 + 40 * g)
            for t in range(0, 3_000_000, 1_000_000)
            for g in range(2)
        ]
    }
    return run_of([rank(0, big, uuid="GPU-0-0"), rank(1, small, uuid="GPU-0-1")], gpus=gpus), False


#: Hand-built runs: name -> () -> (run, live).
SCENARIOS = {
    "gpu_two_nodes": lambda: (rich_run(), False),
    "cpu_input_straggler": _cpu_input_straggler,
    "health": _health,
    "dropped_restarted": _dropped_restarted,
    "live": _live,
    "zero_code": _zero_code,
    "memory": _memory,
}
RUNS = ("input_straggler", "crash", "restart")


def _document(summary: dict, generated_unix_s: float) -> str:
    return to_json(dict(summary, generated_unix_s=generated_unix_s))


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_hand_built_runs_give_the_golden_document(name):
    golden = (GOLDEN / f"{name}.json").read_text(encoding="utf-8")
    run, live = SCENARIOS[name]()
    generated = json.loads(golden)["generated_unix_s"]
    summary = build_summary(run, live=live, now_unix_s=generated)
    assert _document(summary, generated) == golden


@pytest.mark.parametrize("name", RUNS)
def test_real_stores_give_their_finalization_document(name, tmp_path):
    golden = (GOLDEN / "runs" / f"{name}.json").read_text(encoding="utf-8")
    before = json.loads(golden)
    summary = _stored_run_summary(name, before["run"]["missing_ranks"], tmp_path)
    assert len(summary["ranks"]) == 2 and summary["ranks"][0]["records_received"] > 0
    assert _document(summary, before["generated_unix_s"]) == golden


def _stored_run_summary(name: str, missing: list[int], tmp: Path) -> dict:
    """:func:`build_summary` of the stored run ``name`` (runs/<name>.sql.gz), loaded back
    into a fresh SQLite file under ``tmp`` through the aggregator's loader."""
    from traceml_aggregator.load import load
    from traceml_aggregator.store import Store

    db_path = tmp / "telemetry.sqlite"
    db = sqlite3.connect(db_path)
    db.executescript(gzip.decompress((GOLDEN / "runs" / f"{name}.sql.gz").read_bytes()).decode())
    db.close()
    store = Store(db_path)
    try:
        return build_summary(load(store, missing))
    finally:
        store.close()


def _write() -> None:
    """Rewrite every golden document with the code on sys.path: the hand-built runs, and the
    analysis of each stored run (its store stays; its ``generated_unix_s`` is kept)."""
    import tempfile

    for name, make in SCENARIOS.items():
        run, live = make()
        summary = build_summary(run, live=live, now_unix_s=0.0)
        (GOLDEN / f"{name}.json").write_text(_document(summary, 0.0))
    for name in RUNS:
        path = GOLDEN / "runs" / f"{name}.json"
        before = json.loads(path.read_text(encoding="utf-8"))
        with tempfile.TemporaryDirectory() as tmp:
            summary = _stored_run_summary(name, before["run"]["missing_ranks"], Path(tmp))
        path.write_text(_document(summary, before["generated_unix_s"]))


if __name__ == "__main__":
    sys.exit(_write())
