"""The retention's choice of rows (traceml_aggregator/retention.py), on hand-built rows: which
rows each rule keeps, the evidence cap, the rows held back across prunes so an onset at a
prune's boundary keeps its neighbourhood; of a sample group, exactly its first and last sample
times and those its series held. The real aggregator's prunes are tests/test_retention.py."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from helpers.batches import node_batch

from traceml.core.records import GpuSample, ProcessSample
from traceml_aggregator import retention
from traceml_aggregator.aggregates import keep_mask
from traceml_aggregator.retention import (
    HELD_STEPS,
    ONSET_NEIGHBOURHOOD_STEPS,
    SPIKE_FACTOR,
    STATE_META_KEY,
    Policy,
    Pruner,
    RankPlan,
    SamplePruner,
    evidence,
    most_sample_times_kept,
    sample_meta_keys,
    sampled,
)
from traceml_aggregator.store import Store
from traceml_aggregator.writer import Writer

STEP_US = 25_000


class _Store:
    """What a :class:`Pruner` reads of the store at its start: ``meta``."""

    def __init__(self, meta: dict[str, str] | None = None) -> None:
        self._meta = meta or {}

    def meta(self) -> dict[str, str]:
        return self._meta


def _rows(rank: int, steps: range, step_us, *, restart: int = 0, rowid0: int = 1) -> dict:
    n = len(steps)
    return {
        "rowid": np.arange(rowid0, rowid0 + n, dtype=np.int64),
        "rank": np.full(n, rank, dtype=np.int64),
        "restart": np.full(n, restart, dtype=np.int64),
        "step": np.array(steps, dtype=np.int64),
        "step_us": np.array([step_us(i) for i in steps], dtype=np.int64),
    }


def _cat(*parts: dict) -> dict:
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def test_the_sample_is_the_series_hash_at_a_power_of_two_and_one_in_n_otherwise():
    steps = np.arange(1 << 16, dtype=np.int64)
    assert np.array_equal(sampled(steps, 64), keep_mask(steps, 6))
    assert sampled(steps, 64).sum() in within_10pct(len(steps) / 64)
    assert sampled(steps, 100).sum() in within_10pct(len(steps) / 100)
    assert sampled(steps, 1).all()


def within_10pct(expected: float) -> range:
    """Within 10 % of ``expected`` (a hash's sample of 65,536 indices)."""
    return range(int(expected * 0.9), int(expected * 1.1) + 1)


def test_spikes_and_an_onsets_neighbourhood_are_evidence_nothing_else():
    steps = np.arange(1_000, 1_400, dtype=np.int64)
    step_us = np.full(len(steps), STEP_US, dtype=np.int64)
    step_us[steps >= 1_200] += 12_000  # an onset at 1,200
    spike_at = [1_050, 1_333]
    step_us[np.isin(steps, spike_at)] = int(SPIKE_FACTOR * STEP_US) + 1
    kept = set(steps[evidence(steps, step_us, STEP_US)].tolist())
    near = set(range(1_200 - ONSET_NEIGHBOURHOOD_STEPS, 1_200 + ONSET_NEIGHBOURHOOD_STEPS + 1))
    assert kept == near | set(spike_at)
    flat = np.full(len(steps), STEP_US, dtype=np.int64) + (steps % 7) * 100  # 0-600 µs jitter
    assert not evidence(steps, flat, STEP_US).any()


def test_each_rule_keeps_its_rows_and_the_rest_goes():
    policy = Policy(first_steps=100, last_steps=50, sample_every=32, evidence_steps=10)
    pruner = Pruner(_Store(), policy)
    rows = _rows(0, range(0, 2_000), lambda i: STEP_US + (i % 7) * 100)
    plans = {0: RankPlan(0, 2_999, 3, float(STEP_US))}  # the rank is at step 2,999
    gone = set(pruner.drop(plans, rows).tolist())
    steps = rows["step"]
    kept = set(rows["rowid"].tolist()) - gone
    expected = (steps < 100) | sampled(steps, 32) | keep_mask(steps, 3)
    held = set(pruner.held[0]["rowid"].tolist())
    assert len(held) == HELD_STEPS
    assert kept - held == set(rows["rowid"][expected].tolist())


def test_a_live_runs_small_prunes_keep_the_last_steps_of_the_run_not_of_every_prune():
    """Checkpoints cover fewer steps than the last-steps window (2 steps/s x 30 s against
    1,000): each prune's rows are all within the window then, and must be decided later."""
    policy = Policy(first_steps=0, last_steps=100, sample_every=1 << 20, evidence_steps=0)
    pruner = Pruner(_Store(), policy)
    gone: set[int] = set()
    per_prune, prunes = 50, 30
    for i in range(prunes):
        steps = range(i * per_prune, (i + 1) * per_prune)
        rows = _rows(0, steps, lambda _s: STEP_US, rowid0=1 + i * per_prune)
        plans = {0: RankPlan(0, steps[-1], 20, float(STEP_US))}
        gone |= set(pruner.drop(plans, rows, final=i == prunes - 1).tolist())
    run = np.arange(per_prune * prunes, dtype=np.int64)
    kept = set(range(len(run))) - {r - 1 for r in gone}  # rowid r is step r - 1
    last = set(range(len(run) - 100, len(run)))
    held = {int(r) - 1 for r in pruner.held[0]["rowid"]}
    assert len(held) == HELD_STEPS and max(held) < min(last)
    assert kept == last | held | set(run[keep_mask(run, 20)].tolist())
    assert 0 not in pruner.pending  # the final prune decided them


@pytest.mark.parametrize("restart", [False, True], ids=["one pruner", "restarted from its state"])
def test_evidence_is_capped_per_rank(restart):
    """And the cap outlives a restart: the pruner that replaces this one (from the stored
    state) keeps no more evidence steps."""
    policy = Policy(first_steps=0, last_steps=1, sample_every=1 << 20, evidence_steps=10)
    pruner = Pruner(_Store(), policy)
    plans = {0: RankPlan(0, 10_000, 20, float(STEP_US))}
    pruner.drop(plans, _rows(0, range(1, 1_001), lambda i: STEP_US * (3 if i % 10 == 0 else 1)))
    if restart:
        pruner.held.clear()  # held rows are read back from a real store (tests/test_retention.py)
        pruner = Pruner(_Store({STATE_META_KEY: pruner.state()}), policy)
    assert pruner.evidence_kept == {0: 10}
    pruner.drop(plans, _rows(0, range(1_001, 2_001), lambda i: STEP_US * 3, rowid0=1_001))
    assert pruner.evidence_kept == {0: 10}


def test_an_onset_at_a_prunes_boundary_keeps_its_neighbourhood_through_the_held_rows():
    policy = Policy(first_steps=0, last_steps=1, sample_every=1 << 20, evidence_steps=1_000)
    pruner = Pruner(_Store(), policy)
    onset = 1_000 - 5  # 5 steps before the first prune's last row

    def step_us(i: int) -> int:
        return STEP_US + (12_000 if i >= onset else 0)

    plans = {0: RankPlan(0, 100_000, 30, float(STEP_US))}
    gone = set(pruner.drop(plans, _rows(0, range(0, 1_000), step_us)).tolist())
    gone |= set(pruner.drop(plans, _rows(0, range(1_000, 2_000), step_us, rowid0=1_001)).tolist())
    rowid_of_step = {s: s + 1 for s in range(2_000)}
    for s in range(onset - ONSET_NEIGHBOURHOOD_STEPS, onset + ONSET_NEIGHBOURHOOD_STEPS + 1):
        assert rowid_of_step[s] not in gone, s


def test_earlier_attempts_and_unknown_ranks_are_kept():
    policy = Policy(first_steps=0, last_steps=1, sample_every=1 << 20, evidence_steps=0)
    pruner = Pruner(_Store(), policy)
    rows = _cat(
        _rows(0, range(0, 500), lambda i: STEP_US, restart=0),
        _rows(0, range(0, 500), lambda i: STEP_US, restart=1, rowid0=501),
        _rows(7, range(0, 500), lambda i: STEP_US, rowid0=1_001),
    )
    plans = {0: RankPlan(1, 10_000, 30, float(STEP_US))}  # rank 0 is on attempt 1
    gone = pruner.drop(plans, rows)
    assert gone.min() >= 501 and gone.max() <= 1_000  # attempt 1 of rank 0 only
    assert len(gone) == 500 - HELD_STEPS - 1  # step 0: the hash keeps it at every level


T0_US = 1_700_000_000_000_000


def _samples(
    key: tuple, ticks: range, *, per_tick: int = 1, rowid0: int = 1, record=ProcessSample
) -> dict:
    """A group's rows of ``record``'s table (``key``: its GROUP columns' values), ``per_tick``
    rows a sample time (a node's GPUs), one time a second from T0_US."""
    times = np.repeat(np.array(ticks, dtype=np.int64) * 1_000_000 + T0_US, per_tick)
    n = len(times)
    out = {"rowid": np.arange(rowid0, rowid0 + n, dtype=np.int64), "unix_us": times}
    for name, value in zip(record.GROUP, key, strict=True):
        out[name] = np.full(n, value, dtype=np.int64)
    return out


def _series(ticks, level: int) -> np.ndarray:
    """The ``unix_us`` a series at ``level`` holds of ``ticks`` (float64, as it keeps them)."""
    return np.array([T0_US + t * 1_000_000 for t in ticks if t % (1 << level) == 0], np.float64)


def _ticks(rows: dict, rowids) -> list[int]:
    """The sample times (ticks) of ``rows``' rows of ``rowids``, sorted."""
    at = np.isin(rows["rowid"], np.asarray(list(rowids), dtype=np.int64))
    return sorted(((rows["unix_us"][at] - T0_US) // 1_000_000).tolist())


def test_a_sample_group_keeps_its_first_and_last_times_and_what_its_series_held():
    """3,000 sample times pruned in three calls: the series at level 2 for the first, level 3
    from the second on; the last call is the run's end. Kept: the first 100 times, the times
    the series held when they were decided, the last 50, nothing else."""
    policy = Policy(first_samples=100, last_samples=50)
    pruner = SamplePruner(_Store(), ProcessSample, policy)
    key = (0, 0)
    every = _samples(key, range(3_000))
    gone: set[int] = set()
    for lo, level, final in ((0, 2, False), (1_000, 3, False), (2_000, 3, True)):
        rows = {k: c[lo : lo + 1_000] for k, c in every.items()}
        series = {key: _series(range(lo + 1_000), level)}
        gone |= set(pruner.drop(series, rows, final).tolist())
        if not final:  # the latest 50 times wait for the next call, undecided
            assert _ticks(every, pruner.held[key]["rowid"]) == list(range(lo + 950, lo + 1_000))
    kept = _ticks(every, set(every["rowid"].tolist()) - gone)
    expected = (
        set(range(100))
        | {t for t in range(950) if t % 4 == 0}  # decided by the first call (level 2)
        | {t for t in range(950, 2_950) if t % 8 == 0}  # by the later ones (level 3)
        | set(range(2_950, 3_000))
    )
    assert kept == sorted(expected)
    assert len(kept) == 100 + 213 + 250 + 50
    assert not pruner.held


def test_a_group_that_stopped_sending_keeps_its_last_times_and_every_gpu_row_of_a_time():
    """Node 0's GPU samples (2 rows a time) stop after 300 times while node 1's go on; an
    unknown group (no series) keeps every row; the first-times count outlives a restart."""
    policy = Policy(first_samples=20, last_samples=10)
    pruner = SamplePruner(_Store(), GpuSample, policy)

    def gpus(node: int, ticks: range, rowid0: int) -> dict:
        return _samples((node,), ticks, per_tick=2, rowid0=rowid0, record=GpuSample)

    first = _cat(gpus(0, range(300), 1), gpus(1, range(300), 601), gpus(9, range(50), 1_201))
    series = {(n,): _series(range(600), 6) for n in (0, 1)}  # every 64th time: 0, 64, ...
    gone = set(pruner.drop(series, first).tolist())
    assert not gone & set(first["rowid"][first["node_rank"] == 9].tolist())  # no series: kept
    assert set(pruner.seen) == {(0,), (1,), (9,)} and pruner.seen[(0,)] == 20  # capped
    restarted = SamplePruner(_Store(sample_state(GpuSample, pruner)), GpuSample, policy)
    assert restarted.seen == pruner.seen
    restarted.held = pruner.held  # the held rows are this aggregator's (see SamplePruner)
    later = gpus(1, range(300, 600), 2_000)
    gone |= set(restarted.drop(series, later, final=True).tolist())
    rows = _cat(first, later)
    for node, times in ((0, 300), (1, 600)):
        mine = rows["node_rank"] == node
        kept = set(rows["rowid"][mine].tolist()) - gone
        ticks = _ticks(rows, kept)
        expected = set(range(20)) | set(range(0, times, 64)) | set(range(times - 10, times))
        assert ticks == sorted(t for t in expected for _ in range(2)), node  # both GPUs
        assert len(kept) == 2 * (20 + len(range(64, times - 10, 64)) + 10)


def sample_state(record, pruner: SamplePruner) -> dict[str, str]:
    """The ``meta`` a store holds after ``pruner``'s prune of ``record``'s table."""
    mark_key, state_key = sample_meta_keys(record.TABLE)
    return {mark_key: "0", state_key: pruner.state()}


def test_the_bound_of_sample_times_kept_covers_the_defaults_3_day_group():
    policy = Policy()
    ticks = 3 * 86_400  # 3 days at 1 sample/s
    levels = 9  # 512 x 2**9 = 262,144 >= 259,200
    expected = policy.first_samples + policy.last_samples + 512 + (levels + 1) * 256
    assert most_sample_times_kept(policy, ticks) == expected
    assert most_sample_times_kept(policy, 512) == policy.first_samples + policy.last_samples + 768


@pytest.mark.parametrize("round_rows", [retention.ROUND_ROWS, 7])
def test_a_prune_killed_after_a_round_cut_inside_a_sample_time_leaves_whole_times(
    tmp_path, monkeypatch, round_rows
):
    """Node 0's GPU samples (2 GPUs a time, 10 times a batch) on a real store: a prune up to
    the table's highest row, which is never pruned, so its reach ends inside the last time
    (and, with 7 rows a round, so does every round), then the aggregator is killed (its held
    rows are lost, and stay for good); a replacement prunes on to the run's end. Every time
    left has both its GPU rows, and exactly these times are left: the first 2, those the
    killed prune held (its last 3 whole ones), the last 3 and the table's highest row's."""
    monkeypatch.setattr(retention, "ROUND_ROWS", round_rows)
    policy = Policy(first_samples=2, last_samples=3)
    path = tmp_path / "telemetry.sqlite"

    async def prune(batches: range, final: bool) -> None:
        store = Store(path)
        writer = Writer(store, lambda batch, _: None)
        writer.start()
        for seq in batches:
            batch = node_batch(seq, run_name="r")
            for t in range(10 * (seq - 1), 10 * seq):
                s = batch.system_samples.add(node_rank=0, unix_us=T0_US + t, hostname="h0")
                for g in range(2):
                    s.gpus.add(nvml_index=g, uuid=f"GPU-{g}")
            await writer.queue_batch(batch)
        highest = await writer.call(store.max_rowid, GpuSample.TABLE)
        pruner = SamplePruner(store, GpuSample, policy)
        await pruner.prune(writer, highest, {(0,): np.zeros(0)}, final=final)
        await writer.close()  # closes the store

    asyncio.run(prune(range(1, 5), final=False))  # times 0-39, then killed
    asyncio.run(prune(range(5, 9), final=True))  # times 40-79, the run's end
    store = Store(path, read_only=True)
    rows = store.query("SELECT unix_us, nvml_index FROM gpu_samples", by_name=False)
    store.close()
    gpus: dict[int, list[int]] = {}
    for unix_us, gpu in rows:
        gpus.setdefault(unix_us - T0_US, []).append(gpu)
    assert all(sorted(g) == [0, 1] for g in gpus.values()), gpus
    assert sorted(gpus) == [0, 1, 36, 37, 38, 76, 77, 78, 79]
