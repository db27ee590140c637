"""Collectives as measured events (traceml/sdk/collectives.py), on a real 2-rank DDP job
(torchrun, gloo, CPU): every op recorded with its group, sequence number and bytes, the step's
``comm`` phase stored and summarised, and the training's results bit-identical without TraceML;
and, on a one-process gloo group driven by a step tracer, which steps measure ``comm``: none
before the rank's first collective, every one after it (0 on a step without one)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import zlib

import pytest
import torch
import torch.distributed as dist
from conftest import SCRIPTS, free_port, load_summary, query, run_traceml

from traceml import wire
from traceml.sdk import collectives
from traceml.sdk.step import StepTracer
from traceml.wire.records import add_steps, step_group_columns

STEPS = 10
#: Steps after them without any collective (DDP's ``no_sync``): ``comm`` measured as 0.
QUIET_STEPS = 3
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
            "--quiet-steps",
            str(QUIET_STEPS),
        ],
        cwd=tmp,
    )
    assert result.returncode == 0, result.stderr
    plain = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={WORLD}"]
        + [f"--master-port={free_port()}", script, "--out", str(tmp / "without")]
        + ["--steps", str(STEPS), "--quiet-steps", str(QUIET_STEPS), "--no-traceml"],
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
    total = STEPS + QUIET_STEPS
    assert [(r[0], r[1]) for r in rows] == [(r, s) for r in range(WORLD) for s in range(total)]
    busy = [r for r in rows if r[1] < STEPS]
    # six sync collectives a step: their time is in the step, never more than the step
    assert all(r[2] is not None and 0 < r[2] <= r[3] for r in busy)
    # after the rank's first collective a step without any has comm measured, as 0
    assert [(r[0], r[1], r[2]) for r in rows if r[1] >= STEPS] == [
        (r, s, 0) for r in range(WORLD) for s in range(STEPS, total)
    ]
    summary = load_summary(run_dir)
    for rank in summary["ranks"]:
        assert rank["phase_median_ms"]["comm"] > 0


# --- which steps measure comm: a one-process gloo group, a step tracer, a recorder --------------
@pytest.fixture
def traced(monkeypatch):
    """``(tracer, steps)``: a world-size-1 gloo group and a step tracer whose collectives are
    recorded (:func:`traceml.sdk.collectives.install`, as ``traceml.init()`` does), appending
    each finished step's measurement to ``steps``. The process's recorder is restored after
    (the wrappers stay in ``torch.distributed`` and pass calls straight through without one)."""
    monkeypatch.setattr(collectives, "_recorder", collectives._recorder)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        steps: list = []
        tracer = StepTracer(steps.append, time.perf_counter_ns())
        assert collectives.install(tracer) is not None
        yield tracer, steps
    finally:
        dist.destroy_process_group()


def _run_steps(tracer, n: int, collective_steps: dict[int, object]) -> None:
    """``n`` steps; on step ``i`` in ``collective_steps`` call its function (a collective)."""
    for i in range(n):
        tracer.begin()
        call = collective_steps.get(i)
        if call is not None:
            call()
        tracer.end()


def test_comm_is_measured_on_every_step_from_the_first_collective_on(traced):
    """A collective on steps 3 and 7 only: steps 0-2 (before the first) have no ``comm``;
    3 and 7 have the all-reduce's time; 4-6 and 8-9 have exactly 0, on the wire too (before
    the fix they had none, so the median ``comm`` was over steps 3 and 7 alone)."""
    tracer, steps = traced
    reduce = lambda: dist.all_reduce(torch.ones(4))  # noqa: E731
    _run_steps(tracer, 10, {3: reduce, 7: reduce})
    assert [m.step for m in steps] == list(range(10))
    comm = [m.comm_ns for m in steps]
    assert comm[:3] == [None, None, None]
    assert all(c is not None for c in comm[3:])
    assert comm[3] > 0 and comm[7] > 0
    assert [comm[i] for i in (4, 5, 6, 8, 9)] == [0] * 5
    fields = [m.fields() for m in steps]
    assert ["comm_us" in f for f in fields] == [False] * 3 + [True] * 7
    assert [fields[i]["comm_us"] for i in (4, 5, 6, 8, 9)] == [0] * 5
    batch = wire.Batch()
    add_steps(batch, fields)
    groups = [dict(zip(*step_group_columns(g), strict=True)) for g in batch.step_groups]
    # step 0 (no input wait), steps 1-2 (no comm), then the steps with comm (zeros included)
    # in two groups: those that waited in a collective (3, 7: with the arrival) and the rest
    assert [list(g["step"]) for g in groups] == [[0], [1, 2], [3, 7], [4, 5, 6, 8, 9]]
    by_step = {s: c for g in groups[2:] for s, c in zip(g["step"], g["comm_us"], strict=True)}
    assert by_step == {i: fields[i]["comm_us"] for i in range(3, 10)}
    assert [list(g.get("arrive_seq", [])) for g in groups] == [[], [], [1, 2], []]
    assert list(groups[2]["arrive_group"]) == [zlib.crc32(b"default")] * 2
    # the arrival is the all-reduce's entry: inside its step, before the step's end
    for i in (3, 7):
        assert fields[i]["end_us"] - fields[i]["step_us"] <= fields[i]["arrive_us"]
        assert fields[i]["arrive_us"] <= fields[i]["end_us"] - fields[i]["comm_us"]


def test_an_async_collective_starts_comm_at_zero(traced):
    """The first collective is async (an event, no part of ``comm``): its step and every later
    one measure ``comm`` as 0; the steps before it, none."""
    tracer, steps = traced
    _run_steps(tracer, 4, {1: lambda: dist.all_reduce(torch.ones(4), async_op=True).wait()})
    assert [m.comm_ns for m in steps] == [None, 0, 0, 0]


def test_without_collectives_comm_is_never_measured(traced):
    """A process whose recorder never sees a collective (single-process training under
    ``traceml.init()``) reports no ``comm`` on any step: "-", never 0."""
    tracer, steps = traced
    _run_steps(tracer, 10, {})
    assert [m.comm_ns for m in steps] == [None] * 10
    assert not any("comm_us" in m.fields() for m in steps)


#: A DDP bucket's hook future: the transfer, and a callback its hook added before TraceML's
#: (callbacks run in order, on the completing thread, after the future has woken its waiters).
TRANSFER_S, EARLIER_CALLBACK_S = 0.02, 0.3


def test_a_ddp_buckets_wait_is_comm_even_when_its_completion_runs_late(traced):
    """The completing thread runs the bucket future's callbacks after DDP's wait has returned:
    here a callback the user's hook added first holds it 0.3 s (as a starved gloo thread
    would). DDP waits on the future TraceML's hook returns, chained to the user's, so its
    backward returns once the bucket's completion is recorded, and the step's ``comm`` holds
    the wait (before: the callback ran after the step had closed, ``comm`` 0)."""
    import threading

    from torch.nn.parallel import DistributedDataParallel as DDP

    tracer, steps = traced

    def user_hook(state, bucket):
        fut = torch.futures.Future()
        fut.add_done_callback(lambda _fut: time.sleep(EARLIER_CALLBACK_S))
        buffer = bucket.buffer()

        def transfer():
            time.sleep(TRANSFER_S)
            fut.set_result(buffer)

        threading.Thread(target=transfer, daemon=True).start()
        return fut

    model = DDP(torch.nn.Linear(4, 2))
    model.register_comm_hook(None, user_hook)
    before = [p.detach().clone() for p in model.parameters()]
    tracer.begin()
    model(torch.ones(3, 4)).sum().backward()
    tracer.end()
    (step,) = steps
    assert step.comm_ns >= (TRANSFER_S + EARLIER_CALLBACK_S) * 1e9
    (bucket,) = [ev for ev in collectives._recorder.events if ev.op == collectives.DDP_BUCKET]
    assert bucket.done_ns is not None and not collectives._recorder.open
    # the gradients are the hook's value, passed on unchanged (world size 1: the sum)
    grads = [p.grad for p in model.parameters()]
    assert [g.shape for g in grads] == [b.shape for b in before]
    assert torch.equal(grads[1], torch.full((2,), 3.0))
