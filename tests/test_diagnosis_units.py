"""The analysis as pure functions over constructed RunData: every diagnosis, exact values.

What a CPU run under `traceml run` cannot produce here (GPU clock, H2D, NVML, memory, several
nodes) is built directly; test_diagnosis_planted.py covers the real runs.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import replace
from pathlib import Path

import pytest
from consistency import check_consistent
from rundata_factory import MIB, gpu_sample, rank, run_of, step, steps, system_sample

from traceml.analysis import memory, thresholds
from traceml.analysis.findings import KINDS
from traceml.analysis.rundata import RankData
from traceml.analysis.stats import bucket_medians, lower_median
from traceml.analysis.summary import build_summary
from traceml.core.records import LostNode

DOCS = Path(__file__).resolve().parents[1] / "docs" / "reading-output.md"


def kinds(summary: dict, section: str) -> list[str]:
    return [f["kind"] for f in summary["findings"][section]]


# --- step time -----------------------------------------------------------------------------------
def test_balanced_is_compute_bound_info():
    s = build_summary(run_of([rank(0, steps()), rank(1, steps())]))
    p = s["primary_diagnosis"]
    assert (p["kind"], p["severity"], p["impact_ms"]) == ("COMPUTE_BOUND", "info", None)
    assert s["analysis"]["window"] == {
        "first_step": 5,
        "last_step": 39,
        "steps": 35,
        "warmup_steps_skipped": 5,
        "ranks": [0, 1],
        "ranks_without_steps": [],
    }
    assert s["ranks"][0]["phase_median_ms"]["forward"] == 10.0
    assert s["ranks"][0]["phase_share_pct"]["backward"] == pytest.approx(100 * 20 / 33.5, abs=0.1)


def test_one_slow_rank_of_four_is_a_straggler_not_input_bound():
    ranks = [rank(r, steps(input_wait=30_000 if r == 2 else 1000)) for r in range(4)]
    s = build_summary(run_of(ranks))
    p = s["primary_diagnosis"]
    assert p["kind"] == "INPUT_STRAGGLER"
    assert p["ranks"] == [2]
    assert p["evidence"]["typical_rank"] == 0
    assert p["evidence"]["gap_ms"] == 29.0
    assert "INPUT_BOUND" not in kinds(s, "step_time")


def test_input_bound_and_straggler_rank_by_impact():
    # every rank waits 20 ms for input, rank 1 computes 12 ms more: input costs more
    ranks = [
        rank(r, steps(input_wait=20_000, forward=22_000 if r == 1 else 10_000)) for r in range(2)
    ]
    s = build_summary(run_of(ranks))
    assert s["primary_diagnosis"]["kind"] == "INPUT_BOUND"
    assert s["primary_diagnosis"]["impact_ms"] == 20.0
    assert kinds(s, "step_time") == ["COMPUTE_STRAGGLER"]
    assert s["findings"]["step_time"][0]["impact_ms"] == 12.0


def test_node_straggler_names_the_node():
    ranks = [rank(r, steps(input_wait=25_000 if r >= 2 else 1000), node=r // 2) for r in range(4)]
    s = build_summary(run_of(ranks))
    p = s["primary_diagnosis"]
    assert p["kind"] == "NODE_STRAGGLER"
    assert (p["nodes"], p["ranks"]) == ([1], [2, 3])
    assert p["evidence"]["part"] == "input_wait"
    assert (p["evidence"]["typical_node"], p["evidence"]["gap_ms"]) == (0, 24.0)


def test_single_slow_rank_on_a_node_is_a_rank_straggler():
    ranks = [rank(r, steps(forward=30_000 if r == 3 else 10_000), node=r // 2) for r in range(4)]
    p = build_summary(run_of(ranks))["primary_diagnosis"]
    assert (p["kind"], p["ranks"], p["nodes"]) == ("COMPUTE_STRAGGLER", [3], [1])


def test_residual_straggler_is_generic_straggler():
    ranks = [rank(r, steps(residual=15_000 if r == 0 else 500)) for r in range(3)]
    p = build_summary(run_of(ranks))["primary_diagnosis"]
    assert (p["kind"], p["ranks"], p["evidence"]["part"]) == ("STRAGGLER", [0], "residual")
    assert p["evidence"]["gap_ms"] == 14.5


def test_residual_heavy():
    p = build_summary(run_of([rank(r, steps(residual=30_000)) for r in range(2)]))[
        "primary_diagnosis"
    ]
    # 30 of 63.5 ms: 47 % of the step, above CRITICAL_PCT
    assert (p["kind"], p["severity"]) == ("RESIDUAL_HEAVY", "critical")
    assert p["evidence"]["typical_ms"] == 30.0


def test_gpu_clock_and_h2d_bound():
    s = build_summary(run_of([rank(r, steps(h2d=12_000, gpu=True)) for r in range(2)]))
    assert s["analysis"]["clock"]["name"] == "gpu"
    p = s["primary_diagnosis"]
    assert p["kind"] == "H2D_BOUND"
    assert p["evidence"]["typical_ms"] == 12.0
    # forward on the GPU clock (10 ms), not the 0.05 ms of kernel launches
    assert s["ranks"][0]["phase_median_ms"]["forward"] == 10.0


def test_h2d_straggler():
    ranks = [rank(r, steps(h2d=15_000 if r == 1 else 1000, gpu=True)) for r in range(2)]
    p = build_summary(run_of(ranks))["primary_diagnosis"]
    assert (p["kind"], p["ranks"], p["evidence"]["gap_ms"]) == ("H2D_STRAGGLER", [1], 14.0)


def test_gpu_clock_measures_parts_over_the_gpu_timed_steps():
    # one step in 10 is GPU-timed; the host-clock forward of the others must not count
    r = [step(i, gpu=i % 10 == 0, forward=10_000 if i % 10 == 0 else 90_000) for i in range(60)]
    s = build_summary(run_of([rank(0, r), rank(1, r)]))
    clock = s["analysis"]["clock"]
    assert (clock["name"], clock["steps"]) == ("gpu", 5)  # steps 10-50 of window 5-59
    assert s["ranks"][0]["phase_median_ms"]["forward"] == 10.0
    assert s["ranks"][0]["step_time_ms"]["median"] == 113.5  # step time: every window step


def test_too_few_common_gpu_timed_steps_fall_back_to_cpu_clock():
    r0 = [step(i, gpu=i % 10 == 0) for i in range(40)]
    r1 = [step(i, gpu=i % 10 == 0 and i != 30) for i in range(40)]  # step 30 never resolved
    clock = build_summary(run_of([rank(0, r0), rank(1, r1)]))["analysis"]["clock"]
    assert clock["name"] == "cpu" and clock["steps"] == 35
    assert clock["reason"].startswith("only 2 GPU-timed steps in the window")


def test_gpu_timed_steps_without_phase_events_fall_back_to_cpu_clock():
    r1 = steps(gpu=True)
    for s in r1:
        s["gpu_backward_us"] = None
    clock = build_summary(run_of([rank(0, steps(gpu=True)), rank(1, r1)]))["analysis"]["clock"]
    assert clock["name"] == "cpu"
    assert clock["reason"].startswith("GPU-timed steps of ranks [1] lack")


# --- insufficient data ---------------------------------------------------------------------------
def test_zero_code_run_says_how_to_add_steps():
    s = build_summary(run_of([rank(0, [], finish=False), rank(1, [], finish=False)]))
    p = s["primary_diagnosis"]
    assert p["kind"] == "INSUFFICIENT_DATA"
    assert p["evidence"]["missing"] == ["steps"]
    assert "traceml.init()" in p["action"] and "trace_step" in p["action"]
    assert all(r["step_time_ms"] is None for r in s["ranks"])
    assert s["ranks"][0]["phase_median_ms"]["input_wait"] is None


def test_too_few_steps():
    p = build_summary(run_of([rank(0, steps(8)), rank(1, steps(8))]))["primary_diagnosis"]
    assert p["kind"] == "INSUFFICIENT_DATA"
    assert p["evidence"]["window_steps"] == 8
    assert p["evidence"]["min_window_steps"] == thresholds.MIN_WINDOW_STEPS


def test_missing_forward_is_named():
    s = build_summary(run_of([rank(0, steps(forward=None)), rank(1, steps())]))
    p = s["primary_diagnosis"]
    assert p["kind"] == "INSUFFICIENT_DATA"
    assert p["evidence"]["missing"] == ["forward"]
    assert p["evidence"]["ranks_lacking"] == {"forward": [0]}
    assert p["ranks"] == [0]


# --- memory --------------------------------------------------------------------------------------
def _warmup_then(level_fn, n=120, every=5):
    """24 memory readings (one per `every` steps): the allocator warms up to 2 GiB over the
    first 3, then level_fn(k) is added to reading k."""
    out = []
    for i in range(n):
        alloc = None
        if i % every == 0:
            k = i // every
            alloc = int(min(k, 3) / 3 * 2048 * MIB) + level_fn(k)
        out.append(step(i, alloc=alloc))
    return out


def test_allocator_warmup_plateau_is_not_creep():
    t = memory.trend(memory.readings(rank(0, _warmup_then(lambda k: 0))))
    assert (t.name, t.growth_bytes, t.readings) == (memory.PLATEAU, 0, 18)  # 6 of 24 = warm-up


def test_memory_creep_after_warmup():
    s = build_summary(run_of([rank(0, _warmup_then(lambda k: k * 40 * MIB))]))
    assert kinds(s, "memory") == ["MEMORY_CREEP"]
    trend = s["ranks"][0]["memory"]["trend"]
    assert trend["name"] == "creep"
    # thirds after warm-up: readings 6-11 and 18-23, medians 8.5 and 20.5 -> 12 readings apart
    assert trend["growth_bytes"] == 12 * 40 * MIB
    assert trend["bytes_per_1k_steps"] == round(1000 * 12 * 40 * MIB / 60)


def test_too_few_memory_readings_give_no_trend():
    assert memory.trend([(0, 1), (10, 2)]) is None


def test_memory_pressure_and_imbalance():
    gpus = {
        0: [
            {
                "unix_us": 1,
                "nvml_index": i,
                "uuid": f"GPU-{i}",
                "util_percent": 95.0,
                "memory_used_bytes": 1,
                "memory_total_bytes": 10 * 1024 * MIB,
                "temperature_c": 60.0,
                "power_w": 300.0,
                "unavailable_reason": None,
            }
            for i in range(2)
        ]
    }
    big = steps(alloc=9 * 1024 * MIB)  # reserved 9.25 GiB of 10: 92.5 %
    small = steps(alloc=4 * 1024 * MIB)
    s = build_summary(run_of([rank(0, big, uuid="GPU-0"), rank(1, small, uuid="GPU-1")], gpus=gpus))
    assert kinds(s, "memory") == ["MEMORY_PRESSURE", "MEMORY_IMBALANCE"]
    pressure, imbalance = s["findings"]["memory"]
    assert pressure["ranks"] == [0]
    assert s["ranks"][0]["memory"]["pressure_pct"] == 92.5
    assert (imbalance["evidence"]["highest_rank"], imbalance["evidence"]["lowest_rank"]) == (0, 1)
    assert imbalance["evidence"]["spread_pct"] == pytest.approx(55.6, abs=0.1)


def test_cpu_run_memory_is_null_with_reason():
    m = build_summary(run_of([rank(0, steps())]))["ranks"][0]["memory"]
    assert m["peak_allocated_bytes"] is None and m["trend"] is None
    assert "no CUDA memory readings" in m["unavailable_reason"]


# --- system --------------------------------------------------------------------------------------
def test_gpu_util_temperature_cpu_ram_findings():
    ts = range(1_000_000, 1_000_000 + 40 * 34_000, 100_000)
    system = {0: [system_sample(t, cpu=95.0, ram=0.95) for t in ts]}
    gpus = {
        0: [
            g
            for t in ts
            for g in (
                gpu_sample(t, 0, 30.0, temp=88.0),
                gpu_sample(t, 1, 70.0),
                gpu_sample(t, 2, 5.0),
            )
        ]
    }
    ranks = [rank(0, steps(), uuid="GPU-0-0"), rank(1, steps(), uuid="GPU-0-1")]  # GPU 2 unused
    s = build_summary(run_of(ranks, system=system, gpus=gpus))
    assert kinds(s, "system") == [
        "LOW_GPU_UTILIZATION",
        "MODERATE_GPU_UTILIZATION",
        "HIGH_GPU_TEMPERATURE",
        "HIGH_CPU",
        "HIGH_RAM",
    ]
    low, moderate = s["findings"]["system"][:2]
    assert (low["ranks"], moderate["ranks"]) == ([0], [1])
    node = s["nodes"][0]["system"]
    assert node["cpu_percent"]["median"] == 95.0
    assert node["ram_used_pct_max"] == 95.0
    assert [g["util_percent_median"] for g in node["gpus"]] == [30.0, 70.0, 5.0]


def test_mig_slice_has_null_utilisation_with_reason_and_no_finding():
    gpus = {0: [gpu_sample(t, 0, None, reason="MIG slice: no utilisation") for t in (1, 2, 3)]}
    s = build_summary(
        run_of([rank(0, steps(), uuid="GPU-0-0")], system={0: [system_sample(1)]}, gpus=gpus)
    )
    g = s["nodes"][0]["system"]["gpus"][0]
    assert g["util_percent_median"] is None
    assert g["unavailable_reason"] == "MIG slice: no utilisation"
    assert kinds(s, "system") == []


def test_cpu_host_without_nvml_reports_why():
    s = build_summary(
        run_of([rank(0, steps())], system={0: [system_sample(1, reason="NVML not found")]})
    )
    node = s["nodes"][0]["system"]
    assert node["gpus"] == [] and node["unavailable_reason"] == "NVML not found"


def test_system_figures_cover_the_window_span():
    # window steps 5..39 end at 1 s + (i+1) * 33.5 ms; samples outside it are left out
    system = {
        0: [
            system_sample(500_000, cpu=5.0),
            system_sample(1_400_000, cpu=80.0),
            system_sample(9_000_000, cpu=5.0),
        ]
    }
    s = build_summary(run_of([rank(0, steps())], system=system))
    assert s["nodes"][0]["system"]["samples"] == 1
    assert s["nodes"][0]["system"]["cpu_percent"]["median"] == 80.0


# --- health --------------------------------------------------------------------------------------
def test_crash_terminated_missing_and_node_failure_are_named():
    ranks = [
        rank(0, steps(), end="terminated", exit_code=None, finish=False),
        rank(1, steps(), end="signaled", exit_code=None, signal=9, finish=False),
        rank(2, steps(), finish=False),
    ]
    ranks[2].end = None
    exits = {0: {"exit_code": 1, "hostname": "host0", "restart_count": 0}}
    s = build_summary(run_of(ranks, missing=[2], exits=exits))
    assert kinds(s, "health") == ["RANK_CRASHED", "RANK_TERMINATED", "RANK_MISSING", "NODE_FAILED"]
    crashed = s["findings"]["health"][0]
    assert crashed["ranks"] == [1] and "signal 9" in crashed["summary"]
    assert s["findings"]["health"][2]["ranks"] == [2]
    assert s["run"]["missing_ranks"] == [2] and s["run"]["complete"] is False
    assert [r["end"]["state"] for r in s["ranks"]] == ["terminated", "signaled", "running"]


def _loss(node, lost_s, resumed_s=None) -> LostNode:
    return LostNode(
        node_rank=node,
        hostname=f"host{node}",
        last_heard_unix_s=lost_s - 25.5,
        lost_unix_s=lost_s,
        resumed_unix_s=resumed_s,
        lost_after_s=25.0,
    )


def test_a_node_lost_for_good_is_critical_and_its_missing_ranks_say_so():
    """Node 1 (rank 1) lost at 10:00:00 UTC and never back: NODE_LOST is critical, and the
    partial summary's RANK_MISSING names the loss; a node that came back is only told."""
    ranks = [rank(0, steps()), rank(1, steps(), node=1, finish=False)]
    ranks[1].end = None
    run = run_of(ranks, missing=[1])
    run.node_losses = [_loss(2, 36_000.0 - 60, 36_000.0 - 20), _loss(1, 36_000.0)]
    s = build_summary(run)
    health = {f["kind"]: f for f in s["findings"]["health"]}
    lost = health["NODE_LOST"]
    assert lost["severity"] == "critical" and lost["nodes"] == [1, 2]
    assert lost["summary"] == (
        "The aggregator lost node 2 (host2) at 09:59:00 UTC, back 40 s later; node 1 (host1) "
        "at 10:00:00 UTC: nothing came from the node's launcher for 25 s."
    )
    assert lost["action"].startswith("Node 1 never came back:")
    assert health["RANK_MISSING"]["summary"].endswith(
        " Node 1 was lost at 10:00:00 UTC: nothing came from its launcher for 25 s, and it "
        "never came back."
    )
    assert s["run"]["telemetry_health"]["node_losses"] == [n.to_json() for n in run.node_losses]


