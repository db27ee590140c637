"""Finalization waits (briefly, within the budget) for every node launcher's exit report.

A real aggregator over gRPC, driven the way launchers and ranks drive it: two ranks on two
nodes send their finish markers, node 0 reports its torchrun's exit and asks to finalize. Node
1's report, which carries its ranks' exit codes, may come a moment later (its torchrun exits
after its last rank): the summary must include it, without waiting for a report that never
comes longer than the budget, and without waiting at all for ranks run without a launcher.
"""

from __future__ import annotations

import threading
import time

import pytest
from conftest import load_summary
from helpers import batches
from helpers.aggregator import LiveAggregator

from traceml import wire
from traceml.core.endpoint import call as rpc
from traceml.core.transport import open_channel

pytestmark = [pytest.mark.aggregator, pytest.mark.serial]

RUN = "nodes-report"
COMPLETED = wire.EndState.END_STATE_COMPLETED


def finish_ranks(target: str, world_size: int) -> None:
    """Every rank (rank r on node r) introduces itself and finishes in one batch."""
    with open_channel(target) as channel:
        stub = wire.AggregatorStub(channel)
        for rank in range(world_size):
            batch = wire.Batch(run_name=RUN, rank=rank, seq=1)
            batch.identity.CopyFrom(
                wire.RankIdentity(run_name=RUN, rank=rank, node_rank=rank, world_size=world_size)
            )
            batch.finish.CopyFrom(wire.RankFinish(last_seq=1, end_state=COMPLETED))
            assert stub.Push(batch, timeout=10).stored_seq == 1


def report_node_exit(target: str, report: wire.NodeExit) -> None:
    rpc(target, "ReportNodeExit", report, 10.0)


def node_exit(node_rank: int, code: int) -> wire.NodeExit:
    """Node ``node_rank``'s exit report, with its one rank (rank ``node_rank``) completed."""
    return batches.node_exit(
        [batches.rank_end(node_rank, "completed", code, 0)],
        exit_code=code,
        node_rank=node_rank,
        run_name=RUN,
        hostname="h",
    )


def timed_finalize(target: str, budget_s: float) -> tuple[list, threading.Thread]:
    """Start Finalize in a thread; ``result`` gets (reply, seconds it took)."""
    result: list = []

    def call() -> None:
        start = time.monotonic()
        reply = rpc(
            target,
            "Finalize",
            wire.FinalizeRequest(run_name=RUN, timeout_s=budget_s),
            budget_s + 30,
        )
        result.append((reply, time.monotonic() - start))

    thread = threading.Thread(target=call)
    thread.start()
    return result, thread


def node1_missing(
    tmp_path, budget_s: float, *extra: str
) -> tuple[LiveAggregator, list, threading.Thread]:
    """An aggregator of two nodes (rank r on node r) with ``extra`` flags: every rank finished,
    node 0 reported its exit, node 1 did not; a Finalize of ``budget_s`` is under way
    (:func:`timed_finalize`). The caller stops the aggregator."""
    agg = LiveAggregator(
        tmp_path / RUN, RUN, world_size=2, extra_args=("--nnodes", "2", *extra)
    ).start()
    try:
        finish_ranks(agg.target, 2)
        report_node_exit(agg.target, node_exit(0, 0))
        return (agg, *timed_finalize(agg.target, budget_s))
    except BaseException:
        agg.stop()
        raise


def test_waits_for_a_late_node_report(tmp_path):
    agg, result, thread = node1_missing(tmp_path, 60)
    try:
        time.sleep(2.0)
        assert thread.is_alive()  # every rank finished, but node 1 has not reported yet
        report_node_exit(agg.target, node_exit(1, 0))
        thread.join(30)
        (reply, took) = result[0]
    finally:
        agg.stop()
    assert reply.complete and not reply.error
    assert 2.0 <= took < 8.0
    summary = load_summary(tmp_path / RUN)
    assert {n["node_rank"]: n["exit_code"] for n in summary["nodes"]} == {0: 0, 1: 0}


def test_a_node_that_never_reports_costs_at_most_the_budget(tmp_path):
    agg, result, thread = node1_missing(tmp_path, 3, "--finalize-timeout-sec", "3")
    try:
        thread.join(30)
        (reply, took) = result[0]
    finally:
        agg.stop()
    assert reply.complete and not reply.error  # every rank finished: nothing is missing
    assert 3.0 <= took < 6.0
    summary = load_summary(tmp_path / RUN)
    assert {n["node_rank"]: n["exit_code"] for n in summary["nodes"]} == {0: 0, 1: None}


def test_ranks_without_launchers_are_not_waited_for(tmp_path):
    """A standalone aggregator (no --nnodes: ranks under plain torchrun) expects no reports."""
    agg = LiveAggregator(tmp_path / RUN, RUN, world_size=2).start()
    try:
        finish_ranks(agg.target, 2)
        result, thread = timed_finalize(agg.target, 60)
        thread.join(30)
        (reply, took) = result[0]
    finally:
        agg.stop()
    assert reply.complete and not reply.error
    assert took < 2.0


def test_a_node_whose_torchrun_never_started_its_ranks_ends_the_wait_for_unclaimed_nodes(
    tmp_path,
):
    """Node 0's torchrun failed before it started its rank (its rendezvous); node 1's
    launcher never claimed a place. The static rendezvous can no longer complete, so node 1
    will never report: finalization does not wait its budget for it, and its rank is never
    reported, not missing."""
    agg = LiveAggregator(tmp_path / RUN, RUN, world_size=2, extra_args=("--nnodes", "2")).start()
    try:
        report = node_exit(0, 1)
        report.ranks[0].end_state = wire.EndState.END_STATE_NOT_STARTED
        report.ranks[0].reason = "torchrun failed: DistNetworkError: address already in use"
        report_node_exit(agg.target, report)
        result, thread = timed_finalize(agg.target, 60)
        thread.join(30)
        (reply, took) = result[0]
    finally:
        agg.stop()
    assert reply.complete and not reply.error and list(reply.missing_ranks) == []
    assert took < 5.0  # not the 60 s budget
    summary = load_summary(tmp_path / RUN)
    ends = [(r["rank"], r["end"]["state"]) for r in summary["ranks"]]
    assert ends == [(0, "not_started"), (1, "never_reported")]
