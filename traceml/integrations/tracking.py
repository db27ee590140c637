"""What the tracker helpers share: :class:`Tracker` logs ``traceml.summary()`` live and at the end.

:mod:`traceml.integrations.wandb`, :mod:`traceml.integrations.mlflow` and
:mod:`traceml.integrations.tensorboard` each give :class:`Tracker` one ``write`` function in
their tracker's conventions; the rest is here:

* **live** — a daemon thread asks ``traceml.summary()`` every ``every_s`` seconds (the gRPC call
  and the tracker's write happen on that thread, never on the training thread) and writes the
  figures at the training step: the number of steps this rank has completed (rank 0's
  ``steps_completed``, an attribute read). A tick writes only when the step moved since the
  previous write, so an idle run adds no point;
* **at the end** — :meth:`Tracker.finish` (or leaving the ``with`` block) stops the thread and
  writes the verdict so far once more, on the calling thread;
* **figures** — the numbers of ``traceml.summary()`` (names with their unit: ``_ms``, ``_pct``,
  ``_bytes``; see :func:`traceml.report.flat.flatten`) at every write; its words (``verdict``,
  ``severity``, ``clock``, ``run_name``, ``ranks``, ``nodes``) only when they changed since the
  previous write, a word that is gone as ``""`` (so a tracker's key-value field never keeps a
  stale straggler rank);
* **fail-open** — on ranks other than 0 a tracker is inert, silently, and touches no tracker
  (``traceml.summary()`` answers only rank 0; before ``traceml.init()`` the rank is torchrun's
  ``RANK``); a failing write is one warning line, and the thread goes on; a missing tracker
  library, or a set-up that fails (a finished W&B run, a writer that cannot be opened), is one
  warning line and an inert tracker (``TRACEML_STRICT=1``: the exception);
* **wrong arguments** — ``every_s`` that is not a positive number or None, and (TensorBoard)
  something that is neither a writer nor a directory, raise ValueError on every rank: they are
  the script's mistakes, not the tracker's failures.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable
from types import ModuleType

import traceml
from traceml import settings
from traceml.sdk import failopen

#: Default period of the live writes, s: each asks the aggregator for the verdict (an analysis
#: it shares with every other viewer, at most a bounded share of a core).
LIVE_EVERY_S = 30.0

#: ``write(metrics, labels, step)``: the numbers by name, the words that changed (name -> text),
#: the training step.
Write = Callable[[dict, dict, int], None]


def require(module: str, tracker: str) -> ModuleType | None:
    """``import module`` for the helper of ``tracker`` (``"wandb"``, ``"mlflow"``,
    ``"tensorboard"``, also the name of its extra).

    Returns:
        The module, or None after one warning line when it is not installed.

    Raises:
        ImportError: it is not installed and ``TRACEML_STRICT=1``.
    """
    try:
        return importlib.import_module(module)
    except ImportError:
        why = f"{module} is not installed (pip install 'traceml-insight[{tracker}]')"
        if settings.read(settings.STRICT):
            raise ImportError(_nothing_logged(tracker, why)) from None
        failopen.warn(_nothing_logged(tracker, why))
        return None


def inert(tracker: str, why: str) -> Tracker:
    """A tracker that logs nothing, after one warning line saying ``why``."""
    failopen.warn(_nothing_logged(tracker, why))
    return Tracker(tracker, None)


def setup_failed(tracker: str, exc: Exception) -> Tracker:
    """A tracker that logs nothing, after one warning line saying why its set-up failed.

    Raises:
        Exception: ``exc`` itself under ``TRACEML_STRICT=1``.
    """
    if settings.read(settings.STRICT):
        raise exc
    return inert(tracker, f"setting it up failed ({type(exc).__name__}: {exc})")


def check_every_s(every_s: object) -> None:
    """Refuse a live period that is not a positive number of seconds or None.

    Raises:
        ValueError: it is not (a string, a bool, zero, a negative number, NaN).
    """
    if every_s is None:
        return
    if isinstance(every_s, bool) or not isinstance(every_s, (int, float)) or not every_s > 0:
        raise ValueError(f"every_s must be a positive number of seconds or None, got {every_s!r}")


def elsewhere(tracker: str, every_s: object) -> Tracker | None:
    """What every ``track()`` does first, on every rank: check ``every_s``; then an inert
    tracker (silently) where this process logs nothing (:func:`logs_here`), None where it logs.

    Raises:
        ValueError: ``every_s`` is not a positive number or None.
    """
    check_every_s(every_s)
    return None if logs_here() else Tracker(tracker, None)


def logs_here() -> bool:
    """Whether a tracker made in this process logs: on rank 0 (``traceml.summary()`` answers
    rank 0 only). Before TraceML's rank state started (``track()`` before ``traceml.init()``)
    the rank is torchrun's ``RANK`` (0 without it, or when it is not an integer)."""
    from traceml.sdk import rank_state
    from traceml.sdk.identity import IdentityError, RankInfo

    s = rank_state.current()
    if s is not None:
        return s.info.rank == 0
    try:
        return RankInfo.from_env().rank == 0
    except IdentityError:
        return True