def test_a_node_lost_at_the_summary_before_the_bound_says_its_own_silence():
    """Node 2 lost by the 25 s bound, node 1 as the summary was written, 17.8 s after its
    session broke (its launcher killed as the run ended): each loss says its own silence."""
    run = run_of([rank(0, steps()), rank(1, steps(), node=1), rank(2, steps(), node=2)])
    early = dataclasses.replace(_loss(1, 36_000.0), lost_after_s=17.8)
    run.node_losses = [_loss(2, 36_000.0 - 60), early]
    (lost,) = [f for f in build_summary(run)["findings"]["health"] if f["kind"] == "NODE_LOST"]
    assert lost["summary"] == (
        "The aggregator lost node 2 (host2) at 09:59:00 UTC (25 s silent); node 1 (host1) at "
        "10:00:00 UTC (17.8 s silent): nothing came from the node's launcher for that long."
    )


def test_a_node_that_came_back_is_a_warning_and_names_no_rank():
    run = run_of([rank(0, steps()), rank(1, steps(), node=1)])
    run.node_losses = [_loss(1, 36_000.0, 36_012.0)]
    s = build_summary(run)
    assert kinds(s, "health") == ["NODE_LOST"]
    (lost,) = s["findings"]["health"]
    assert lost["severity"] == "warning" and lost["nodes"] == [1] and lost["ranks"] == []
    assert "back 12 s later" in lost["summary"]


