"""Collectives as measured events (traceml/sdk/collectives.py), on a real 2-rank DDP job
(torchrun, gloo, CPU): every op recorded with its group, sequence number and bytes, the step's
``comm`` phase stored and summarised, and the training's results bit-identical without TraceML."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from conftest import SCRIPTS, free_port, load_summary, query, run_traceml

STEPS = 10
WORLD = 2
#: Bytes of the job's one DDP bucket: Linear(32, 64) + Linear(64, 3), float32.
BUCKET_BYTES = (32 * 64 + 64 + 64 * 3 + 3) * 4
#: One step's collectives on every rank, in order: (op, bytes the rank contributes).
STEP_OPS = [
    ("ddp_bucket", BUCKET_BYTES),
    ("all_reduce", 4),
    ("all_gather_into_tensor", 16),
    ("all_gather", 8),
    ("reduce_scatter_tensor", 8 * WORLD),
    ("broadcast", 12),
    ("barrier", 0),
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("collectives")
    (tmp / "with").mkdir()
    (tmp / "without").mkdir()
    script = str(SCRIPTS / "collectives_ddp.py")
    result = run_traceml(
        [
            "run",
            script,
            f"--nproc-per-node={WORLD}",
            "--aggregator-port",
            str(free_port()),
            "--logs-dir",
            str(tmp / "logs"),
            "--run-name",
            "coll",
            "--",
            "--out",
            str(tmp / "with"),
            "--steps",
            str(STEPS),
        ],
        cwd=tmp,
    )
    assert result.returncode == 0, result.stderr
    plain = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={WORLD}"]
        + [f"--master-port={free_port()}", script, "--out", str(tmp / "without")]
        + ["--steps", str(STEPS), "--no-traceml"],
        cwd=tmp,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert plain.returncode == 0, plain.stderr
    return tmp


@pytest.mark.slow
@pytest.mark.torchrun
@pytest.mark.parametrize("rank", range(WORLD))
def test_every_collective_is_an_event_with_group_seq_and_bytes(runs, rank):
    events = json.loads((runs / "with" / f"events_{rank}.json").read_text())
    assert [(e["op"], e["nbytes"]) for e in events] == STEP_OPS * STEPS
    assert {e["group"] for e in events} == {"default"}
    assert [e["seq"] for e in events] == list(range(1, len(STEP_OPS) * STEPS + 1))
    assert all(e["done_ns"] is not None and e["done_ns"] >= e["entry_ns"] for e in events)
    assert [e["phase"] for e in events[: len(STEP_OPS)]] == ["backward"] + ["step"] * 6


@pytest.mark.slow
@pytest.mark.torchrun
def test_results_are_bit_identical_with_and_without_traceml(runs):
    for rank in range(WORLD):
        a = torch.load(runs / "with" / f"result_{rank}.pt")
        b = torch.load(runs / "without" / f"result_{rank}.pt")
        for key in ("params", "results"):
            assert len(a[key]) == len(b[key])
            for x, y in zip(a[key], b[key], strict=True):
                assert torch.equal(x, y), key


@pytest.mark.slow
@pytest.mark.torchrun
def test_comm_is_a_phase_in_the_store_and_the_summary(runs):
    run_dir = runs / "logs" / "coll"
    rows = query(run_dir, "SELECT rank, step, comm_us, step_us FROM steps ORDER BY rank, step")
    assert [(r[0], r[1]) for r in rows] == [(r, s) for r in range(WORLD) for s in range(STEPS)]
    # six sync collectives a step: their time is in the step, never more than the step
    assert all(r[2] is not None and 0 < r[2] <= r[3] for r in rows)
    summary = load_summary(run_dir)
    for rank in summary["ranks"]:
        assert rank["phase_median_ms"]["comm"] > 0
