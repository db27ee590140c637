"""Arrival skew (traceml/analysis/skew.py) and the clock offset it reads arrivals with
(traceml/core/clock.py), on hand-built runs and hand-made exchanges: exact values."""

from __future__ import annotations

from dataclasses import replace

import pytest
from consistency import check_consistent
from rundata_factory import identity, rank, run_of, steps

from traceml.analysis.summary import build_summary
from traceml.core import clock
from traceml.core.records import NodeClock
from traceml_aggregator.sessions import CLOCK_REFRESH_S, clock_news

#: Node 1's clock reads this much more than node 0's at the same instant, µs.
AHEAD_US = 250_000
#: Rank 2 enters each step's collective this much after the others, µs.
LATE_US = 30_000


def _run(late_rank=2, clocks=None, seq_of=None, nodes=(0, 0, 1, 1), **identity_kw):
    """4 ranks, ranks 2 and 3 on node 1 (its clock AHEAD_US ahead), 40 steps whose collective
    (the default group's, seq = step + 1 unless ``seq_of(rank, step)`` says otherwise) every
    rank enters 20 ms into the step, ``late_rank`` LATE_US later."""
    ranks = []
    for r, node in enumerate(nodes):
        rows = steps()
        for s in rows:
            i = s["step"]
            s["arrive_us"] = i * 33_500 + 20_000 + (LATE_US if r == late_rank else 0)
            s["arrive_group"] = 7
            s["arrive_seq"] = i + 1 if seq_of is None else seq_of(r, i)
        rd = rank(r, rows, node=node)
        kw = {k: v(r) for k, v in identity_kw.items()}
        rd.identity = identity(r, node=node, start_unix_us=1_000_000 + AHEAD_US * node, **kw)
        ranks.append(rd)
    run = run_of(ranks, exits={0: {}, 1: {}})
    run.node_clocks = list(clocks or [])
    return run


CLOCKS = [NodeClock(0, 0, 40, 1.0), NodeClock(1, -AHEAD_US, 100, 1.0)]


def test_the_late_rank_is_named_on_node_0s_clock():
    s = build_summary(_run(clocks=CLOCKS))
    assert s["analysis"]["skew"] == {
        "statistic": "median_per_step",
        "collectives": 35,
        "mismatched": 0,
        "last_pct": {"0": 0.0, "1": 0.0, "2": 100.0, "3": 0.0},
        "late_ms": {"2": 30.0},
        "wait_ms": {"0": 30.0, "1": 30.0, "2": 0.0, "3": 30.0},
        "clock_offsets_ms": {"0": 0.0, "1": -250.0},
        "clock_error_ms": 0.1,
        "ranks_without": [],
        "withheld": None,
    }
    (f,) = [f for f in s["findings"]["step_time"] if f["kind"] == "LATE_ARRIVAL"]
    assert f["ranks"] == [2] and f["severity"] == "critical"
    ev = f["evidence"]
    assert (ev["held_pct"], ev["last_pct"], ev["late_ms"]) == (100.0, 100.0, 30.0)
    assert (ev["others_wait_ms"], ev["floor_ms"]) == (30.0, 3.35)  # 10 % of the 33.5 ms step
    assert (ev["collectives"], ev["cost_steps"], ev["clock_error_ms"]) == (35, 35, 0.1)
    assert ev["gpu_hours"] == round(35 * 3 * LATE_US / 3.6e9, 6)
    assert f["impact_ms"] == 30.0
    assert f["summary"].startswith(
        "Rank 2 held up 100% of the 35 collectives compared (each step's last one), arriving "
        "last 30.0 ms after the others' median; the other 3 ranks waited 30.0 ms a step"
    )
    assert "within ±0.1 ms" in f["summary"]
    assert s["primary_diagnosis"]["kind"] != "LATE_ARRIVAL"
    check_consistent(f, "late_arrival")


def test_without_the_offsets_two_nodes_clocks_name_nobody():
    """Node 1's clock is 250 ms ahead: read as sent, both its ranks look 250 ms late. Without
    its offset the figures are given and clock_error_ms is null, and no finding is made."""
    s = build_summary(_run(clocks=[NodeClock(0, 0, 40, 1.0)]))
    skew = s["analysis"]["skew"]
    assert skew["clock_error_ms"] is None and skew["clock_offsets_ms"] == {"0": 0.0}
    # ranks 0, 1 at 0 ms, 3 at 250, 2 at 280: 280 - 0 (the others' median)
    assert skew["late_ms"] == {"2": 280.0}
    assert "LATE_ARRIVAL" not in [f["kind"] for f in s["findings"]["step_time"]]