def test_never_reported_and_dropped_telemetry():
    r0 = rank(0, steps())
    r0.finish = replace(r0.finish, steps_completed=45, records_dropped=3)
    r1 = RankData(rank=1)
    s = build_summary(run_of([r0, r1]))
    assert kinds(s, "health") == ["RANK_NEVER_REPORTED", "RANK_WITHOUT_STEPS", "TELEMETRY_DROPPED"]
    assert s["findings"]["health"][2]["evidence"]["0"] == {
        "steps_completed": 45,
        "records_received": 40,
        "records_dropped": 3,
    }


def test_restarted_run_analyses_the_latest_attempt():
    r0 = rank(0, steps(), restart=1, earlier_attempts={0: 12})
    s = build_summary(run_of([r0]))
    assert s["run"]["attempt"] == 1
    assert s["ranks"][0]["earlier_attempts"] == {"0": 12}
    restarted = [f for f in s["findings"]["health"] if f["kind"] == "RESTARTED"]
    assert restarted[0]["evidence"]["earlier_attempt_steps"] == {"0": {"0": 12}}


def test_live_summary_marks_unfinished_ranks_running():
    r1 = rank(1, steps(), finish=False)
    r1.end = None
    s = build_summary(run_of([rank(0, steps()), r1]), live=True)
    assert s["live"] is True and s["run"]["complete"] is False
    assert s["ranks"][1]["end"]["state"] == "running"
    assert "RANK_NEVER_REPORTED" not in kinds(s, "health")


