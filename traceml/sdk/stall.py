"""What a rank is doing while its step stays open: the collective it is inside and where its main
thread sits, sent with its ``Progress`` so that node 0 can name a hang down to the collective and
the line.

While the rank's last step ended longer ago than :data:`DETAIL_SHARE` of the hang timeout
(``TRACEML_HANG_TIMEOUT_SEC``, which the launcher passes on to its ranks when
``--hang-timeout-sec`` sets it), every batch the sender thread builds (at least one a heartbeat,
``TRACEML_HEARTBEAT_SEC``) carries, in ``Progress`` (``proto/traceml/wire/v1/step.proto``):

* ``inside``: the collective the rank is inside (:meth:`traceml.sdk.collectives.Recorder.inside`:
  op, group, sequence number, entry time), absent when it is inside none;
* ``stack``: the main thread's Python stack (``sys._current_frames()``), read by the sender
  thread, never by the training thread: the innermost :data:`STACK_FRAMES` frames of user code
  (frames of TraceML, of the standard library and of installed packages left out; all frames
  when none is the user's), as "file:line in function" lines, outermost first.

Cost: while steps complete, one clock read and one comparison per batch on the sender thread;
nothing on the training thread. Fail-open: an exception while reading the collective or the
stack drops that field alone (one warning per process).
"""

from __future__ import annotations

import os
import sys
import sysconfig
import threading
import time

from traceml.core import clock
from traceml.sdk.failopen import warn_once

#: Share of the hang timeout a rank's step stays open (since its last step ended) before its
#: batches carry what it is doing: half, so that two or more heartbeats (5 s default, of a
#: 300 s default timeout) have carried it before the aggregator finds the rank stalled.
DETAIL_SHARE = 0.5
#: Frames of user code kept of the main thread's stack, the innermost ones.
STACK_FRAMES = 8

_now_ns = time.perf_counter_ns


def _library_dirs() -> tuple[str, ...]:
    """Directories whose frames are not user code: TraceML's package, the standard library, the
    installed packages (each with a trailing separator)."""
    paths = sysconfig.get_paths()
    dirs = {paths.get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    dirs.add(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return tuple(os.path.join(d, "") for d in dirs if d)


_LIBRARY_DIRS = _library_dirs()


def is_user_code(filename: str) -> bool:
    """Whether a frame of ``filename`` (a code object's ``co_filename``) is the user's: a real
    file outside :func:`_library_dirs` (``<frozen ...>``, ``<string>``: not)."""
    if filename.startswith("<"):
        return False
    return not os.path.abspath(filename).startswith(_LIBRARY_DIRS)


def stack_of(thread_id: int | None) -> str:
    """The stack of thread ``thread_id`` now, trimmed as the module docstring says ("" when the
    thread has no Python frame or does not exist).

    Returns:
        "file:line in function" lines joined by newlines, outermost first, at most
        :data:`STACK_FRAMES` lines.
    """
    frame = sys._current_frames().get(thread_id) if thread_id is not None else None
    frames = []
    while frame is not None:  # innermost first
        code = frame.f_code
        frames.append((code.co_filename, frame.f_lineno, code.co_name))
        frame = frame.f_back
    user = [f for f in frames if is_user_code(f[0])] or frames
    return "\n".join(f"{f}:{line} in {name}" for f, line, name in reversed(user[:STACK_FRAMES]))


class StallDetail:
    """Fills a batch's ``Progress`` with what the rank is doing while its step stays open (see
    the module docstring); called by the sender thread as it builds a batch.

    Args:
        tracer: the rank's :class:`~traceml.sdk.step.StepTracer` (its ``last_end_ns`` and
            ``comm``, the collective recorder, are read).
        hang_timeout_s: the run's hang timeout, s (> 0).
    """

    def __init__(self, tracer, hang_timeout_s: float) -> None:
        self.tracer = tracer
        #: Age of the open step (ns since the last step ended) from which the detail is sent.
        self.after_ns = int(hang_timeout_s * DETAIL_SHARE * 1e9)
        self.thread_id = threading.main_thread().ident

    def __call__(self, progress) -> None:
        """Set ``progress.inside`` and ``progress.stack`` (a ``wire.Progress``) when the open
        step is older than :attr:`after_ns`; leave them absent otherwise. Never raises."""
        last = self.tracer.last_end_ns
        if last is None:
            return
        now = _now_ns()
        if now - last < self.after_ns:
            return
        try:
            recorder = self.tracer.comm
            ev = recorder.inside() if recorder is not None else None
            if ev is not None:
                entered_us = clock.unix_ns() // 1000 - (now - ev.entry_ns) // 1000
                progress.inside.op, progress.inside.group = ev.op, ev.group
                progress.inside.seq, progress.inside.entered_unix_us = ev.seq, entered_us
        except Exception as exc:  # fail-open: the collective is not reported
            progress.ClearField("inside")
            _warn(exc)
        try:
            progress.stack = stack_of(self.thread_id)
        except Exception as exc:  # fail-open: the stack is not reported
            progress.ClearField("stack")
            _warn(exc)


def _warn(exc: BaseException) -> None:
    warn_once(
        "stall detail",
        f"reading what the stalled rank does failed ({type(exc).__name__}: {exc})",
    )
