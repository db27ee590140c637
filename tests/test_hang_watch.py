"""The aggregator's hang watch on the aggregator's clock: who stalled, where, and the suspect;
and a rank that waits for another is never the culprit (the hang's suspect or a straggler)."""

from __future__ import annotations

import asyncio
import json

from helpers.batches import node_batch, rank_batch

from traceml import wire
from traceml.analysis import step_time
from traceml.analysis.document import PARTS
from traceml.analysis.hang import describe, silent_s
from traceml.analysis.phases import Profile
from traceml.core.records import HangRecord, HungRank
from traceml_aggregator.finalize import RunState
from traceml_aggregator.hang import ALIVE_WINDOW_S, HangWatch


def progress(rank: int, steps: int, phase: str) -> wire.Batch:
    return rank_batch(1, rank=rank, progress=wire.Progress(steps_completed=steps, phase=phase))


def sampled(rank: int) -> wire.Batch:
    """A node sampler's batch with a process sample of ``rank``."""
    batch = node_batch(1)
    batch.process_samples.add(unix_us=1, rank=rank)
    return batch


def watch(done=()) -> HangWatch:
    return HangWatch(10.0, lambda r, attempt: r in done, "/nonexistent/stall.json")


def where(record: dict) -> dict:
    return {
        e["rank"]: (e["steps_completed"], e["phase"], e["silent_s"], e["alive"])
        for e in record["ranks"]
    }