# --- helpers and docs ----------------------------------------------------------------------------
def test_lower_median_and_bucketing():
    assert lower_median([3.0, 1.0]) == 1.0
    assert lower_median([None, 5.0, 1.0, 3.0]) == 3.0
    assert lower_median([None]) is None
    xs, ys = bucket_medians(list(range(10)), [float(i) for i in range(10)], 4)
    assert (xs, ys) == ([0, 3, 6, 9], [1.0, 4.0, 7.0, 9.0])


def test_every_kind_and_threshold_is_documented():
    text = DOCS.read_text()
    documented = set(re.findall(r"`([A-Z][A-Z0-9_]+)`", text))
    for section, names in KINDS.items():
        assert set(names) <= documented, (section, set(names) - documented)
    assert set(thresholds.as_dict()) <= documented
    for name in thresholds.as_dict():
        assert f"| `{name}` |" in text, name


def test_step_time_alone_names_no_straggler_under_ddp():
    """Under DDP the all-reduce ends every step together; a rank's step time can still
    differ by when it leaves the collective, which is noise, not a straggler."""
    from traceml.analysis.phases import Profile
    from traceml.analysis.step_time import _stragglers

    def prof(rank, step_ms):
        parts = {
            "input_wait": 1.0,
            "h2d": None,
            "forward": 2.0,
            "backward": 3.0,
            "optimizer": 1.0,
            "residual": 0.5,
        }
        return Profile(rank, 40, {"median": step_ms}, parts, {}, 3.0)

    profiles = {0: prof(0, 7.5), 1: prof(1, 10.0)}
    node_of = {0: 0, 1: 0}
    assert [f.kind for f in _stragglers(profiles, node_of, 7.5, synchronized=False)] == [
        "STRAGGLER"
    ]
    assert _stragglers(profiles, node_of, 7.5, synchronized=True) == []


