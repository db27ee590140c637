"""The final summary from the live aggregates (traceml_aggregator.aggregates, live.final_steps):
the same summary as the store's full load while every rank's steps fit its series, exact counts
and sums and sketched quantiles within their bound beyond it, the offline summary equal to the
live one, the aggregates seeded from the store after a restart, and the live analysis in a
process of its own."""

from __future__ import annotations

import asyncio
import json
import os
import pickle
import signal
import subprocess
import sys
from concurrent.futures.process import BrokenProcessPool

import pytest
from helpers import batches
from helpers.aggregator import LiveAggregator, finish, make_client, run_finalize_only
from helpers.waiting import LOADED_CALL_S
from test_live_aggregates import feed, node_batch, rank_batch

from traceml import wire
from traceml.analysis import digest as digest_mod
from traceml.analysis.document import CPU, GPU
from traceml.analysis.summary import build_summary
from traceml.core.endpoint import call as rpc
from traceml.core.phases import STEP_FIELDS
from traceml.sdk.client import STEPS
from traceml_aggregator.aggregates import (
    FOLD_STEPS,
    SERIES_STEPS,
    UNMEASURED,
    WINDOW_SLACK,
    StepState,
)
from traceml_aggregator.live import WINDOW_STEPS, LiveAggregates, with_steps
from traceml_aggregator.load import load
from traceml_aggregator.store import Store


def _comparable(summary: dict) -> dict:
    return {k: v for k, v in summary.items() if k != "generated_unix_s"}


def _final(store: Store, agg: LiveAggregates, missing=()) -> dict:
    """The summary as the aggregator's finalization builds it now."""
    return build_summary(with_steps(load(store, list(missing), steps=False), agg.final_steps()))


def _varied_batch(rank: int, seq: int, steps: range) -> wire.Batch:
    """Steps whose times vary (so medians and p95 differ from the mean), a memory reading
    every 10 steps and a GPU-timed step every 7 (three groups a batch, not in step order)."""
    b = batches.rank_batch(seq, steps, rank=rank, row=lambda i: _varied_row(rank, i))
    if seq == 1:
        b.identity.CopyFrom(
            wire.RankIdentity(
                run_name="r",
                rank=rank,
                world_size=2,
                node_rank=0,
                local_rank=rank,
                hostname="h0",
                start_unix_us=1_700_000_000_000_000,
                parallelism="ddp",
                device="cpu",
            )
        )
    return b


def _varied_row(rank: int, i: int) -> dict[str, int]:
    """Step ``i`` of rank ``rank`` as :func:`_varied_batch` varies it (µs, bytes)."""
    wait = 800 + (i * 37 + rank * 11) % 900 + (15_000 if rank == 1 and i % 50 == 0 else 0)
    row = {
        "step": i,
        "end_us": 30_000 * (i + 1),
        "step_us": 20_000 + wait + (i * 13) % 700,
        "input_wait_us": wait,
        "dataloader_next_us": wait - 100,
        "forward_us": 6_000 + (i * 7919) % 1500 + 4_000 * rank,
        "backward_us": 9_000 + (i * 31) % 400,
        "optimizer_us": 1_500 + i % 90,
    }
    if i % 10 == 0:
        row["peak_allocated_bytes"] = (1 << 31) + i * 4096 + rank
        row["peak_reserved_bytes"] = (1 << 32) + i * 8192
    if i % 7 == 0:
        row.update(
            gpu_step_us=row["step_us"] - wait,
            gpu_forward_us=row["forward_us"] + 50,
            gpu_backward_us=row["backward_us"] + 80,
            gpu_optimizer_us=row["optimizer_us"] + 20,
        )
    return row


def _run(tmp_path, steps_per_rank: int, chunk: int = 500):
    store, agg = Store(tmp_path / "t.sqlite"), LiveAggregates("r", 2)
    store.set_meta("run_name", "r")
    for seq, start in enumerate(range(0, steps_per_rank, chunk), start=1):
        steps = range(start, min(steps_per_rank, start + chunk))
        feed(store, agg, [_varied_batch(rank, seq, steps) for rank in (0, 1)])
    return store, agg