def test_a_lateness_the_clocks_cannot_vouch_for_is_not_reported():
    loose = [NodeClock(0, 0, 40, 1.0), NodeClock(1, -AHEAD_US, 16_000, 1.0)]  # ±16 ms
    s = build_summary(_run(clocks=loose))
    assert s["analysis"]["skew"]["clock_error_ms"] == 16.0
    assert s["analysis"]["skew"]["late_ms"] == {"2": 30.0}
    assert "LATE_ARRIVAL" not in [f["kind"] for f in s["findings"]["step_time"]]


def test_one_node_needs_no_offset():
    s = build_summary(_run(nodes=(0, 0, 0, 0)))
    assert s["analysis"]["skew"]["clock_error_ms"] == 0.0
    assert s["analysis"]["skew"]["clock_offsets_ms"] == {}
    assert [f["ranks"] for f in s["findings"]["step_time"] if f["kind"] == "LATE_ARRIVAL"] == [[2]]


def test_only_the_same_collective_is_compared():
    """Rank 3 is at another collective on every odd step: those steps are not compared."""
    run = _run(clocks=CLOCKS, seq_of=lambda r, i: i + 1 + (100 if r == 3 and i % 2 else 0))
    skew = build_summary(run)["analysis"]["skew"]
    assert (skew["collectives"], skew["mismatched"]) == (17, 18)  # window steps 5-39


def test_a_step_without_a_collective_is_neither_compared_nor_mismatched():
    run = _run(clocks=CLOCKS)
    for rd in run.ranks.values():  # every third step waited in no collective
        for name in ("arrive_us", "arrive_group", "arrive_seq"):
            rd.steps.columns[name] = [
                None if i % 3 == 0 else v for i, v in enumerate(rd.steps.columns[name])
            ]
    skew = build_summary(run)["analysis"]["skew"]
    assert (skew["collectives"], skew["mismatched"]) == (23, 0)  # 35 window steps, 12 without


def test_late_for_half_the_run_is_held_up_for_that_half():
    """Rank 2 late from step 20 on; before, rank 1 arrives last every step by 0.5 ms (noise:
    under the floor). Rank 1 arrived last more often, rank 2 held up more collectives."""
    run = _run(clocks=CLOCKS)

    def shift(r, steps, us):
        column = list(run.ranks[r].steps.columns["arrive_us"])
        for i in steps:
            column[i] += us
        run.ranks[r].steps.columns["arrive_us"] = column

    shift(2, range(20), -LATE_US)
    shift(1, range(20), 500)
    s = build_summary(run)
    assert s["analysis"]["skew"]["last_pct"] == {"0": 0.0, "1": 42.9, "2": 57.1, "3": 0.0}
    (f,) = [f for f in s["findings"]["step_time"] if f["kind"] == "LATE_ARRIVAL"]
    ev = f["evidence"]
    assert (f["ranks"], ev["held_pct"], ev["late_ms"], ev["cost_steps"]) == ([2], 57.1, 30.0, 20)
    check_consistent(f, "late_half")
    shift(2, range(20, 33), -LATE_US)  # held up 7 of 35: no finding
    assert "LATE_ARRIVAL" not in [f["kind"] for f in build_summary(run)["findings"]["step_time"]]


def _late(summary: dict) -> list[dict]:
    return [f for f in summary["findings"]["step_time"] if f["kind"] == "LATE_ARRIVAL"]


def test_two_hosts_under_one_node_rank_have_unknown_clocks():
    """srun without torchrun: every rank says node 0; ranks 2 and 3 are on another host whose
    clock is 250 ms ahead. Read as one node, rank 2 would be 280 ms late."""
    run = _run(nodes=(0, 0, 0, 0), hostname=lambda r: f"h{r // 2}")
    for r in (2, 3):
        run.ranks[r].identity = replace(run.ranks[r].identity, start_unix_us=1_000_000 + AHEAD_US)
    s = build_summary(run)
    assert s["analysis"]["skew"]["clock_error_ms"] is None
    assert s["analysis"]["skew"]["withheld"].startswith("ranks of one node rank on different hosts")
    assert _late(s) == []


def test_on_nccl_the_figures_are_given_and_the_finding_withheld():
    s = build_summary(_run(clocks=CLOCKS, backend=lambda r: "nccl"))
    assert s["analysis"]["skew"]["late_ms"] == {"2": 30.0}
    assert s["analysis"]["skew"]["withheld"].startswith("NCCL: an arrival is when the host")
    assert _late(s) == []