def _nothing_logged(tracker: str, why: str) -> str:
    return f"traceml.integrations.{tracker}: {why}; nothing is logged to it"


class Tracker:
    """Logs the verdict and key figures of ``traceml.summary()`` to one tracker, live and at
    the end of the run (see :mod:`traceml.integrations.tracking`).

    Made by the ``track()`` of :mod:`traceml.integrations.wandb`, ``.mlflow`` or
    ``.tensorboard``. A context manager: leaving the block calls :meth:`finish`.

    Attributes:
        logged_step: the training step of the latest write (live or final), None before the
            first.
    """

    def __init__(
        self,
        name: str,
        write: Write | None,
        every_s: float | None = LIVE_EVERY_S,
        prefix: str = "traceml/",
        close: Callable[[], None] | None = None,
    ) -> None:
        """Start logging (the live thread starts here, on rank 0 only).

        Args:
            name: the tracker's name in warnings and the thread's name (``"wandb"``).
            write: writes one set of figures; None makes an inert tracker.
            every_s: period of the live writes, s; None: only the end-of-run write.
            prefix: prepended to every name (``traceml.summary(prefix)``).
            close: called once by :meth:`finish`, after the last write.

        Raises:
            ValueError: ``every_s`` is not a positive number or None.
        """
        check_every_s(every_s)
        self.name, self.prefix, self.every_s = name, prefix, every_s
        self.logged_step: int | None = None
        self._write = write if write is not None and logs_here() else None
        self._close = close
        self._labels: dict[str, str] = {}
        self._lock = threading.Lock()  # one write at a time; the final one is the last
        self._stop = threading.Event()
        self._warned = False
        if self._write is not None and every_s is not None:
            threading.Thread(target=self._live, name=f"traceml-{name}", daemon=True).start()

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, *exc) -> bool:
        self.finish()
        return False

    def finish(self, timeout_s: float | None = None) -> None:
        """Stop the live writes and write the verdict so far, at the current step; then close
        what the helper opened. Call it at the end of training, before the tracker's own end
        (``run.finish()``, ``mlflow.end_run()``). Idempotent; never raises (unless
        ``TRACEML_STRICT=1``).

        For the figures to be the final summary's, every rank's steps must be stored first: on
        the other ranks call ``traceml.shutdown()``, then a ``torch.distributed.barrier()`` on
        all, before this (otherwise their steps of up to the last ``TRACEML_FLUSH_INTERVAL_SEC``
        may be missing). The node sampler's samples of the last seconds may still be on their
        way: they can add a finding made from the samples (a busy CPU, host memory) to the final
        summary or take one away (a median they pull under its threshold), one more or one
        fewer in its ``findings_warning`` or ``findings_critical`` than this write.

        Args:
            timeout_s: bound of the ``traceml.summary()`` call, s (default
                ``TRACEML_SUMMARY_TIMEOUT_SEC``).
        """
        if self._stop.is_set():
            return
        self._stop.set()
        if self._write is None:
            return
        try:
            self._log(final=True, timeout_s=timeout_s)
        finally:
            if self._close is not None:
                try:
                    self._close()
                except Exception as exc:
                    failopen.fail_open(f"traceml.integrations.{self.name}: closing", exc)

    def _live(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self._log(final=False, timeout_s=None)
            except Exception as exc:  # never out of the thread, even under TRACEML_STRICT
                self._warn(exc)

    def _log(self, final: bool, timeout_s: float | None) -> None:
        # Imported here: it imports torch, which an inert tracker never needs.
        from traceml.sdk import rank_state

        s = rank_state.current()
        step = s.tracer.steps_completed if s is not None else 0
        if not final and (step == 0 or step == self.logged_step):
            return
        flat = traceml.summary(self.prefix, timeout_s)  # {} after one warning when it cannot
        if not flat:
            return
        metrics = {k: v for k, v in flat.items() if not isinstance(v, str)}
        words = {k: v for k, v in flat.items() if isinstance(v, str)}
        with self._lock:
            if self._stop.is_set() and not final:
                return  # finish() writes the last word
            changed = {k: v for k, v in words.items() if self._labels.get(k) != v}
            changed.update({k: "" for k in self._labels if k not in words and self._labels[k]})
            try:
                self._write(metrics, changed, step)
            except Exception as exc:
                if final:
                    failopen.fail_open(f"traceml.integrations.{self.name}", exc)
                    return
                raise
            self._labels.update(changed)
            self.logged_step = step

    def _warn(self, exc: BaseException) -> None:
        if not self._warned:
            self._warned = True
            failopen.warn(
                f"traceml.integrations.{self.name}: a live write failed "
                f"({type(exc).__name__}: {exc}); training continues"
            )