def test_while_every_step_fits_the_series_the_summary_equals_the_stored_one(tmp_path):
    store, agg = _run(tmp_path, SERIES_STEPS)  # exactly the series' length: no sample yet
    steps = agg.final_steps()
    assert [steps[r][2] for r in (0, 1)] == [None, None]  # no digest: every step is there
    stored = build_summary(load(store, []))
    assert stored["primary_diagnosis"]["kind"] == "COMPUTE_STRAGGLER"
    assert _comparable(_final(store, agg)) == _comparable(stored)
    store.close()


def test_a_long_run_has_exact_counts_and_quantiles_within_the_sketch_bound(tmp_path):
    n = 4 * SERIES_STEPS + 321
    store, agg = _run(tmp_path, n)
    stored, final = build_summary(load(store, [])), _final(store, agg)
    assert final["primary_diagnosis"]["kind"] == stored["primary_diagnosis"]["kind"]
    assert final["primary_diagnosis"]["evidence"]["slow_rank"] == 1
    bound = digest_mod.ALPHA
    for exact, approx in zip(stored["ranks"], final["ranks"], strict=True):
        assert approx["records_received"] == exact["records_received"] == n
        assert approx["steps_completed"] == n
        # Mean and max are exact (the digest's steps are the window's: index 5 on).
        for key in ("mean", "max"):
            assert approx["step_time_ms"][key] == exact["step_time_ms"][key]
        for key in ("median", "p95"):
            e, a = exact["step_time_ms"][key], approx["step_time_ms"][key]
            assert abs(a - e) <= bound * e + 0.001, (key, e, a)
        for part, e in exact["phase_median_ms"].items():
            a = approx["phase_median_ms"][part]
            assert (a is None) == (e is None)
            if e is not None:
                assert abs(a - e) <= bound * e + 0.001, (part, e, a)
        for part, e in exact["phase_share_pct"].items():  # exact sums: shares to 0.1 %
            assert approx["phase_share_pct"][part] == e
        for key in ("peak_allocated_bytes", "peak_reserved_bytes"):
            assert approx["memory"][key] == exact["memory"][key]
    assert final["analysis"]["clock"]["name"] == stored["analysis"]["clock"]["name"] == "gpu"
    store.close()


def test_a_sampled_series_holds_each_kept_step_exactly_as_stored(tmp_path):
    """The series is folded from the window's int64 columns: every step it keeps carries the
    values that step was stored with, as Python ints, None for each field the step did not
    measure (the memory readings every 10th step, the GPU times every 7th)."""
    n = 3 * FOLD_STEPS + 77
    store, agg = _run(tmp_path, n, chunk=40)
    for rank, (_, series, digest, _) in agg.final_steps().items():
        assert digest is not None  # sampled: level 1 or more
        steps = series.columns["step"]
        assert len(steps) < n and steps[-1] == n - 1
        for i, step in enumerate(steps):
            row = _varied_row(rank, step)
            kept = {name: series.columns[name][i] for name in STEP_FIELDS}
            assert kept == {name: row.get(name) for name in STEP_FIELDS}, step
            assert all(type(v) is int for v in kept.values() if v is not None)
        measured_gpu = sum(1 for s in range(5, n) if s % 7 == 0)
        assert digest.clocks[GPU].steps == measured_gpu
    store.close()


