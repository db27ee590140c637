"""The aggregator's hang watch on the aggregator's clock: who stalled, where, and the suspect."""

from __future__ import annotations

from traceml import wire
from traceml.analysis.hang import describe
from traceml_aggregator.hang import ALIVE_WINDOW_S, HangWatch


def progress(rank: int, steps: int, phase: str) -> wire.Batch:
    batch = wire.Batch(run_name="r", rank=rank, seq=1)
    batch.progress.steps_completed = steps
    batch.progress.phase = phase
    return batch


def sampled(rank: int) -> wire.Batch:
    """A node sampler's batch with a process sample of ``rank``."""
    batch = wire.Batch(run_name="r", node_rank=0, seq=1)
    batch.process_samples.add(unix_us=1, rank=rank)
    return batch


def watch(done=()) -> HangWatch:
    return HangWatch(10.0, lambda r: r in done, "/nonexistent/stall.json")


def where(record: dict) -> dict:
    return {e["rank"]: (e["steps_completed"], e["phase"], e["silent_s"], e["alive"])
            for e in record["ranks"]}


def test_the_rank_still_in_forward_is_the_suspect_of_ranks_waiting_in_backward():
    w = watch()
    for r in range(4):
        w.on_batch(progress(r, 7, "step"), now=100.0)
    for r in (0, 1, 3):
        w.on_batch(progress(r, 7, "backward"), now=101.0)
    w.on_batch(progress(2, 7, "forward"), now=101.0)
    assert w.check(now=109.9) is None  # not yet the timeout
    record = w.check(now=112.0)
    assert where(record) == {r: (7, "forward" if r == 2 else "backward", 12.0, True)
                             for r in range(4)}
    assert record["suspects"] == [2] and record["detected_unix_s"] == 112.0
    assert describe(record) == (
        "hang: ranks 0, 1, 2, 3 made no progress for 12 s (rank 0: 7 steps done, in backward; "
        "rank 1: 7 steps done, in backward; rank 2: 7 steps done, in forward; rank 3: 7 steps "
        "done, in backward); suspect: rank 2"
    )


def test_a_dead_rank_among_live_ones_is_the_suspect_and_fewer_steps_is_behind():
    w = watch()
    w.on_batch(progress(0, 5, "backward"), now=0.0)
    w.on_batch(progress(1, 5, "backward"), now=0.0)
    w.on_batch(progress(2, 4, "optimizer"), now=0.0)
    w.on_batch(progress(0, 5, "backward"), now=ALIVE_WINDOW_S + 5)  # heartbeats: alive
    w.on_batch(sampled(2), now=ALIVE_WINDOW_S + 5)  # its node's sampler still sees rank 2
    record = w.check(now=ALIVE_WINDOW_S + 6)
    assert {r: e[3] for r, e in where(record).items()} == {0: True, 1: False, 2: True}
    assert record["suspects"] == [1]
    w.on_batch(progress(1, 5, "backward"), now=ALIVE_WINDOW_S + 6.5)
    assert w.check(now=ALIVE_WINDOW_S + 7)["suspects"] == [2]  # 4 steps: behind the others


def test_all_at_one_place_has_no_suspect_unless_others_finished():
    w = watch()
    for r in (0, 1):
        w.on_batch(progress(r, 3, "backward"), now=0.0)
    assert w.check(now=20.0)["suspects"] == []
    done = {0}
    w2 = HangWatch(10.0, lambda r: r in done, "/nonexistent/stall.json")
    w2.on_batch(progress(0, 6, "idle"), now=0.0)
    w2.on_batch(progress(1, 6, "idle"), now=0.0)
    record = w2.check(now=20.0)
    assert [e["rank"] for e in record["ranks"]] == [1] and record["suspects"] == [1]


def test_set_up_before_the_first_step_is_never_a_hang_and_progress_ends_a_stall():
    w = watch()
    w.on_batch(progress(0, 0, "idle"), now=0.0)
    assert w.check(now=1000.0) is None
    w.on_batch(progress(0, 1, "idle"), now=1000.0)
    assert w.check(now=1011.0) is not None
    w.on_batch(progress(0, 2, "step"), now=1012.0)
    assert w.check(now=1013.0) is None


def test_a_stall_whose_ranks_ended_is_kept_as_it_was():
    done: set[int] = set()
    w = HangWatch(10.0, lambda r: r in done, "/nonexistent/stall.json")
    w.on_batch(progress(0, 2, "forward"), now=0.0)
    first = w.check(now=15.0)
    assert where(w.check(now=30.0))[0][2] == 30.0  # refreshed while it lasts
    done.add(0)  # the user stopped the job
    assert w.check(now=500.0) == {**first, "ranks": [{**first["ranks"][0], "silent_s": 30.0}]}
