"""Diagnosis depth on real jobs (issue 30): host-memory leaks, a first-steps cache that is no
leak, stragglers for the last part or a middle stretch of the run, and prefetched batches that
are no slowdown. Real `traceml run` jobs (gloo, CPU) of tests/scripts/planted_depth.py, each
checked against what its ranks measured themselves (RSS after every step).

Three short runs (100 steps of a ~20 ms forward, more for the cache, 60 for the input-bound one),
the node sampler samples every 0.1 s (TRACEML_SAMPLE_INTERVAL_SEC) so that a few seconds of
training give the RSS test tens of readings.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import load_summary
from consistency import all_findings, check_consistent
from planted import side_by_side

pytestmark = [pytest.mark.slow, pytest.mark.torchrun]

MIB = 1024 * 1024
STEPS = 100
#: name -> (ranks, script arguments)
RUNS = {
    # rank 0 leaks 3 MiB a step, rank 2 5 MiB, rank 1 nothing; rank 2 is slow for the last 40 %
    # (one job for both leaks: they differ only in what each rank plants)
    "leak": (3, ["--leak", "0:3,2:5", "--slow-rank", "2", "--slow-from", "60"]),
    # a 300 MiB cache filled over the first 20 steps, flat since for at least twice as long
    # as the fill took (100 steps or more: beside another job's page faults, 15 MiB take 100 ms
    # to fill here, not 9, and a fill that reaches the later half of the readings after
    # warm-up is growth); rank 1 slow for steps 40-64
    "cache_middle": (
        2,
        [
            "--cache-mib",
            "300",
            "--cache-steps",
            "20",
            "--plateau-x",
            "2",
            "--slow-rank",
            "1",
            "--slow-from",
            "40",
            "--slow-to",
            "65",
        ],
    ),
    # every step waits for data once the worker's 16 prefetched batches are used up (about
    # step 20: it makes a batch every 100 ms, a step takes 15-30 ms). One worker: two would
    # deliver their batches in pairs, one step waiting twice as long and the next not at all.
    # No DDP: under an all-reduce the rank whose batch comes first waits for the other inside
    # it, and which one that is decides between INPUT_BOUND and INPUT_STRAGGLER by chance.
    "prefetch": (
        2,
        [
            "--steps",
            "60",
            "--forward-ms",
            "10",
            "--input-ms",
            "100",
            "--workers",
            "1",
            "--prefetch",
            "16",
            "--ddp",
            "0",
        ],
    ),
}
ENV = {"TRACEML_SAMPLE_INTERVAL_SEC": "0.1"}
#: Runs at a time: more would starve the ranks of CPU and blur the plants.
AT_ONCE = 2


class Run:
    """One finished run: its summary and what each rank measured with its own clock."""

    def __init__(self, base: Path, name: str, ranks: int) -> None:
        self.summary = load_summary(base / "logs" / name)
        self.clock = [json.loads((base / name / f"rank{r}.json").read_text()) for r in range(ranks)]

    def step_findings(self) -> list[dict]:
        return [self.summary["primary_diagnosis"]] + self.summary["findings"]["step_time"]

    def kind(self, section: str, kind: str) -> list[dict]:
        return [f for f in self.summary["findings"][section] if f["kind"] == kind]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Run]:
    base = tmp_path_factory.mktemp("depth")
    runs = {
        name: (ranks, ([] if "--steps" in args else ["--steps", str(STEPS)]) + args)
        for name, (ranks, args) in RUNS.items()
    }
    side_by_side("planted_depth.py", runs, base, AT_ONCE, env=ENV)
    return {name: Run(base, name, RUNS[name][0]) for name in RUNS}


def _own_rate(rss: list[int]) -> float:
    """The rank's own RSS growth, bytes per step: the least-squares slope over the steps after
    the first quarter."""
    pts = list(enumerate(rss))[len(rss) // 4 :]
    mx = sum(x for x, _ in pts) / len(pts)
    my = sum(y for _, y in pts) / len(pts)
    return sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)


def test_a_host_leak_is_memory_creep_on_the_leaking_ranks_at_their_own_rate(runs):
    run = runs["leak"]
    leaking = [0, 2]
    (f,) = run.kind("memory", "HOST_MEMORY_CREEP")
    assert f["ranks"] == leaking
    growth = f["evidence"]["per_rank_growth"]
    assert sorted(int(r) for r in growth) == leaking
    for r in leaking:
        own = _own_rate(run.clock[r]["rss_bytes"])
        assert growth[str(r)]["bytes_per_step"] == pytest.approx(own, rel=0.3), (r, own / MIB)
        assert growth[str(r)]["bytes_per_hour"] > 0
        assert growth[str(r)]["onset_step"] is not None
    # each at its own rate: 5 MiB a step on rank 2, 3 MiB on rank 0
    rates = [growth[str(r)]["bytes_per_step"] for r in leaking]
    assert rates[1] / rates[0] == pytest.approx(5 / 3, rel=0.3)
    # the time to exhaust the node's RAM at the leaking ranks' summed rate
    (node,) = f["evidence"]["per_node"].values()
    assert node["ranks"] == leaking
    assert node["hours_to_exhaust"] == pytest.approx(
        node["available_bytes"] / node["bytes_per_hour"], abs=0.01
    )
    assert f["evidence"]["hours_to_exhaust"] == node["hours_to_exhaust"]
    assert run.summary["ranks"][1]["memory"]["host_growth"]["name"] == "plateau"


def test_a_cache_filled_in_the_first_steps_is_no_leak(runs):
    run = runs["cache_middle"]
    assert run.kind("memory", "HOST_MEMORY_CREEP") == []
    for r, rank in enumerate(run.summary["ranks"]):
        assert rank["memory"]["host_growth"]["name"] == "plateau"
        rss = run.clock[r]["rss_bytes"]
        assert rss[25] - rss[0] >= 250 * MIB  # the cache is there: ~300 MiB in 20 steps


@pytest.mark.parametrize(
    "name, slow_rank, onset, end",
    [("leak", 2, 60, None), ("cache_middle", 1, 40, 65)],
)
def test_a_rank_slow_for_part_of_the_run_is_found_with_its_onset_and_end(
    runs, name, slow_rank, onset, end
):
    run = runs[name]
    stragglers = [f for f in run.step_findings() if f["kind"].endswith("STRAGGLER")]
    named = [f for f in stragglers if f["ranks"] == [slow_rank]]
    assert len(named) == 1, [f["summary"] for f in stragglers]
    (f,) = named
    assert f["kind"] == "COMPUTE_STRAGGLER"
    ev = f["evidence"]
    # Any other is a short stretch of host contention, real on this 2-core machine running
    # other jobs beside this one (CI saw rank 0 9.5 ms slower for 12 steps once): a stretch
    # that ended, under a third of the planted gap.
    for other in stragglers:
        if other is not f:
            assert other["evidence"]["end_step"] is not None, other["summary"]
            assert other["evidence"]["gap_ms"] < ev["gap_ms"] / 3, other["summary"]
    assert abs(ev["onset_step"] - onset) <= 5
    if end is None:
        assert ev["end_step"] is None and ev["last_step"] == STEPS - 1
    else:
        assert abs(ev["end_step"] - end) <= 5
    # its cost: the planted 60 ms (sleeps overshoot, a loaded host adds) over its steps
    assert 40 <= ev["gap_ms"] <= 90
    # over the steps it was found slow: to the end it was found at (the run's end without one)
    assert ev["cost_steps"] == (ev["end_step"] or STEPS) - ev["onset_step"]
    assert ev["cost_ms"] == pytest.approx(ev["gap_ms"] * ev["cost_steps"], abs=0.01)
    assert f"from step {ev['onset_step']}" in f["summary"]
    assert run.kind("step_time", "SLOWDOWN") == []  # the straggler explains the change


def test_prefetched_first_steps_are_no_slowdown(runs):
    run = runs["prefetch"]
    s = run.summary
    assert s["primary_diagnosis"]["kind"] == "INPUT_BOUND"
    assert s["primary_diagnosis"]["ranks"] == [0, 1]
    assert [
        f
        for f in s["findings"]["step_time"]
        if f["kind"] == "SLOWDOWN" and f["severity"] in ("warning", "critical")
    ] == []
    # the plant: the first steps ran on prefetched batches, faster than the steady ones
    steps = run.clock[0]["step_ms"]
    assert sorted(steps[5:15])[5] * 1.5 < sorted(steps[35:])[12]


def test_every_finding_is_consistent(runs):
    for name, run in runs.items():
        for f in all_findings(run.summary):
            check_consistent(f, name)