def test_the_rank_still_in_forward_is_the_suspect_of_ranks_waiting_in_backward():
    w = watch()
    for r in range(4):
        w.on_batch(progress(r, 7, "step"), now=100.0)
    for r in (0, 1, 3):
        w.on_batch(progress(r, 7, "backward"), now=101.0)
    w.on_batch(progress(2, 7, "forward"), now=101.0)
    assert w.check(now=109.9) is None  # not yet the timeout
    record = w.check(now=112.0)
    assert where(record) == {
        r: (7, "forward" if r == 2 else "backward", 12.0, True) for r in range(4)
    }
    assert record["suspects"] == [2] and record["detected_unix_s"] == 112.0
    assert describe(HangRecord.from_json(record)) == (
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
    alive = watch()
    for r, (steps, phase) in enumerate(((5, "backward"), (5, "backward"), (4, "optimizer"))):
        alive.on_batch(progress(r, steps, phase), now=0.0)
    assert alive.check(now=11.0)["suspects"] == [2]  # 4 steps: behind the others


def test_all_at_one_place_has_no_suspect_unless_others_finished():
    w = watch()
    for r in (0, 1):
        w.on_batch(progress(r, 3, "backward"), now=0.0)
    assert w.check(now=20.0)["suspects"] == []
    done = {0}
    w2 = HangWatch(10.0, lambda r, attempt: r in done, "/nonexistent/stall.json")
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


def test_a_stall_is_over_for_all_its_ranks_when_its_suspect_moves():
    """Rank 1 stopped (SIGSTOP), rank 0 waits for it in backward's all-reduce: both stalled,
    rank 1 the suspect. Rank 1 resumes and its batch comes first (rank 0's trails it by up to
    a flush interval): the stall is over, and rank 0, silent 27 s but waiting for rank 1 all
    along, is not named a new stall of its own; it is watched afresh, a whole timeout."""
    w = watch()
    w.on_batch(progress(0, 105, "backward"), now=100.0)
    w.on_batch(progress(1, 105, "forward"), now=100.0)
    record = w.check(now=110.0)
    assert sorted(where(record)) == [0, 1] and record["suspects"] == [1]
    w.on_batch(progress(1, 106, "step"), now=127.0)
    assert w.check(now=127.5) is None
    w.on_batch(progress(1, 110, "step"), now=137.0)
    assert w.check(now=137.4) is None  # rank 0 still unheard: less than a timeout since
    record = w.check(now=137.6)  # a whole timeout: it stalls now, on its own
    # Its record dates its silence from its real last step (100.0), not from the wait's end.
    assert where(record) == {0: (105, "backward", 37.6, False)} and record["suspects"] == [0]
    assert record["ranks"][0]["last_progress_unix_s"] == 100.0


def test_a_stall_is_rewritten_only_on_change_and_frozen_once_its_ranks_ended():
    done: set[int] = set()
    w = HangWatch(10.0, lambda r, attempt: r in done, "/nonexistent/stall.json")
    w.on_batch(progress(0, 2, "forward"), now=0.0)
    first = w.check(now=15.0)
    assert first["ended_unix_s"] is None and where(first)[0][2] == 15.0
    assert w.check(now=30.0) is first  # nothing changed: nothing to rewrite
    done.add(0)  # the user stopped the job
    frozen = w.check(now=40.0)
    assert frozen == {
        **first,
        "ended_unix_s": 40.0,
        "ranks": [{**first["ranks"][0], "silent_s": 40.0}],
    }
    assert w.check(now=500.0) is frozen
    assert silent_s(40.0, HungRank.from_json(frozen["ranks"][0]), 900.0) == 40.0
    assert silent_s(None, HungRank.from_json(first["ranks"][0]), 70.0) == 70.0


def test_the_suspect_is_chosen_when_the_stall_is_detected_not_on_who_dies_after():
    """Rank 2 stopped in forward; ranks 0, 1, 3 wait in backward. After the stall is found
    the user presses Ctrl-C: rank 0's samples stop first, then every rank ends. The suspect
    stays rank 2, and each rank's entry is the state it was found stalled in (alive)."""
    done: set[int] = set()
    w = HangWatch(10.0, lambda r, attempt: r in done, "/nonexistent/stall.json")
    for r in range(4):
        w.on_batch(progress(r, 7, "forward" if r == 2 else "backward"), now=0.0)
    for t in (5.0, 10.0):
        for r in range(4):
            w.on_batch(progress(r, 7, "forward" if r == 2 else "backward"), now=t)
    record = w.check(now=11.0)
    assert record["suspects"] == [2]
    for r in (1, 2, 3):
        w.on_batch(progress(r, 7, "forward" if r == 2 else "backward"), now=30.0)
    # rank 0 silent for longer than the alive window: dead now, yet no evidence against it
    assert w.check(now=10.0 + ALIVE_WINDOW_S + 5) is record
    done.update(range(4))
    final = w.check(now=60.0)
    assert final["suspects"] == [2] and final["detected_unix_s"] == 11.0
    assert {r: (e[1], e[3]) for r, e in where(final).items()} == {
        0: ("backward", True),
        1: ("backward", True),
        2: ("forward", True),
        3: ("backward", True),
    }
    assert describe(HangRecord.from_json(record)).endswith("suspect: rank 2")


def test_a_new_stall_waits_for_ranks_about_to_stall_before_naming_a_suspect():
    """Ranks 0 and 1 ended step 7 a little before rank 2, which then stopped in forward:
    the first check past the timeout sees only ranks 0 and 1 silent long enough. Naming them
    would blame ranks that wait; the record comes once rank 2 is in, naming rank 2."""
    w = watch()
    w.on_batch(progress(0, 7, "backward"), now=0.0)
    w.on_batch(progress(1, 7, "backward"), now=0.0)
    w.on_batch(progress(2, 7, "forward"), now=0.6)
    assert w.check(now=10.2) is None
    record = w.check(now=10.7)
    assert [e["rank"] for e in record["ranks"]] == [0, 1, 2] and record["suspects"] == [2]
    assert record["detected_unix_s"] == 10.7


def test_every_rank_at_one_place_names_no_suspect_and_says_so():
    w = watch()
    for r in range(3):
        w.on_batch(progress(r, 4, "step"), now=0.0)
    record = w.check(now=12.0)
    assert record["suspects"] == []
    assert describe(HangRecord.from_json(record)).endswith(
        "every stalled rank is at the same place, none differs: no suspect (a collective "
        "that cannot complete?)"
    )


def test_the_rank_outside_its_step_is_the_suspect_of_ranks_waiting_inside_theirs():
    """Rank 3 stopped before an explicit collective, between steps; ranks 0-2 wait in it,
    inside step 5 (outside the phases: "step")."""
    w = watch()
    for r in range(4):
        w.on_batch(progress(r, 5, "idle" if r == 3 else "step"), now=0.0)
    record = w.check(now=11.0)
    assert record["suspects"] == [3]


def finished(rank: int, restart: int) -> wire.Batch:
    batch = progress(rank, 3, "idle")
    batch.restart_count = restart
    batch.finish.steps_completed = 3
    return batch


def test_a_rank_of_a_later_attempt_is_watched_after_the_earlier_attempt_ended():
    """torchrun restarted the workers: attempt 0's finish markers do not end attempt 1."""
    state = RunState(world_size=2)
    w = HangWatch(10.0, state.is_done, "/nonexistent/stall.json")

    def stored(batch, now):
        state.on_batch(batch)
        w.on_batch(batch, now=now)

    for r in (0, 1):
        stored(finished(r, 0), now=0.0)
    assert state.missing() == [] and state.first_end.is_set()
    for r in (0, 1):
        batch = progress(r, 2, "idle")
        batch.restart_count = 1
        stored(batch, now=5.0)
    assert state.missing() == [0, 1] and not state.first_end.is_set() and state.attempt == 1
    again = progress(0, 4, "idle")
    again.restart_count = 1
    stored(again, now=14.0)
    record = w.check(now=16.0)
    assert [(e["rank"], e["attempt"], e["steps_completed"]) for e in record["ranks"]] == [(1, 1, 2)]
    assert record["suspects"] == [1]
    line = describe(HangRecord.from_json(record))
    assert " in attempt 1 (rank 1: 2 steps done, in idle); suspect: rank 1" in line
    stored(finished(0, 1), now=17.0)
    assert state.missing() == [1] and state.first_end.is_set()


def test_a_stall_left_by_an_earlier_aggregator_is_cleared_when_its_rank_moves(tmp_path):
    """The aggregator died during a stall; its replacement takes the record, and removes it
    from the store and the stall file once the stalled rank is seen making progress."""
    old = HangWatch(10.0, lambda r, attempt: False, tmp_path / "stall.json")
    old.on_batch(progress(1, 4, "forward"), now=0.0)
    left = old.check(now=12.0)
    (tmp_path / "stall.json").write_text(json.dumps(left))

    new = HangWatch(10.0, lambda r, attempt: False, tmp_path / "stall.json")
    new.restore(json.loads(json.dumps(left)), now=100.0)
    assert new.check(now=101.0) == left  # still stalled: the same record, not a new line
    persisted, said = [], []

    async def persist(record):
        persisted.append(record)

    async def main():
        task = asyncio.create_task(new.run(persist, said.append))
        new.on_batch(progress(1, 5, "forward"))
        while not persisted:
            await asyncio.sleep(0.05)
        task.cancel()

    asyncio.run(asyncio.wait_for(main(), 10))
    assert persisted == [None] and said == ["the stalled ranks make progress again"]
    assert not (tmp_path / "stall.json").exists()


def profile(rank: int, *, residual: float, backward: float, outside: float) -> Profile:
    """A rank's profile over 20 steps: input 2, forward 10, optimizer 3 ms per step, and the
    given residual, backward and time outside the steps (ms per step)."""
    median_ms = {k: None for k in PARTS} | {
        "input_wait": 2.0,
        "forward": 10.0,
        "backward": backward,
        "optimizer": 3.0,
        "residual": residual,
        "dataloader_next": 2.0,
    }
    step = 15.0 + backward + residual
    return Profile(
        rank=rank,
        steps=20,
        step_ms={"median": step, "mean": step, "p95": step, "max": step},
        median_ms=median_ms,
        share_pct={k: None for k in PARTS},
        own_compute_ms=13.0,
        parts={"outside": [int(outside * 1000)] * 20},
    )


def stragglers(profiles: dict[int, Profile]) -> list:
    typ = step_time.typical(profiles)
    return step_time._stragglers(profiles, {r: 0 for r in profiles}, typ.step_time_ms, True)


def test_a_rank_waiting_in_a_collective_of_its_step_is_never_the_residual_straggler():
    """DDP with an all-reduce called by hand inside the step: rank 1 spends 40 ms per step
    outside its step (before the all-reduce), so rank 0 waits 40 ms inside its step, outside
    the measured phases. Rank 0's residual is a wait, not a straggler."""
    waiting = {
        0: profile(0, residual=40.0, backward=20.0, outside=0.0),
        1: profile(1, residual=0.0, backward=20.0, outside=40.0),
    }
    assert stragglers(waiting) == []
    # Work of its own in the step: rank 1 is late and rank 0 waits in backward's all-reduce.
    working = {
        0: profile(0, residual=0.0, backward=60.0, outside=0.0),
        1: profile(1, residual=40.0, backward=20.0, outside=0.0),
    }
    [found] = stragglers(working)
    assert (found.kind, found.ranks, found.evidence["gap_ms"]) == ("STRAGGLER", [1], 40.0)


def reporting(rank: int, steps: int, *, stack: str, inside=None) -> wire.Batch:
    """A heartbeat of ``rank`` between steps whose step stayed open: its main thread's stack
    and ``inside`` = ``(op, group, seq, entered Unix s)`` or None (inside no collective)."""
    batch = progress(rank, steps, "idle")
    batch.progress.stack = stack
    if inside is not None:
        op, group, seq, entered_s = inside
        batch.progress.inside.CopyFrom(
            wire.CollectiveState(
                op=op, group=group, seq=seq, entered_unix_us=int(entered_s * 1_000_000)
            )
        )
    return batch


WAITING_STACK = "train.py:30 in <module>\ntrain.py:21 in main\ntrain.py:8 in sync"
STOPPED_STACK = "train.py:30 in <module>\ntrain.py:19 in main"


def test_the_collective_ranks_wait_in_and_the_rank_that_never_entered_it_are_named():
    """Ranks 0, 1 and 3 wait in all-reduce #6 of the default group after their 3rd step; rank 2
    stopped before it, alive, at train.py:19. All four are between steps with 3 steps done
    (no place differs): the collective names rank 2, live and in the summary."""
    from rundata_factory import rank, run_of, steps

    from traceml.analysis.summary import build_summary

    w = watch()
    for r in range(4):
        w.on_batch(progress(r, 3, "idle"), now=100.0)  # the step count moves at 100 s
    for r in (0, 1, 3):
        w.on_batch(
            reporting(r, 3, stack=WAITING_STACK, inside=("all_reduce", "default", 6, 100.5 + r)),
            now=106.0,
        )
    w.on_batch(reporting(2, 3, stack=STOPPED_STACK), now=106.0)
    record = w.check(now=112.0)
    assert record["suspects"] == [2]
    entries = {e["rank"]: e for e in record["ranks"]}
    assert entries[1]["collective"] == {
        "op": "all_reduce",
        "group": "default",
        "seq": 6,
        "entered_unix_s": 101.5,
    }
    assert entries[2]["collective"] is None and entries[2]["stack"] == STOPPED_STACK
    assert describe(HangRecord.from_json(json.loads(json.dumps(record)))) == (
        "hang: ranks 0, 1, 2, 3 made no progress for 12 s (rank 0: 3 steps done, in idle; "
        "rank 1: 3 steps done, in idle; rank 2: 3 steps done, in idle; rank 3: 3 steps done, "
        "in idle); ranks 0, 1, 3 wait in all_reduce #6 of group default for 12 s; rank 2 "
        "never entered it (alive, at train.py:19 in main); suspect: rank 2"
    )
    # Without the ranks' reports (an older SDK), all four stand at one place: no suspect.
    old = [
        {k: v for k, v in e.items() if k not in ("collective", "stack")} for e in record["ranks"]
    ]
    assert [HungRank.from_json(e).collective for e in old] == [None] * 4
    bare = watch()
    for r in range(4):
        bare.on_batch(progress(r, 3, "idle"), now=100.0)
    assert bare.check(now=112.0)["suspects"] == []

    run = run_of([rank(r, steps(3), finish=False, end=None) for r in range(4)])
    run.stall = HangRecord.from_json(record)
    summary = build_summary(run, now_unix_s=130.0)
    [hung] = [
        f
        for f in [summary["primary_diagnosis"], *summary["findings"]["health"]]
        if f["kind"] == "RANK_HUNG"
    ]
    assert hung["ranks"] == [2]
    assert (
        " Ranks 0, 1, 3 wait in all_reduce #6 of group default for 30 s; rank 2 never entered "
        "it (alive, at train.py:19 in main)." in hung["summary"]
    )
    assert hung["evidence"]["collective"] == {
        "op": "all_reduce",
        "group": "default",
        "seq": 6,
        "waiting": [0, 1, 3],
        "waited_s": 29.5,
        "never_entered": [
            {
                "rank": 2,
                "alive": True,
                "inside": None,
                "at": "train.py:19 in main",
                "stack": ["train.py:30 in <module>", "train.py:19 in main"],
            }
        ],
    }
    assert hung["action"].startswith(
        "Look at rank 2 first: the others wait for it in all_reduce #6 of group default, which "
        "it never entered (rank 2's main thread sits at train.py:19 in main)."
    )