def test_ranks_fold_their_series_at_different_steps_and_no_figure_changes():
    """A rank's first chunk is shorter by ``offset`` (the live aggregates: rank % FOLD_STEPS),
    so that ranks stepping together do not all fold at the same step; where the chunks begin
    changes neither the series nor the digest."""
    n, per_group = 3 * FOLD_STEPS + 77, 4
    rows = [_varied_row(1, i) for i in range(n)]
    names = tuple(name for name in STEP_FIELDS if any(name in row for row in rows))
    states = {offset: StepState(WINDOW_STEPS, 256, offset=offset) for offset in (0, 137, 649)}
    pending_at = {}
    for start in range(0, n, per_group):
        group = rows[start : start + per_group]
        for state in states.values():
            state.fold(names, [[row.get(name) for row in group] for name in names])
        if start + per_group == 376:  # the first chunk of offset 137 (375 steps) is in
            pending_at = {o: s.pending for o, s in states.items()}
    assert pending_at == {0: 376, 137: 1, 649: 1}
    assert {o: (s.pending, s.chunk) for o, s in states.items()} == {
        0: (77, FOLD_STEPS),
        137: (77 + 137, FOLD_STEPS),
        649: (77 + 137, FOLD_STEPS),
    }
    finals = {o: s.final() for o, s in states.items()}
    (series, digest), others = finals[0], [finals[137], finals[649]]
    assert digest is not None and len(series.columns["step"]) < n  # sampled, with a digest
    for other_series, other_digest in others:
        assert other_series == series
        for clock in (CPU, GPU):
            assert other_digest.figures(clock) == digest.figures(clock)
        assert (other_digest.stored, other_digest.in_step_sum) == (n, digest.in_step_sum)


def test_the_window_holds_8_bytes_a_value_of_the_fields_measured_only():
    """The window is one packed int64 column per field a group carried (issue 26: ~37 KiB a
    rank at 8 fields, where one deque of Python ints per step field held ~220 KiB); a field
    first measured late reads None before, the window keeps its latest steps, and a
    checkpoint pickles the window's steps, not the columns' slack."""
    state = StepState(WINDOW_STEPS, 256)
    base = ("step", "end_us", "step_us", "forward_us")
    n = 3 * WINDOW_STEPS + 5
    for start in range(0, n, 10):
        steps = range(start, min(n, start + 10))
        state.fold(base, [list(steps), [10 * i for i in steps], [7] * len(steps), [3] * len(steps)])
    late = ("step", "end_us", "step_us", "backward_us")
    state.fold(late, [[n, n + 1], [10 * n, 10 * n + 10], [8, 9], [5, 6]])
    assert list(state.measured) == ["step", "end_us", "step_us", "forward_us", "backward_us"]
    assert state.size == WINDOW_STEPS
    assert state.tail(4) == {
        "step": (n - 2, n - 1, n, n + 1),
        "end_us": (10 * (n - 2), 10 * (n - 1), 10 * n, 10 * n + 10),
        "step_us": (7, 7, 8, 9),
        "forward_us": (3, 3, None, None),
        "backward_us": (None, None, 5, 6),
    }
    assert state.latest(WINDOW_STEPS)["step"] == list(range(n + 2 - WINDOW_STEPS, n + 2))
    assert state.latest(2)["gpu_step_us"] == [None, None]  # never measured: no column
    # 8 bytes a value of the 5 measured fields, the slack and the arrays' growth included
    held = sum(c.buffer_info()[1] * c.itemsize for c in state.columns.values())
    assert held <= 5 * (WINDOW_STEPS + WINDOW_SLACK) * 8 * 1.1, held
    assert min(state.columns["backward_us"]) == UNMEASURED
    kept = state.__getstate__()["columns"]
    assert {len(c) for c in kept.values()} == {WINDOW_STEPS}
    restored = pickle.loads(pickle.dumps(state))
    assert restored.tail(WINDOW_STEPS) == state.tail(WINDOW_STEPS)


def test_the_sample_is_bounded_the_same_on_every_rank_and_ends_with_the_last_step(tmp_path):
    n = 6 * SERIES_STEPS
    store, agg = _run(tmp_path, n)
    steps = agg.final_steps()
    series = {r: list(steps[r][1]["step"]) for r in (0, 1)}
    assert series[0] == series[1]
    assert SERIES_STEPS // 2 <= len(series[0]) <= SERIES_STEPS + 1
    assert series[0] == sorted(set(series[0])) and series[0][-1] == n - 1
    # Uniform over the run: each sixth of it holds about a sixth of the sample.
    sixths = [
        sum(1 for s in series[0] if k * SERIES_STEPS <= s < (k + 1) * SERIES_STEPS)
        for k in range(6)
    ]
    assert min(sixths) >= len(series[0]) / 6 * 0.6, sixths
    assert steps[0][2].stored == n and steps[0][2].counted == n - 5
    store.close()


