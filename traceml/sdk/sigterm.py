"""A rank killed by SIGTERM sends what it can, in bounded time, then dies of SIGTERM as it would
have without TraceML.

``atexit`` does not run on SIGTERM: without this module the steps buffered since the last send
(up to ``TRACEML_FLUSH_INTERVAL_SEC`` of them) are lost, and nobody counts them. What it does
(docs/telemetry.md, "A rank's end"):

* **Only where the default would run.** :func:`install` (from ``traceml.init()`` on the main
  thread) takes SIGTERM only when its disposition is ``SIG_DFL``. A handler the script set
  before is left alone, ``SIG_IGN`` too, and one it sets later replaces this one (Python keeps
  one handler per signal): the script's own handling then decides, and the finish marker goes
  out at ``atexit`` if the script exits normally.
* **The step in progress ends first**, at most :data:`STEP_GRACE_S`: a SIGTERM inside a step
  lets its ``with`` block finish, so the step is both counted and sent, and the script's own
  per-step log agrees with the summary.
* **Then a bounded flush.** The rank's client sends what is buffered and the finish marker
  (end state ``signaled``, reason ``SIGTERM``) within ``TRACEML_SIGTERM_FLUSH_SEC`` (default
  2 s) of the signal; records it had no time for are counted as unsent in the marker
  (:meth:`traceml.sdk.client.TelemetryClient.close`), and what the aggregator never
  acknowledged is named in one warning line. With CUDA, the wait for the last step's GPU events
  (``TRACEML_GPU_FINISH_WAIT_SEC``) comes first.
* A SIGTERM during the exit's own flush (``atexit``, after an exception, say) gives that flush
  the same budget, then ends the process.
* **Then SIGTERM's default action**: the handler restores ``SIG_DFL`` and signals the process
  again, so torchrun sees the exit it would have seen ("killed by SIGTERM", exit code -15).

Python runs a signal handler on the main thread only, between two bytecodes. A main thread
waiting in C (a gloo collective whose peer died) would not run it for as long as the wait lasts
(the collective's timeout: 30 min by default), and SIGTERM, which used to kill at once, would
be held until torchrun's SIGKILL. So the C part of Python's handler also writes the signal's
number to a pipe (``signal.set_wakeup_fd``, taken only when no one holds it), and a watcher
thread acts when the main thread has not within :data:`STEP_GRACE_S`. The alternative, a
``sigwait`` thread with SIGTERM blocked everywhere else, cannot work in a process whose threads
(torch's, gRPC's) exist before ``init()``: a thread that does not block SIGTERM gets its default
action, and the process dies without a flush.

A forked child (a DataLoader worker) inherits the handler but no rank state: there it restores
the default action at once, and it stops writing to the parent's pipe.
"""

from __future__ import annotations

import os
import signal
import threading
import time

from traceml import settings
from traceml.core import orphans
from traceml.sdk import client as client_mod

#: Longest wait for the step in progress to end before the flush starts anyway, s.
STEP_GRACE_S = 0.5

_terminator: _Terminator | None = None


def install(state) -> bool:
    """Take SIGTERM for ``state`` if its disposition is ``SIG_DFL``; True when taken.

    Call on the main thread (``traceml.init()``); elsewhere, or with another disposition,
    nothing changes and False is returned.
    """
    global _terminator
    if threading.current_thread() is not threading.main_thread():
        return False
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL or _terminator is not None:
        return False
    _terminator = _Terminator(state, settings.read(settings.SIGTERM_FLUSH_SEC))
    signal.signal(signal.SIGTERM, _terminator.on_signal)
    _terminator.watch()
    return True


class _Terminator:
    """The flush-then-die sequence of one rank state, started by whichever of the main thread
    (the signal handler, or the end of the step in progress) and the watcher thread comes
    first."""

    def __init__(self, state, budget_s: float) -> None:
        self.state = state
        self.budget_s = budget_s
        self.arrived: float | None = None  # monotonic s of the first SIGTERM
        self._lock = threading.RLock()  # a further SIGTERM's handler may run while held
        self._started = False
        self._owner: int | None = None  # the thread of the first terminate()
        self._pipe: tuple[int, int] | None = None

    # --- where the signal is seen -----------------------------------------------------------
    def on_signal(self, signum, frame) -> None:
        """Python-level handler (main thread): flush now, or once the open step ends."""
        if client_mod.in_forked_child():
            orphans.die_of(signal.SIGTERM)
        self._note_arrival()
        tracer = self.state.tracer
        if tracer.in_step:
            tracer.on_step_end = self.terminate  # the step is counted, then the flush
            threading.Thread(target=self._after_grace, name="traceml-sigterm", daemon=True).start()
            return
        self.terminate()

    def watch(self) -> None:
        """Own the wakeup fd (when free) and read it on a daemon thread."""
        r, w = os.pipe()
        os.set_blocking(w, False)
        try:
            previous = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        except (ValueError, OSError):
            previous = None
        if previous != -1:  # someone else's (asyncio's): give it back, rely on the handler
            if previous is not None:
                signal.set_wakeup_fd(previous)
            os.close(r)
            os.close(w)
            return
        self._pipe = (r, w)
        threading.Thread(target=self._read_wakeups, name="traceml-sigterm", daemon=True).start()

    def _read_wakeups(self) -> None:
        r = self._pipe[0]
        while True:
            try:
                data = os.read(r, 64)
            except OSError:
                return
            if not data:
                return
            # Other signals with Python handlers write here too, and so does SIGTERM once the
            # script has replaced this handler with its own: then its handler decides.
            if signal.SIGTERM in data and signal.getsignal(signal.SIGTERM) == self.on_signal:
                self._note_arrival()
                self._after_grace()

    def _after_grace(self) -> None:
        """Start the flush once :data:`STEP_GRACE_S` has passed since the signal (the main
        thread is stuck in C, or in a step that does not end)."""
        time.sleep(max(0.0, self.arrived + STEP_GRACE_S - time.monotonic()))
        self.terminate()

    def _note_arrival(self) -> None:
        if self.arrived is None:
            self.arrived = time.monotonic()

    # --- the sequence -----------------------------------------------------------------------
    def terminate(self) -> None:
        """Flush within the budget, then die of SIGTERM. A second caller on another thread
        waits for the end; one on the first caller's own thread (a further SIGTERM, whose
        handler runs inside the flush) returns at once, so that the flush goes on: a rank
        SIGTERMed twice (scancel signals every process of a step, and torchrun signals its
        ranks too) would otherwise wait on itself for ever."""
        with self._lock:
            first, self._started = not self._started, True
            if first:
                self._owner = threading.get_ident()
        if not first:
            if self._owner == threading.get_ident():
                return
            threading.Event().wait()  # the first caller ends the process
        try:
            remaining = max(self.arrived + self.budget_s - time.monotonic(), 0.1)
            if self.state.closed:  # the exit's own flush (atexit) is under way: let it go on
                self.state.client.wait_closed(remaining)
            else:
                self.state.close(timeout_s=remaining, signal_name="SIGTERM")
        finally:
            orphans.die_of(signal.SIGTERM)

    def after_fork_in_child(self) -> None:
        """In a forked child: no rank state here, and the pipe is the parent's."""
        if self._pipe is not None:
            try:
                signal.set_wakeup_fd(-1)
            except (ValueError, OSError):
                pass
            for fd in self._pipe:
                try:
                    os.close(fd)
                except OSError:
                    pass
            self._pipe = None


def _after_fork_in_child() -> None:
    if _terminator is not None:
        _terminator.after_fork_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)
