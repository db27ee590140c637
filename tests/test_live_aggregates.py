"""The live aggregates (traceml_aggregator.live): kept per committed batch, they give the same
summary as the store's full load while a rank's steps fit the window, and a bounded window with
exact counts beyond it."""

from __future__ import annotations

import asyncio
import types
from concurrent.futures import ThreadPoolExecutor

from helpers import batches
from helpers.batches import START_US

from traceml import wire
from traceml.analysis.summary import build_summary
from traceml_aggregator.live import WINDOW_STEPS, LiveAggregates, analysis_process
from traceml_aggregator.live import windows as live_windows
from traceml_aggregator.load import load
from traceml_aggregator.store import Store


def rank_batch(rank: int, seq: int, steps: range, *, restart: int = 0, slow_input=0, **fields):
    """Rank ``rank``'s batch of ``steps``: 10 ms steps, ``slow_input`` µs more input wait."""
    wait = 1000 + slow_input
    b = batches.rank_batch(
        seq,
        steps,
        rank=rank,
        restart=restart,
        row=lambda i: {
            "step": i,
            "end_us": 20_000 * (i + 1),
            "step_us": 9000 + wait,
            "input_wait_us": wait,
            "forward_us": 3000 + (i % 7) * 10,
            "backward_us": 5000,
            "optimizer_us": 1000,
        },
        **fields,
    )
    if seq == 1:
        b.identity.CopyFrom(batches.rank_identity(rank, restart))
    b.process_samples.add(
        unix_us=START_US + 20_000 * steps[-1], cpu_percent=90.0 + rank, rss_bytes=(1 << 30) + seq
    )
    return b


def node_batch(seq: int, t_us: int) -> wire.Batch:
    b = batches.node_batch(seq)
    s = b.system_samples.add(
        unix_us=t_us,
        node_rank=0,
        hostname="h0",
        cpu_percent=55.5,
        ram_used_bytes=1 << 33,
        ram_total_bytes=1 << 34,
    )
    s.gpus.add(
        nvml_index=0,
        uuid="GPU-0",
        util_percent=40.0 + seq,
        memory_used_bytes=1 << 30,
        memory_total_bytes=1 << 34,
    )
    return b


def feed(store: Store, agg: LiveAggregates, batches: list) -> None:
    """Store ``batches`` in one transaction and fold the ones stored into ``agg``, as the
    writer does after a commit."""
    for b, result in zip(batches, store.write_batches(batches, 0), strict=True):
        if not result.duplicate and not result.rejected:
            agg.on_batch(b)


def _comparable(summary: dict) -> dict:
    summary = dict(summary)
    summary.pop("generated_unix_s")
    return summary


def test_the_live_summary_equals_the_stored_one_while_the_steps_fit_the_window(tmp_path):
    store, agg = Store(tmp_path / "t.sqlite"), LiveAggregates("r", 2)
    store.set_meta("run_name", "r")  # as the server does
    seq = {0: 0, 1: 0}
    for chunk in range(6):
        steps = range(chunk * 20, chunk * 20 + 20)
        batches = []
        for rank in (0, 1):
            seq[rank] += 1
            batches.append(rank_batch(rank, seq[rank], steps, slow_input=4000 * rank))
        batches.append(node_batch(chunk + 1, START_US + 400_000 * chunk))
        feed(store, agg, batches)
        feed(store, agg, batches[:1])  # a resend: a duplicate, folded in nowhere
    finish = wire.RankFinish(steps_completed=120, end_state=wire.EndState.END_STATE_COMPLETED)
    feed(
        store,
        agg,
        [
            rank_batch(r, seq[r] + 1, range(120, 121), slow_input=4000 * r, finish=finish)
            for r in (0, 1)
        ],
    )
    exit_ = wire.NodeExit(run_name="r", node_rank=0, hostname="h0", exit_code=0)
    exit_.ranks.add(rank=1, local_rank=1, end_state=wire.EndState.END_STATE_COMPLETED, exit_code=0)
    store.write_node_exit(exit_, 0)
    agg.on_node_exit(exit_)

    stored = build_summary(load(store, []), live=True)
    live = build_summary(agg.run_data(), live=True)
    assert stored["primary_diagnosis"]["kind"] == "INPUT_STRAGGLER"
    assert [r["steps_completed"] for r in live["ranks"]] == [120, 120]
    assert _comparable(live) == _comparable(stored)
    assert agg.ranks[1].steps_stored == 121
    assert agg.ranks[1].last_step == 120
    assert agg.ranks[1].last_step_unix_s == (START_US + 20_000 * 121) / 1e6
    store.close()