def test_a_long_run_keeps_its_verdict_when_the_series_is_sampled(tmp_path):
    """The live test's straggler run, long: the same verdict and figures within the bound."""
    store, agg = Store(tmp_path / "t.sqlite"), LiveAggregates("r", 2)
    store.set_meta("run_name", "r")
    for seq, start in enumerate(range(0, 3000, 300), start=1):
        feed(
            store,
            agg,
            [rank_batch(r, seq, range(start, start + 300), slow_input=4000 * r) for r in (0, 1)]
            + [node_batch(seq, start * 1000)],
        )
    stored, final = build_summary(load(store, [])), _final(store, agg)
    for key in ("kind", "ranks"):
        assert final["primary_diagnosis"][key] == stored["primary_diagnosis"][key]
    e, a = (s["primary_diagnosis"]["evidence"]["gap_ms"] for s in (stored, final))
    assert abs(a - e) <= 2 * digest_mod.ALPHA * 5.0 + 0.002  # two medians of ~5 ms each
    store.close()


def test_the_aggregates_seeded_from_the_store_equal_those_of_the_aggregator_that_stored_it(
    tmp_path,
):
    n = 3 * SERIES_STEPS + 17
    store, agg = _run(tmp_path, n)
    fin = wire.RankFinish(steps_completed=n, end_state=wire.EndState.END_STATE_COMPLETED)
    feed(store, agg, [wire.Batch(run_name="r", rank=0, seq=99, finish=fin)])
    seeded = LiveAggregates("r", 2)
    seeded.seed(store)
    for r in (0, 1):
        a, b = agg.ranks[r], seeded.ranks[r]
        assert (b.steps_stored, b.last_step, b.last_step_unix_s) == (
            a.steps_stored,
            a.last_step,
            a.last_step_unix_s,
        )
        assert b.identity.start_unix_us == a.identity.start_unix_us
        # The window of the latest arrivals, as the live one (a batch's groups of other fields
        # arrive apart, so it is not the latest steps by index): folded in the stored order.
        assert b.steps.tail(WINDOW_STEPS)["step"] == a.steps.tail(WINDOW_STEPS)["step"]
        assert sorted(b.steps.tail(WINDOW_STEPS)["step"]) != list(range(n - WINDOW_STEPS, n))
    assert seeded.ranks[0].finish.steps_completed == 3 * SERIES_STEPS + 17
    assert _comparable(_final(store, seeded)) == _comparable(_final(store, agg))
    live_a = build_summary(agg.run_data(), live=True)
    live_b = build_summary(seeded.run_data(), live=True)
    assert live_b["analysis"]["window"]["steps"] == live_a["analysis"]["window"]["steps"]
    assert live_b["analysis"]["window"]["last_step"] == n - 1
    assert live_b["primary_diagnosis"]["kind"] == live_a["primary_diagnosis"]["kind"]
    store.close()


def test_the_analysis_process_is_at_a_low_priority_from_its_start():
    """The process is created at NICE, not reniced once its interpreter has started up (that
    start-up, ~0.6 s of CPU, would take CPU from ingest); the aggregator's own thread keeps
    its priority."""
    import psutil

    from traceml_aggregator.live import analysis_process

    base = os.nice(0)
    pool = analysis_process.spawn(os.getpid())
    try:
        (worker,) = pool._processes.values()
        assert psutil.Process(worker.pid).nice() == min(19, base + analysis_process.NICE)
        assert pool.submit(os.nice, 0).result(60) == min(19, base + analysis_process.NICE)
        assert os.nice(0) == base
    finally:
        pool.shutdown()


