"""Issue 30's statistics on hand-built runs (tests/rundata_factory.py): the memory growth test
(RSS, node RAM), stragglers for a stretch of the run, prefetched batches that are no slowdown,
and which of a change and a steady-state bottleneck costs more."""

from __future__ import annotations

import random

import pytest
from consistency import all_findings, check_consistent
from rundata_factory import MIB, gpu_sample, rank, rss_samples, run_of, step, system_sample

from traceml.analysis import memory, segments
from traceml.analysis.summary import build_summary

T0 = 1_000_000  # the factory's start_unix_us


def _kinds(s: dict, section: str) -> list[str]:
    return [f["kind"] for f in s["findings"][section]]


def _consistent(s: dict) -> dict:
    for f in all_findings(s):
        check_consistent(f, "unit")
    return s


# --- the memory growth test ----------------------------------------------------------------


def _memory_run(rss_of, n_ranks=2, n_steps=100, node_ram=None):
    ranks = [
        rank(
            r, [step(i) for i in range(n_steps)], process_samples=rss_samples(r, n_steps, rss_of(r))
        )
        for r in range(n_ranks)
    ]
    ram = node_ram or (lambda k: 0.3)
    system = {
        0: [system_sample(T0 + k * 100_000, ram=ram(k)) for k in range(n_steps * 335 // 1000)]
    }
    return run_of(ranks, system=system)


@pytest.mark.parametrize("mib_per_step", [2, 8])
def test_a_steady_rss_leak_is_creep_at_its_rate_with_the_time_to_fill_the_node(mib_per_step):
    leak = lambda r: lambda s: 400 * MIB + (s * mib_per_step * MIB if r == 1 else 0)  # noqa
    s = _consistent(build_summary(_memory_run(leak)))
    assert _kinds(s, "memory") == ["HOST_MEMORY_CREEP"]
    (f,) = s["findings"]["memory"]
    assert f["ranks"] == [1] and f["evidence"]["rank"] == 1
    g = s["ranks"][1]["memory"]["host_growth"]
    assert g["name"] == "creep" and g["statistic"] == "theil_sen_slope"
    assert g["bytes_per_step"] == pytest.approx(mib_per_step * MIB, rel=0.05)
    # 33.5 ms steps: 3600 / 0.0335 steps an hour
    assert g["bytes_per_hour"] == pytest.approx(mib_per_step * MIB * 3600 / 0.0335, rel=0.05)
    assert g["onset_step"] <= 5  # it leaked from the start
    assert s["ranks"][0]["memory"]["host_growth"]["name"] == "plateau"
    node = f["evidence"]["per_node"]["0"]
    available = 64 * 1024 * MIB - int(0.3 * 64 * 1024 * MIB)  # the factory's node: 30 % used
    assert node == {
        "ranks": [1],
        "bytes_per_hour": g["bytes_per_hour"],
        "available_bytes": available,
        "hours_to_exhaust": round(available / g["bytes_per_hour"], 2),
    }
    assert (
        f"node 0 runs out of RAM in {memory.hours_text(node['hours_to_exhaust'])}" in f["summary"]
    )


def test_a_cache_filled_in_the_first_steps_then_flat_is_a_plateau():
    cache = lambda r: lambda s: 400 * MIB + min(s, 20) * 20 * MIB  # noqa: E731 (400 MiB)
    s = build_summary(_memory_run(cache))
    assert _kinds(s, "memory") == []
    for r in s["ranks"]:
        assert r["memory"]["host_growth"]["name"] == "plateau"


def test_growth_that_begins_mid_run_names_its_onset():
    late = lambda r: lambda s: 400 * MIB + max(0.0, s - 60) * 6 * MIB  # noqa: E731
    s = build_summary(_memory_run(late))
    g = s["ranks"][0]["memory"]["host_growth"]
    assert g["name"] == "creep"
    assert abs(g["onset_step"] - 60) <= 5


def test_memory_growth_too_small_or_too_short_is_no_creep():
    tiny = lambda r: lambda s: 400 * MIB + s * 0.2 * MIB  # noqa: E731 (20 MiB over the run)
    assert _kinds(build_summary(_memory_run(tiny)), "memory") == []
    assert memory.growth([(i, i * 0.1, i * MIB) for i in range(7)]) is None


def test_node_ram_that_grows_without_its_ranks_is_a_finding_of_its_own():
    flat = lambda r: lambda s: 400 * MIB  # noqa: E731
    grows = lambda k: 0.3 + k * 0.001  # ~65 MiB a sample, 10 samples a second  # noqa: E731
    s = _consistent(build_summary(_memory_run(flat, node_ram=grows)))
    assert _kinds(s, "memory") == []
    assert _kinds(s, "system") == ["NODE_RAM_GROWTH"]
    (f,) = s["findings"]["system"]
    (row,) = f["evidence"]["nodes"]
    assert row["node_rank"] == 0 and row["ranks_rss_bytes_per_hour"] <= 10 * 3600 * MIB
    assert row["bytes_per_hour"] == pytest.approx(0.001 * 64 * 1024 * MIB * 36_000, rel=0.02)
    # ... and a node whose growth is its ranks' leak is not
    leak = lambda r: lambda s: 400 * MIB + s * 0.001 * 64 * 1024 * MIB * 0.0335 * 10 / 2  # noqa
    s = build_summary(_memory_run(leak, node_ram=grows))
    assert _kinds(s, "memory") == ["HOST_MEMORY_CREEP"]
    assert _kinds(s, "system") == []


# --- stragglers for a stretch of the run ---------------------------------------------------


def _stretch_run(n_ranks: int, slow, n_steps: int = 100, extra_us: int = 20_000, seed: int = 2):
    """``n_ranks`` ranks of ``n_steps`` steps, forward 10-11.5 ms; ``slow(rank, step)`` adds
    ``extra_us`` to that step's forward."""
    rng = random.Random(seed)
    ranks = []
    for r in range(n_ranks):
        ranks.append(
            rank(
                r,
                [
                    step(i, forward=10_000 + rng.randint(0, 1500) + extra_us * bool(slow(r, i)))
                    for i in range(n_steps)
                ],
            )
        )
    return run_of(ranks)


def _stragglers(s: dict) -> list[dict]:
    return [
        f
        for f in [s["primary_diagnosis"]] + s["findings"]["step_time"]
        if f["kind"].endswith("STRAGGLER")
    ]


@pytest.mark.parametrize("n_ranks, slow_rank, onset", [(4, 2, 75), (4, 3, 85), (2, 1, 60)])
def test_a_rank_slow_for_the_last_part_of_the_run_is_named_with_its_onset(
    n_ranks, slow_rank, onset
):
    s = _consistent(
        build_summary(_stretch_run(n_ranks, lambda r, i: r == slow_rank and i >= onset))
    )
    (f,) = _stragglers(s)
    assert (f["kind"], f["ranks"]) == ("COMPUTE_STRAGGLER", [slow_rank])
    ev = f["evidence"]
    assert (ev["onset_step"], ev["end_step"], ev["last_step"]) == (onset, None, 99)
    assert ev["cost_steps"] == 100 - onset
    assert ev["cost_ms"] == pytest.approx(ev["gap_ms"] * (100 - onset), abs=0.01)
    assert 19 <= ev["gap_ms"] <= 21.5 and ev["before_ms"] < 2  # the planted 20 ms
    assert ev["wait_ms_per_step"] == ev["after_ms"] == ev["gap_ms"]
    assert ev["gpu_hours"] == pytest.approx(n_ranks * ev["cost_ms"] / 3.6e6, abs=1e-6)
    assert f["impact_ms"] == pytest.approx(ev["cost_ms"] / 95, rel=1e-3)  # over the window
    assert f"from step {onset} to the end of the window (step 99)" in f["summary"]
    assert "SLOWDOWN" not in _kinds(s, "step_time")


def test_a_middle_stretch_with_recovery_has_its_start_and_end():
    s = _consistent(build_summary(_stretch_run(3, lambda r, i: r == 1 and 40 <= i < 65)))
    (f,) = _stragglers(s)
    assert f["ranks"] == [1]
    ev = f["evidence"]
    assert (ev["onset_step"], ev["end_step"], ev["last_step"], ev["cost_steps"]) == (40, 65, 64, 25)
    assert "from step 40 to step 65 (then it recovered)" in f["summary"]
    assert f["action"].startswith("Check rank 1's device")


def test_a_stretch_over_most_of_the_window_replaces_the_whole_window_finding():
    # slow for 56 of the 95 window steps: the median rule names the rank too; the stretch,
    # which also knows where it ended, takes its place
    s = _consistent(build_summary(_stretch_run(3, lambda r, i: r == 1 and 20 <= i < 76)))
    (f,) = _stragglers(s)
    ev = f["evidence"]
    assert (f["ranks"], ev["onset_step"], ev["end_step"], ev["cost_steps"]) == ([1], 20, 76, 56)
    assert ev["outside_ms"] < 2 and "stretches" in ev


def test_rotating_stragglers_are_pinned_on_no_rank():
    # a different rank slow at each step: no stretch anywhere
    s = build_summary(_stretch_run(4, lambda r, i: r == i % 4))
    assert _stragglers(s) == []
    # ... and stretches that move from rank to rank name each rank with its own
    s = build_summary(_stretch_run(4, lambda r, i: r == (i // 20) % 4 and i >= 20))
    found = {f["ranks"][0]: f["evidence"]["onset_step"] for f in _stragglers(s)}
    assert found == {1: 20, 2: 40, 3: 60, 0: 80}


def test_a_whole_window_straggler_is_not_named_twice():
    s = build_summary(_stretch_run(4, lambda r, i: r == 2))
    (f,) = _stragglers(s)
    assert f["ranks"] == [2] and f["evidence"]["onset_step"] is None
    assert "stretches" not in f["evidence"]


def test_stretches_of_a_gap_series():
    steps = list(range(5, 100))
    gaps = [20.0 if 30 <= s < 45 or s >= 80 else 0.5 for s in steps]
    found = segments.stretches(steps, gaps, 3.0)
    assert [(x["onset_step"], x["end_step"], x["steps"]) for x in found] == [
        (30, 45, 15),
        (80, None, 20),
    ]
    assert found[0]["cost_ms"] == 300.0 and found[0]["gap_ms"] == 20.0  # summed, median
    # shorter than STRETCH_MIN_STEPS: none
    assert segments.stretches(steps, [20.0 if 50 <= s < 58 else 0.5 for s in steps], 3.0) == []


# --- a slowdown is a change of the steady state ---------------------------------------------


def _input_run(onset: int, n_steps: int, wait_us: int = 40_000):
    """2 ranks whose input wait jumps from 0.1 ms to ``wait_us`` at step ``onset``."""
    return run_of(
        [
            rank(r, [step(i, input_wait=100 if i < onset else wait_us) for i in range(n_steps)])
            for r in range(2)
        ]
    )


def test_prefetched_batches_running_out_are_no_slowdown():
    s = _consistent(build_summary(_input_run(20, 80)))
    assert s["primary_diagnosis"]["kind"] == "INPUT_BOUND"
    assert _kinds(s, "step_time") == []


@pytest.mark.parametrize(
    "wait_ms, primary, rival", [(15, "SLOWDOWN", "INPUT_BOUND"), (30, "INPUT_BOUND", "SLOWDOWN")]
)
def test_a_slowdown_and_a_steady_bottleneck_the_costlier_leads(wait_ms, primary, rival):
    # every step waits wait_ms for data; from step 100 of 200 every rank computes 40 ms more:
    # the SLOWDOWN costs 40 ms x 100 / 195 = 20.5 ms a window step, the input wait wait_ms
    run = run_of(
        [
            rank(
                r,
                [
                    step(i, input_wait=wait_ms * 1000, forward=10_000 + 40_000 * (i >= 100))
                    for i in range(200)
                ],
            )
            for r in range(2)
        ]
    )
    s = _consistent(build_summary(run))
    p = s["primary_diagnosis"]
    assert p["kind"] == primary
    assert _kinds(s, "step_time") == [rival]
    (other,) = s["findings"]["step_time"]
    slowdown = p if primary == "SLOWDOWN" else other
    assert slowdown["evidence"]["onset_step"] == 100
    assert slowdown["impact_ms"] == pytest.approx(40 * 100 / 195, abs=0.01)
    for f in (p, other):
        assert f["evidence"]["window_cost_ms"] == pytest.approx(f["impact_ms"] * 195, rel=1e-4)
    assert (
        f"It costs the run more than {rival} does: "
        f"{p['evidence']['window_cost_ms'] / 1000:.2f} s against "
        f"{other['evidence']['window_cost_ms'] / 1000:.2f} s over the window's 195 steps."
    ) in p["summary"]


# --- the CUDA allocator under the same growth test -------------------------------------------


def _allocator_run(alloc_at, n_steps=120, every=5):
    """One GPU rank (80 GiB, rundata_factory.gpu_sample) whose peak allocated memory is
    ``alloc_at(step)`` bytes, read every ``every`` steps."""
    out = [step(i, alloc=alloc_at(i) if i % every == 0 else None) for i in range(n_steps)]
    gpus = {0: [gpu_sample(T0 + k * 1_000_000, 0, 90.0) for k in range(5)]}
    return run_of([rank(0, out, uuid="GPU-0-0")], gpus=gpus)


def test_an_allocator_cache_filled_over_the_first_steps_is_no_creep():
    # 4 GiB filled over the first 48 steps (40 % of the run), flat since: the thirds after
    # warm-up differ, but the later half of the readings no longer grows
    s = build_summary(_allocator_run(lambda i: 2048 * MIB + min(i, 48) * 85 * MIB))
    m = s["ranks"][0]["memory"]
    assert m["trend"]["name"] == "creep" and m["gpu_growth"]["name"] == "plateau"
    assert _kinds(s, "memory") == []


def test_allocator_creep_gives_the_time_until_the_gpu_is_full():
    s = _consistent(build_summary(_allocator_run(lambda i: 2048 * MIB + i * 50 * MIB)))
    (f,) = s["findings"]["memory"]
    assert f["kind"] == "MEMORY_CREEP" and f["ranks"] == [0]
    m = s["ranks"][0]["memory"]
    g = m["gpu_growth"]
    assert g["name"] == "creep" and g["bytes_per_step"] == 50 * MIB
    free = m["gpu_total_bytes"] - m["peak_reserved_bytes"]
    assert f["evidence"]["hours_to_exhaust"] == {"0": round(free / g["bytes_per_hour"], 2)}
    assert f"its GPU is full in {memory.hours_text(free / g['bytes_per_hour'])}" in f["summary"]


@pytest.mark.parametrize("extra_us", [20_050, 20_450, 61_950])
@pytest.mark.parametrize("onset", [0, 60])
def test_a_gap_on_a_half_tenth_of_a_ms_reads_the_same_in_the_text_and_the_evidence(extra_us, onset):
    """A gap computed in floats a hair off a twentieth of a ms (20.0500000001 ms) was written
    rounded once in the text and twice from the evidence (20.05, then 20.0 or 20.1): CI once
    found a straggler's text and evidence disagree so. The text is written from the evidence's
    rounded figure, for a stretch's finding and a whole window's."""
    ranks = [
        rank(r, [step(i, forward=10_000 + extra_us * (r == 2 and i >= onset)) for i in range(100)])
        for r in range(3)
    ]
    (f,) = _stragglers(_consistent(build_summary(run_of(ranks))))  # the text's gap included
    assert f["ranks"] == [2] and f["evidence"]["gap_ms"] == extra_us / 1000
    assert (f"from step {onset} " in f["summary"]) == (onset > 0)  # a stretch, or the window