def test_the_window_keeps_the_latest_steps_and_the_counts_stay_exact(tmp_path):
    agg = LiveAggregates("r")
    n = WINDOW_STEPS * 3 + 5
    agg.on_batch(rank_batch(0, 1, range(0, 1000)))
    agg.on_batch(rank_batch(0, 2, range(1000, n)))
    rl = agg.ranks[0]
    assert rl.steps_stored == n and rl.last_step == n - 1
    assert rl.steps.tail(WINDOW_STEPS)["step"] == tuple(range(n - WINDOW_STEPS, n))
    run = agg.run_data()
    assert run.world_size == 2 and sorted(run.ranks) == [0, 1]  # the identity's world size
    assert len(run.ranks[0].steps) == WINDOW_STEPS and len(run.ranks[1].steps) == 0


def test_a_new_attempt_starts_afresh_and_counts_the_earlier_one():
    agg = LiveAggregates("r", 1)
    agg.on_batch(rank_batch(0, 1, range(0, 30)))
    agg.on_batch(rank_batch(0, 1, range(0, 10), restart=1))
    agg.on_batch(rank_batch(0, 2, range(50, 60)))  # a late batch of attempt 0: ignored
    rd = agg.run_data().ranks[0]
    assert (rd.restart, rd.earlier_attempts, len(rd.steps)) == (1, {0: 30}, 10)
    assert rd.identity.restart == 1
    assert [p["restart"] for p in rd.process_samples] == [1]


def test_viewers_share_one_computation_and_an_unchanged_run_is_not_recomputed(monkeypatch):
    calls = []

    def counting(run, live):
        calls.append(run)
        return {"steps": sum(len(rd.steps) for rd in run.ranks.values())}

    monkeypatch.setattr(analysis_process, "build_summary", counting)
    monkeypatch.setattr(live_windows, "ANALYSIS_DUTY", 1.0)  # no wait between computations
    agg = LiveAggregates("r", 1, executor=ThreadPoolExecutor(1))  # runs the patched function
    agg.on_batch(rank_batch(0, 1, range(0, 30)))

    async def scenario():
        first = await asyncio.gather(*(agg.summary() for _ in range(4)))
        again = await agg.summary()
        agg.on_batch(rank_batch(0, 2, range(30, 40)))
        later = await agg.summary()
        return first, again, later

    first, again, later = asyncio.run(scenario())
    agg.close()
    assert first == [{"steps": 30}] * 4 and again == {"steps": 30} and later == {"steps": 40}
    assert len(calls) == 2


def test_a_slow_analysis_waits_at_most_the_gap_cap_before_the_next(monkeypatch):
    import time

    def slow(run, live):
        time.sleep(0.2)
        return {"steps": sum(len(rd.steps) for rd in run.ranks.values())}

    monkeypatch.setattr(analysis_process, "build_summary", slow)
    monkeypatch.setattr(live_windows, "ANALYSIS_MAX_GAP_S", 0.3)  # uncapped: 0.2 s * 9 = 1.8 s
    agg = LiveAggregates("r", 1, executor=ThreadPoolExecutor(1))
    agg.on_batch(rank_batch(0, 1, range(0, 30)))

    async def scenario():
        await agg.summary()
        agg.on_batch(rank_batch(0, 2, range(30, 40)))
        started = time.monotonic()
        result = await agg.summary()
        return result, time.monotonic() - started

    result, waited = asyncio.run(scenario())
    agg.close()
    assert result == {"steps": 40}
    assert 0.45 <= waited < 1.5  # the 0.3 s gap and a 0.2 s computation, not 1.8 s + 0.2 s


