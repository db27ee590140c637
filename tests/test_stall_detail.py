"""What a rank's sender adds to its ``Progress`` while its step stays open (traceml/sdk/stall.py):
nothing while steps complete; the collective it is inside and where its main thread sits once
the step is older than DETAIL_SHARE of the hang timeout, read from another thread."""

from __future__ import annotations

import sys
import sysconfig
import threading
import time

from traceml import wire
from traceml.sdk import collectives
from traceml.sdk.stall import DETAIL_SHARE, STACK_FRAMES, StallDetail, stack_of
from traceml.sdk.step import StepTracer

#: A hang timeout no test step comes near: DETAIL_SHARE of it is minutes.
LONG_TIMEOUT_S = 600.0


def tracer_with_recorder() -> tuple[StepTracer, collectives.Recorder]:
    tracer = StepTracer(lambda m: None, time.perf_counter_ns())
    recorder = collectives.Recorder(tracer)
    tracer.comm = recorder
    return tracer, recorder


def on_another_thread(detail: StallDetail) -> wire.Progress:
    """The ``Progress`` the sender thread would send: built and filled on a thread of its own
    while this (the training) thread waits for it at :data:`WAIT_LINE` (the thread builds
    them until one is built while this thread is there, or one carries no stack; 10 s at
    most)."""
    built: list[wire.Progress] = []

    def sender() -> None:
        deadline = time.monotonic() + 10.0
        while True:
            progress = wire.Progress(steps_completed=1, phase="idle")
            detail(progress)
            built.append(progress)
            if not progress.stack or progress.stack.endswith(f":{WAIT_LINE} in on_another_thread"):
                return
            if time.monotonic() > deadline:
                return

    worker = threading.Thread(target=sender)
    worker.start()
    worker.join()  # WAIT_LINE
    return built[-1]


#: The line of this file where the training thread waits in :func:`on_another_thread`.
WAIT_LINE = next(
    i
    for i, text in enumerate(open(__file__).read().splitlines(), 1)
    if text.endswith("# WAIT_LINE")
)


def test_while_steps_complete_the_sender_adds_nothing():
    tracer, recorder = tracer_with_recorder()
    detail = StallDetail(tracer, LONG_TIMEOUT_S)
    detail.thread_id = threading.get_ident()
    assert detail.after_ns == int(LONG_TIMEOUT_S * DETAIL_SHARE * 1e9)
    assert on_another_thread(detail).ListFields() == [  # before the first step: nothing
        (wire.Progress.DESCRIPTOR.fields_by_name["steps_completed"], 1),
        (wire.Progress.DESCRIPTOR.fields_by_name["phase"], "idle"),
    ]
    for _ in range(20):
        tracer.begin()
        ev = recorder.enter("all_reduce", "default", 4)  # even inside a collective
        progress = on_another_thread(detail)
        recorder.done(ev, sync=True)
        tracer.end()
        assert not progress.HasField("inside") and progress.stack == ""
    assert tracer.steps_completed == 20


def test_a_step_open_past_the_share_sends_the_collective_and_where_the_main_thread_sits():
    tracer, recorder = tracer_with_recorder()
    tracer.begin()
    tracer.end()
    for op in ("broadcast", "all_reduce"):
        recorder.done(recorder.enter(op, "default", 4), sync=True)  # default #1, #2: done
    entered_us = time.time_ns() // 1000
    recorder.enter("all_reduce", "default", 4)  # #3, in flight
    recorder.enter("barrier", "tp", 0)  # entered later: not the one the rank waits in
    # the step is older than the share of a timeout this short as soon as it ended
    detail = StallDetail(tracer, 1e-9)
    detail.thread_id = threading.get_ident()
    line = sys._getframe().f_lineno + 1
    progress = on_another_thread(detail)
    after_us = time.time_ns() // 1000
    inside = progress.inside
    assert (inside.op, inside.group, inside.seq) == ("all_reduce", "default", 3)
    assert entered_us - 1000 <= inside.entered_unix_us <= after_us  # (ns -> µs rounding)
    frames = progress.stack.split("\n")
    assert frames[-2:] == [
        f"{__file__}:{line} in "
        "test_a_step_open_past_the_share_sends_the_collective_and_where_the_main_thread_sits",
        f"{__file__}:{WAIT_LINE} in on_another_thread",
    ]
    assert 1 <= len(frames) <= STACK_FRAMES
    library = tuple(sysconfig.get_paths()[k] for k in ("stdlib", "purelib"))
    assert not [f for f in frames if f.startswith(library) or "/traceml/" in f], frames


def test_a_failed_read_of_the_collective_drops_it_alone(capsys):
    class Broken:
        def inside(self):
            raise RuntimeError("boom")

    tracer, _ = tracer_with_recorder()
    tracer.begin()
    tracer.end()
    tracer.comm = Broken()
    detail = StallDetail(tracer, 1e-9)
    detail.thread_id = threading.get_ident()
    progress = on_another_thread(detail)
    assert not progress.HasField("inside")
    assert progress.stack.split("\n")[-1] == f"{__file__}:{WAIT_LINE} in on_another_thread"
    err = capsys.readouterr().err
    assert "reading what the stalled rank does failed (RuntimeError: boom)" in err
    assert stack_of(None) == "" and stack_of(-1) == ""