# --- communication -------------------------------------------------------------------------------
def test_a_step_held_by_the_collectives_transfer_is_comm_bound():
    # both ranks spend 12 ms a step in the all-reduce itself; rank 0 arrives 3 ms early
    ranks = [rank(r, steps(backward=5_000, comm=15_000 if r == 0 else 12_000)) for r in range(2)]
    s = build_summary(run_of(ranks))
    assert s["analysis"]["comm"] == {
        "statistic": "median_per_step",
        "steps": 35,
        "transfer_ms": 12.0,
        "comm_ms": {"0": 15.0, "1": 12.0},
        "wait_ms": {"0": 3.0, "1": 0.0},
    }
    p = s["primary_diagnosis"]
    assert (p["kind"], p["ranks"], p["impact_ms"]) == ("COMM_BOUND", [0, 1], 12.0)
    # the typical step: 1 + 10 + 5 + 2 + 0.5 + 12 ms (the lower median across the ranks)
    assert p["evidence"]["transfer_share_pct"] == round(100 * 12 / 30.5, 1)
    assert p["evidence"]["per_rank_wait_ms"] == {"0": 3.0, "1": 0.0}
    check_consistent(p, "comm_bound")
    assert "COMPUTE_BOUND" not in kinds(s, "step_time")


def test_waiting_for_a_straggler_in_the_all_reduce_is_waiting_not_transfer():
    # rank 1 computes 25 ms more; rank 0 waits for it inside the all-reduce
    ranks = [
        rank(r, steps(forward=35_000 if r else 10_000, comm=1_000 if r else 26_000))
        for r in range(2)
    ]
    s = build_summary(run_of(ranks))
    assert s["analysis"]["comm"]["transfer_ms"] == 1.0
    assert s["analysis"]["comm"]["wait_ms"] == {"0": 25.0, "1": 0.0}
    p = s["primary_diagnosis"]
    assert (p["kind"], p["ranks"]) == ("COMPUTE_STRAGGLER", [1])
    assert "COMM_BOUND" not in kinds(s, "step_time")