def test_each_query_ships_only_what_arrived_since_and_the_mirror_equals_the_windows(monkeypatch):
    """The analysis process is sent deltas: after a query, one batch of 10 steps of rank 1
    ships those 10 steps and that rank alone; the process's mirror, kept from the deltas
    through a window overflow, a new attempt, a node's samples and a node exit, gives the
    same summary as the whole windows at every query."""
    agg = LiveAggregates("r", 2, executor=ThreadPoolExecutor(1))  # the real analysis, in-process
    monkeypatch.setattr(analysis_process, "_mirror", analysis_process.Mirror())
    monkeypatch.setattr(live_windows, "ANALYSIS_DUTY", 1.0)  # no wait between computations
    sent, analyse = [], analysis_process.analyse
    monkeypatch.setattr(analysis_process, "analyse", lambda d: sent.append(d) or analyse(d))
    steps = {0: 0, 1: 0}

    def grow(rank: int, n: int, seq: int, restart: int = 0) -> None:
        start = 0 if seq == 1 else steps[rank]
        agg.on_batch(
            rank_batch(
                rank, seq, range(start, start + n), restart=restart, slow_input=4000 if rank else 0
            )
        )
        steps[rank] = start + n

    async def query() -> None:
        got = await agg.summary()
        mirror = analysis_process._mirror
        assert mirror.run_data() == agg.run_data()  # kept from deltas == read from the windows
        assert (mirror.node_exits, mirror.rank_ends) == (agg.node_exits, agg.rank_ends)
        assert _comparable(got) == _comparable(build_summary(agg.run_data(), live=True))

    async def scenario() -> None:
        grow(0, 40, 1), grow(1, 40, 1), agg.on_batch(node_batch(1, START_US))
        await query()
        assert sent[-1].full and sorted(sent[-1].ranks) == [0, 1]
        grow(1, 10, 2)
        await query()
        delta = sent[-1]
        assert not delta.full and sorted(delta.ranks) == [1]
        assert delta.ranks[1].step_columns()["step"] == list(range(40, 50))
        assert not delta.ranks[1].reset
        assert len(delta.ranks[1].process_samples) == 1
        assert delta.system_samples == {} and delta.node_exits == {}
        grow(0, WINDOW_STEPS + 7, 2), agg.on_batch(node_batch(2, START_US + 10**6))
        await query()
        assert sent[-1].ranks[0].reset
        assert len(sent[-1].ranks[0].step_columns()["step"]) == WINDOW_STEPS
        assert [s["unix_us"] for s in sent[-1].system_samples[0]] == [START_US + 10**6]
        grow(1, 20, 1, restart=1)  # a new attempt of rank 1
        report = wire.NodeExit(run_name="r", node_rank=0, hostname="h0", exit_code=0)
        agg.on_node_exit(report)
        await query()
        assert sent[-1].ranks[1].reset and sent[-1].ranks[1].restart == 1
        assert list(sent[-1].node_exits) == [0]

    asyncio.run(scenario())
    agg.close()


def test_the_live_summary_shows_the_runs_own_records_as_they_change(monkeypatch):
    """A node lost, or a stall, changes the run's records while no batch arrives: the next
    query recomputes (an unchanged run would be answered from the last result) and the live
    verdict names them, as the final summary would."""
    monkeypatch.setattr(analysis_process, "_mirror", analysis_process.Mirror())
    monkeypatch.setattr(live_windows, "ANALYSIS_DUTY", 1.0)
    agg = LiveAggregates("r", 2, executor=ThreadPoolExecutor(1))
    records = {"node_losses": [], "stall": None}
    agg.run_records = lambda: dict(records)
    for r in (0, 1):
        agg.on_batch(rank_batch(r, 1, range(0, 40)))
    loss = {
        "node_rank": 1,
        "hostname": "h1",
        "last_heard_unix_s": 35_974.5,
        "lost_unix_s": 36_000.0,
        "resumed_unix_s": None,
        "lost_after_s": 25.0,
    }

    async def scenario():
        before = await agg.summary()
        records["node_losses"] = [loss]
        after = await agg.summary()
        return before, after

    before, after = asyncio.run(scenario())
    agg.close()
    health = lambda s: [f["kind"] for f in s["findings"]["health"]]  # noqa: E731
    assert "NODE_LOST" not in health(before)
    assert "NODE_LOST" in health(after)
    assert after["run"]["telemetry_health"]["node_losses"] == [loss]


def test_the_live_analysis_covers_fewer_steps_per_rank_as_the_world_grows():
    """The analysis covers at most ANALYSIS_POINTS steps in all: the whole 512-step window up
    to 32 ranks, then 16,384 / world steps, never fewer than 32; each rank's latest ones."""
    sizes = [1, 32, 33, 256, 512, 8000]
    assert [analysis_process.analysis_steps(n) for n in sizes] == [512, 512, 496, 64, 32, 32]
    agg = LiveAggregates("r", 256)
    agg.on_batch(rank_batch(0, 1, range(0, 300)))
    delta = asyncio.run(agg._delta(whole=True, records={}))
    run = analysis_process.Mirror().apply(delta).run_data()
    assert run.world_size == 256 and sorted(run.ranks) == list(range(256))
    assert list(run.ranks[0].steps["step"]) == list(range(236, 300))  # the latest 64
    assert len(agg.run_data().ranks[0].steps) == 300  # the views' window keeps them all
    agg.on_batch(rank_batch(0, 2, range(300, 310)))
    assert len(agg.ranks[0].unshipped) == 1  # the batch's group, held for the next delta
    delta = asyncio.run(agg._delta(whole=False, records={}))  # 10 new steps: those alone
    assert delta.ranks[0].step_columns()["step"] == list(range(300, 310))
    assert not delta.ranks[0].reset and delta.ranks[0].steps == {}
    agg.on_batch(rank_batch(0, 3, range(310, 350)))
    agg.on_batch(rank_batch(0, 4, range(350, 510)))
    assert agg.ranks[0].unshipped is None  # past the 64 steps the analysis covers: none held
    delta = asyncio.run(agg._delta(whole=False, records={}))  # 200 new steps: the latest 64 of them
    assert delta.ranks[0].step_columns()["step"] == list(range(446, 510)) and delta.ranks[0].reset
    assert delta.ranks[0].groups == []