def test_the_live_analysis_runs_in_a_process_of_its_own_and_survives_its_death():
    import psutil

    from traceml_aggregator.live import analysis_process

    agg = LiveAggregates("r", 2)
    for r in (0, 1):
        agg.on_batch(rank_batch(r, 1, range(0, 60), slow_input=4000 * r))
    expected = build_summary(agg.run_data(), live=True)

    async def scenario():
        first = await agg.summary()
        (worker,) = agg._pool._processes.values()
        assert worker.pid != os.getpid()
        # at a low priority: on a saturated node it yields to training and to the ingest
        assert psutil.Process(worker.pid).nice() == min(19, os.nice(0) + analysis_process.NICE)
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(10)
        agg.on_batch(rank_batch(0, 2, range(60, 70)))
        with pytest.raises(BrokenProcessPool):
            await agg.summary()
        agg._next_start = 0.0
        return first, await agg.summary()

    try:
        first, again = asyncio.run(scenario())
    finally:
        agg.close()
    assert _comparable(first) == _comparable(expected)
    assert first["primary_diagnosis"]["kind"] == "INPUT_STRAGGLER"
    assert again["ranks"][0]["steps_completed"] == 70


@pytest.mark.aggregator
@pytest.mark.slow
def test_offline_finalization_writes_the_live_summary_and_a_restart_keeps_the_steps(tmp_path):
    """A real aggregator: 1,500 steps of rank 0 (sampled series), killed and restarted on its
    store: the restarted one's live view counts the steps the first one stored; its final
    summary equals ``--finalize-only``'s from the same store."""
    from traceml.launcher import aggregator as launcher_agg

    warnings: list[str] = []
    n = 1500
    agg = LiveAggregator(tmp_path / "run", "restarted", world_size=1)
    with agg:
        client = make_client(agg.target, "restarted", warnings)
        for i in range(n):
            client.submit(
                STEPS,
                {
                    "step": i,
                    "end_us": 10_000 * (i + 1),
                    "step_us": 9_000 + (i * 37) % 2000,
                    "input_wait_us": 500,
                    "forward_us": 3_000 + i % 400,
                    "backward_us": 4_000,
                    "optimizer_us": 700,
                },
            )
        assert client.close(finish(n))
        agg.kill()
        agg.start()  # a new aggregator on the same store
        reply = launcher_agg.summarize(agg.target, "restarted", LOADED_CALL_S)
        assert not reply.error, reply.error
        assert reply.metrics["window_steps"] == WINDOW_STEPS - 5  # seeded: the stored window
        done = rpc(
            agg.target, "Finalize", wire.FinalizeRequest(run_name="restarted", timeout_s=60), 90
        )
        assert not done.missing_ranks
        agg.stop()
    live = json.loads((tmp_path / "run" / "final_summary.json").read_text())
    assert live["ranks"][0]["records_received"] == n
    assert live["ranks"][0]["steps_completed"] == n
    result = run_finalize_only(tmp_path / "run", "restarted")
    assert result.returncode == 0, result.stderr
    offline = json.loads((tmp_path / "run" / "final_summary.json").read_text())
    assert _comparable(offline) == _comparable(live)


_ORPHAN = """
import asyncio, sys
sys.path.insert(0, sys.argv[1])
from test_live_aggregates import rank_batch
from traceml_aggregator.live import LiveAggregates
if __name__ == "__main__":
    agg = LiveAggregates("r", 1)
    agg.on_batch(rank_batch(0, 1, range(0, 30)))
    asyncio.run(agg.summary())
    (worker,) = agg._pool._processes.values()
    print(worker.pid, flush=True)
    sys.stdin.readline()
"""


@pytest.mark.aggregator
@pytest.mark.slow
def test_the_analysis_process_ends_when_the_aggregator_is_killed(tmp_path):
    import time

    import psutil

    script = tmp_path / "owner.py"
    script.write_text(_ORPHAN)
    owner = subprocess.Popen(
        [sys.executable, str(script), os.path.dirname(__file__)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        worker = psutil.Process(int(owner.stdout.readline()))
        assert worker.ppid() == owner.pid
        owner.kill()  # SIGKILL: no shutdown of the pool
        owner.wait(10)
        deadline = time.monotonic() + 5.0
        while worker.is_running() and worker.status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline, "the analysis process outlived the aggregator"
            time.sleep(0.1)
    finally:
        owner.kill()