def test_comm_split_counts_only_the_steps_every_rank_measured():
    # rank 1's first 15 steps come before its first collective (no comm measured)
    late = steps(comm=4_000)
    for s_ in late[:15]:
        s_["comm_us"] = None
    s = build_summary(run_of([rank(0, steps(comm=9_000)), rank(1, late)]))
    # window steps 5-39: 25 of them (15-39) have comm on both ranks
    assert s["analysis"]["comm"]["steps"] == 25
    assert s["analysis"]["comm"]["wait_ms"] == {"0": 5.0, "1": 0.0}
    # 4 ms of transfer in a ~37 ms step: no COMM_BOUND
    assert "COMM_BOUND" not in [s["primary_diagnosis"]["kind"], *kinds(s, "step_time")]
    no_comm = build_summary(run_of([rank(0, steps()), rank(1, steps())]))
    assert no_comm["analysis"]["comm"] is None


def test_one_rank_held_by_its_collectives_is_comm_bound_with_no_peer_to_wait_for():
    s = build_summary(run_of([rank(0, steps(backward=3_000, comm=15_000))]))
    assert s["analysis"]["comm"]["wait_ms"] == {"0": 0.0}
    p = s["primary_diagnosis"]
    assert (p["kind"], p["ranks"], p["impact_ms"]) == ("COMM_BOUND", [0], 15.0)
    assert "peer" not in p["summary"]
    check_consistent(p, "one rank")