def test_a_delta_gives_the_loop_back_and_loses_nothing_that_arrives_meanwhile():
    """A delta of 100 changed ranks returns to the event loop between slices of 32 ranks;
    steps folded meanwhile go in this delta (a rank not copied yet) or the next (a rank
    already copied), and a mirror kept from the deltas equals the windows."""
    agg = LiveAggregates("r", 100)
    for r in range(100):
        agg.on_batch(rank_batch(r, 1, range(0, 20)))

    async def scenario():
        whole = await agg._delta(whole=True, records={})
        for r in range(100):
            agg.on_batch(rank_batch(r, 2, range(20, 25)))
        task = asyncio.ensure_future(agg._delta(whole=False, records={}))
        await asyncio.sleep(0)  # the delta copies its first slice, then yields
        assert not task.done()
        agg.on_batch(rank_batch(0, 3, range(25, 35)))  # copied already: the next delta
        agg.on_batch(rank_batch(99, 3, range(25, 35)))  # not copied yet: this delta
        first = await task
        return whole, first, await agg._delta(whole=False, records={})

    whole, first, second = asyncio.run(scenario())
    assert first.ranks[0].step_columns()["step"] == list(range(20, 25))
    assert first.ranks[99].step_columns()["step"] == list(range(20, 35))
    assert sorted(second.ranks) == [0, 99]
    assert second.ranks[0].step_columns()["step"] == list(range(25, 35))
    assert second.ranks[99].step_columns() == {"step": []}
    mirror = analysis_process.Mirror().apply(whole).apply(first).apply(second)
    assert mirror.run_data() == agg.run_data()


def test_the_dashboards_snapshot_is_built_from_the_mirror_as_from_the_windows(monkeypatch):
    """LiveAggregates.snapshot builds the dashboard's Snapshot in the analysis process, from
    the mirror kept by deltas: the same frame as a Snapshot of the windows themselves, after a
    first snapshot and after new steps."""
    from traceml_aggregator.dashboard import frames
    from traceml_aggregator.dashboard.frames import Cursor, Snapshot

    monkeypatch.setattr(analysis_process, "_mirror", analysis_process.Mirror())
    # One "now" for both snapshots: their ages (0.1 s) differ when they are built apart.
    monkeypatch.setattr(frames, "time", types.SimpleNamespace(time=lambda: 1_700_000_100.0))
    agg = LiveAggregates("r", 2, executor=ThreadPoolExecutor(1))  # the process's code, in-process

    def frame(snapshot) -> dict:
        return {k: v for k, v in snapshot.frame(Cursor()).items() if k != "run"}

    async def scenario() -> None:
        for r in (0, 1):
            agg.on_batch(rank_batch(r, 1, range(0, 40), slow_input=4000 * r))
        summary = await agg.summary()
        for version in (1, 2):
            got = await agg.snapshot(summary, version)
            want = Snapshot(agg.run_data(), summary, live=True, version=version)
            assert got.version == version and frame(got) == frame(want)
            assert got.frame(Cursor())["steps"]["1"]["step"] == list(
                range(0, 40 + 10 * (version - 1))
            )
            agg.on_batch(rank_batch(1, 2, range(40, 50)))

    asyncio.run(scenario())
    agg.close()


def test_a_snapshot_does_not_wait_for_the_live_summarys_pause(monkeypatch):
    """While a live summary waits out its pause between two computations (holding its own
    lock), the dashboard's snapshot is built at once."""
    monkeypatch.setattr(analysis_process, "_mirror", analysis_process.Mirror())
    agg = LiveAggregates("r", 2, executor=ThreadPoolExecutor(1))
    agg.on_batch(rank_batch(0, 1, range(0, 40)))

    async def scenario() -> None:
        agg._next_start = asyncio.get_running_loop().time() + 30  # the next summary in 30 s
        waiting = asyncio.ensure_future(agg.summary())
        await asyncio.sleep(0.05)
        # well inside the 30 s pause, not a figure of speed: a loaded machine may take seconds
        snapshot = await asyncio.wait_for(agg.snapshot(None, 7), 20)
        assert snapshot.version == 7 and not waiting.done()
        waiting.cancel()

    asyncio.run(scenario())
    agg.close()
