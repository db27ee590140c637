"""The live view names what issue 30 finds, while the run goes on: a rank that turns slow is
named within 30 s of its onset at one step a second, and a host leak as soon as its trend is
significant. Batches go through the live aggregates (traceml_aggregator.live) and the analysis
process's code (traceml_aggregator.live.analysis_process: its mirror kept from deltas), run
in-process.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from helpers.batches import START_US, rank_batch, rank_identity

from traceml import wire
from traceml_aggregator.live import LiveAggregates, analysis_process
from traceml_aggregator.live import windows as live_windows

S = 1_000_000  # µs: one step a second
MIB = 1024 * 1024
WORLD = 4


def _step_batch(rank: int, i: int, forward_us: int, rss: int) -> wire.Batch:
    """Rank ``rank``'s step ``i`` (ending at second i + 1) with its forward, and a process
    sample of RSS ``rss`` bytes at its end."""
    wait = 1000 + (i * 37 + rank * 11) % 500  # a little noise
    b = rank_batch(
        i + 1,
        [i],
        rank=rank,
        row=lambda i: {
            "step": i,
            "end_us": S * (i + 1),
            "step_us": 500_000,
            "input_wait_us": wait,
            "forward_us": forward_us + (i * 53 + rank * 29) % 900,
            "backward_us": 200_000,
            "optimizer_us": 20_000,
        },
        **({"identity": rank_identity(rank, world_size=WORLD)} if i == 0 else {}),
    )
    b.process_samples.add(unix_us=START_US + S * (i + 1), rss_bytes=rss)
    return b


def _watch(monkeypatch, steps: int, forward_us, rss) -> list[tuple[int, dict]]:
    """Feed ``steps`` steps of every rank, one step a second, and take the live summary after
    each: ``[(step, summary), ...]``."""
    agg = LiveAggregates("r", WORLD, executor=ThreadPoolExecutor(1))
    monkeypatch.setattr(analysis_process, "_mirror", analysis_process.Mirror())
    monkeypatch.setattr(live_windows, "ANALYSIS_DUTY", 1.0)  # no wait between computations
    seen = []

    async def scenario() -> None:
        for i in range(steps):
            for r in range(WORLD):
                agg.on_batch(_step_batch(r, i, forward_us(r, i), rss(r, i)))
            seen.append((i, await agg.summary()))

    asyncio.run(scenario())
    agg.close()
    return seen


def _stragglers(summary: dict) -> list[dict]:
    return [
        f
        for f in [summary["primary_diagnosis"]] + summary["findings"]["step_time"]
        if f["kind"].endswith("STRAGGLER")
    ]


def test_a_rank_that_turns_slow_is_named_within_30_s_of_its_onset(monkeypatch):
    onset = 90
    seen = _watch(
        monkeypatch,
        onset + 31,
        lambda r, i: 100_000 + 250_000 * (r == 2 and i >= onset),
        lambda r, i: 500 * MIB,
    )
    named = []
    for i, s in seen:
        found = _stragglers(s)
        if i < onset:
            assert found == [], (i, found)  # nobody before the onset
        elif found:
            (f,) = found
            assert (f["kind"], f["ranks"]) == ("COMPUTE_STRAGGLER", [2])
            named.append((i, f["evidence"]["onset_step"]))
    first, at = named[0]
    assert first - onset <= 30  # seconds, at one step a second
    assert abs(at - onset) <= 5
    assert [i for i, _ in named] == list(range(first, onset + 31))  # and named from then on


def test_a_host_leak_is_named_live_once_its_trend_is_significant(monkeypatch):
    leak_from = 30
    seen = _watch(
        monkeypatch,
        90,
        lambda r, i: 100_000,
        lambda r, i: 600 * MIB + (8 * MIB * (i - leak_from) if r == 1 and i > leak_from else 0),
    )
    creep = [
        (i, f) for i, s in seen for f in s["findings"]["memory"] if f["kind"] == "HOST_MEMORY_CREEP"
    ]
    assert creep, "never named"
    first, f = creep[0]
    assert first > leak_from and f["ranks"] == [1]
    # the rate over the growth since its onset, once named and to the end
    for i, f in creep:
        ev = f["evidence"]
        assert ev["bytes_per_step"] == 8 * MIB, i
        assert ev["bytes_per_hour"] == 8 * MIB * 3600  # one step a second
        assert abs(ev["onset_step"] - leak_from) <= 2
    # named within a minute of the leak's start, and from then on
    assert first - leak_from <= 60
    assert [i for i, _ in creep] == list(range(first, 90))