def test_two_ranks_late_by_turns_name_neither():
    """Rank 2 late on even steps, rank 3 on odd ones: each holds up about half."""
    run = _run(clocks=CLOCKS)
    column = list(run.ranks[3].steps.columns["arrive_us"])
    for i in range(1, 40, 2):
        column[i] += 2 * LATE_US
    run.ranks[3].steps.columns["arrive_us"] = column
    s = build_summary(run)
    assert s["analysis"]["skew"]["last_pct"] == {"0": 0.0, "1": 0.0, "2": 48.6, "3": 51.4}
    assert _late(s) == []


def test_a_rank_without_arrivals_is_left_out_and_named():
    run = _run(clocks=CLOCKS)
    run.ranks[1].steps.columns["arrive_us"] = [None] * 40
    skew = build_summary(run)["analysis"]["skew"]
    assert (skew["ranks_without"], skew["collectives"]) == ([1], 35)
    assert sorted(skew["last_pct"]) == ["0", "2", "3"]


def test_a_balanced_run_has_no_late_rank():
    s = build_summary(_run(late_rank=None, clocks=CLOCKS))
    assert s["analysis"]["skew"]["late_ms"] == {"0": 0.0}  # a tie: the first rank counts
    assert "LATE_ARRIVAL" not in [f["kind"] for f in s["findings"]["step_time"]]


def test_without_arrivals_there_is_no_skew():
    assert build_summary(run_of([rank(r, steps()) for r in range(2)]))["analysis"]["skew"] is None


# --- the clock exchange ------------------------------------------------------------------------
def test_an_exchange_bounds_the_true_offset():
    """Node 0 is 5 ms ahead; 0.3 ms up, 0.05 ms in the aggregator, 0.7 ms down (ns)."""
    theta, t0 = 5_000_000, 10_000_000
    t1 = t0 + theta + 300_000
    t2 = t1 + 50_000
    t3 = t2 - theta + 700_000
    est = clock.exchange(t0, t1, t2, t3)
    assert est == clock.Offset(offset_us=4_800, error_us=500)
    assert abs(theta // 1000 - est.offset_us) <= est.error_us
    with pytest.raises(ValueError, match="not an exchange"):
        clock.exchange(t0, t1, t2, t0 - 1)


def test_an_answer_held_longer_than_its_round_trip_is_no_exchange():
    """Node 0 held it 3 ms of a 1 ms round trip (a clock stepped, or a forged answer): the
    bound would be negative."""
    with pytest.raises(ValueError, match="not an exchange"):
        clock.exchange(0, 10_000_000, 13_000_000, 1_000_000)


def test_the_estimator_keeps_the_tightest_of_the_latest_exchanges():
    est = clock.OffsetEstimator()
    assert est.best() is None
    t0 = est.sent()
    assert est.add(t0, t0 + 1_000_000, t0 + 1_000_000, t0 + 2_000_000)  # ±1000 µs
    assert not est.add(t0, t0 + 1_000_000, t0 + 1_000_000, t0 + 2_000_000)  # answered already
    assert not est.add(t0 - 5, t0, t0, t0)  # the answer to no heartbeat sent
    t0 = est.sent()
    assert est.add(t0, t0 + 500_000, t0 + 500_000, t0 + 200_000)  # ±100 µs: better
    t0 = est.sent()
    assert not est.add(t0, t0 + 1, t0, t0)  # answered before read: ignored
    assert est.best() == clock.Offset(offset_us=400, error_us=100)
    for _ in range(clock.SAMPLES_KEPT):  # the tight one ages out
        t0 = est.sent()
        est.add(t0, t0 + 3_000_000, t0 + 3_000_000, t0 + 4_000_000)
    assert est.best() == clock.Offset(offset_us=1_000, error_us=2_000)


def test_the_aggregator_stores_an_estimate_only_when_it_is_news():
    stored = NodeClock(1, 1_000, 100, 1.0).to_json()
    same = NodeClock(1, 1_050, 90, 2.0).to_json()
    tighter = NodeClock(1, 1_010, 40, 2.0).to_json()
    moved = NodeClock(1, 1_300, 100, 2.0).to_json()
    later = NodeClock(1, 1_050, 90, 1.0 + CLOCK_REFRESH_S).to_json()  # renewed (drift)
    assert clock_news(None, stored)
    assert [clock_news(stored, e) for e in (same, tighter, moved, later)] == [
        False,
        True,
        True,
        True,
    ]
