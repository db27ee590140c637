"""``python -m traceml.launcher.torchrun_main ARGS``: torchrun, plus a record of how each rank
ended.

This is ``torch.distributed.run.main`` itself (same argument parsing, same rendezvous, same
exit codes), bound first to die with the launcher that started it (and then to remove the log
directory the launcher made for it), then wrapped to catch
torchrun's typed failure, :class:`ChildFailedError`, whose ``failures`` map each failed global
rank to its exit code, signal and error-file message. They
are written as JSON to ``$TRACEML_RANK_ENDS_FILE`` for the launcher, which reports them to the
aggregator, and then the exception continues exactly as under plain torchrun. A failure of
torchrun itself (its rendezvous: a ``--master-port`` in use, node 0 unreachable) is written
there too, with whether it had started ranks. When the ranks
run ``--module traceml.sdk.autorun SCRIPT`` (zero-code steps), its "... FAILED" banner names
``SCRIPT``, as plain torchrun's does, not the module.
"""

from __future__ import annotations

import os
import select
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

from traceml.core import log, orphans
from traceml.core.rundir import write_json

#: Environment variable naming the JSON file this wrapper writes (set by the launcher).
RANK_ENDS_FILE_ENV = "TRACEML_RANK_ENDS_FILE"
#: Environment variable with the launcher's process id (set by the launcher).
LAUNCHER_PID_ENV = "TRACEML_LAUNCHER_PID"
#: How long torchrun, stopped by a signal, waits to see whether that was its launcher's death
#: (``PR_SET_PDEATHSIG`` comes while the launcher is still exiting), s: then it removes the log
#: directory the launcher cannot. A live launcher that passed its own signal on costs torchrun's
#: stop this much.
LAUNCHER_DEATH_WAIT_S = 0.5
#: The signals torchrun stops on (torch's ``SignalException``).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
#: Once the launcher is gone: how long torchrun's own stop may take to end the ranks before
#: the reaper sends them SIGTERM itself, and how long torchrun may take to exit on its own
#: once they ended before it is SIGKILLed, s (its normal exit takes ~1 s).
ORPHAN_EXIT_GRACE_S = 5.0


def _wait_gone(pid: int, timeout_s: float | None = None) -> bool:
    """Wait until process ``pid``, this process's parent, has exited, at most ``timeout_s``
    (None: for as long as it takes); True once it has. A pidfd where the kernel has them, else
    the parent-pid change of this process, polled every 0.1 s."""
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):  # no pidfd (Linux < 5.3), or ``pid`` is gone already
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while os.getppid() == pid:
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(0.1)
        return True
    try:
        return bool(select.select([fd], [], [], timeout_s)[0])
    finally:
        os.close(fd)


def reap_when_orphaned(launcher_pid: int, log_dir: str = "") -> None:
    """Bound how long torchrun and its ranks outlive the launcher. Once the launcher has died
    (SIGKILLed: the OOM killer, a scheduler), torchrun gets SIGTERM from ``PR_SET_PDEATHSIG``
    and stops its ranks as on any SIGTERM (within its ``--shutdown-timeout``). Two ways that
    failed were seen on a loaded machine (about 1 run in 25 with 4 test workers on 2 cores):
    the ranks never got torchrun's SIGTERM (it SIGKILLed them 30 s later), and a torchrun
    stayed in its own teardown long after its ranks ended. So ranks still running
    :data:`ORPHAN_EXIT_GRACE_S` after the launcher died get SIGTERM from here (their process
    groups, as torchrun signals them), and a torchrun still running that long after they all
    ended is SIGKILLed. Once they ended, ``log_dir`` (the launcher's torchrun log directory,
    which the dead launcher cannot remove; "": none) is removed. Blocks; run it on a daemon
    thread."""
    import psutil

    def running_ranks() -> list[psutil.Process]:  # ended, not reaped yet: not running
        running = []
        for child in psutil.Process().children():
            try:
                if child.status() != psutil.STATUS_ZOMBIE:
                    running.append(child)
            except psutil.Error:
                pass
        return running

    _wait_gone(launcher_pid)
    deadline = time.monotonic() + ORPHAN_EXIT_GRACE_S
    while (running := running_ranks()) and time.monotonic() < deadline:
        time.sleep(0.2)
    for rank in running:  # torchrun's own stop has not ended them
        _signal_group(rank.pid, signal.SIGTERM)
    while running_ranks():
        time.sleep(0.2)
    remove_log_dir(log_dir)
    time.sleep(ORPHAN_EXIT_GRACE_S)
    os.kill(os.getpid(), signal.SIGKILL)


def remove_log_dir(log_dir: str) -> None:
    """Remove torchrun's log directory ``log_dir`` ("" or gone already: nothing); never raises
    (the reaper and torchrun's own exit may both get here)."""
    if log_dir:
        shutil.rmtree(log_dir, ignore_errors=True)


def _signal_group(pid: int, signum: int) -> None:
    """``signum`` to ``pid``'s process group when it leads one (torchrun starts each rank in
    its own session), else to ``pid`` alone; a process already gone is skipped."""
    try:
        if os.getpgid(pid) == pid:
            os.killpg(pid, signum)
        else:
            os.kill(pid, signum)
    except ProcessLookupError:
        pass


def _reason(failure) -> str:
    """What torchrun knows of why a rank failed: its error file's message (ranks whose entry
    point uses torch's ``@record``) or the signal; "" when torchrun only has its generic
    "To enable traceback see ..." hint, so the rank's own finish reason shows instead."""
    if failure.exitcode >= 0 and not os.path.isfile(failure.error_file):
        return ""
    message = failure.message
    if isinstance(message, dict):  # error files written by torch's ErrorHandler
        message = message.get("message", "")
    return str(message or "")[:1000]


#: Attribute set on each of torchrun's failure records that existed when it began stopping
#: the other ranks (see :func:`note_failures_before_stop`).
_BEFORE_STOP = "traceml_before_stop"
#: The failure records (local rank -> ProcessFailure) of the process context whose stop began
#: first, once one began: what a stop signal that cuts torchrun's own short leaves to record.
_failures_at_stop: dict = {}


def note_failures_before_stop() -> None:
    """Mark which failed ranks ended on their own and which torchrun stopped.

    torchrun polls its ranks; once one has failed it stops the rest (SIGTERM, SIGKILL after
    its shutdown timeout) and records their ends in the same failure map, so the map alone
    cannot tell a rank that got SIGTERM from a user, a scheduler or itself from one torchrun
    stopped. Its process context's ``close()`` is where the stop begins: every failure it
    holds then is marked (once per context; the agent closes it again at shutdown). Where a
    torch release lacks the private ``_failures`` map nothing is marked, and every failure
    counts as the rank's own.
    """
    from torch.distributed.elastic.multiprocessing.api import PContext

    close = PContext.close

    def close_marking_failures(self, *args, **kwargs):
        if not getattr(self, _BEFORE_STOP, False):
            setattr(self, _BEFORE_STOP, True)
            failures = getattr(self, "_failures", {})
            for failure in failures.values():
                setattr(failure, _BEFORE_STOP, True)
            if not _failures_at_stop:
                _failures_at_stop.update(failures)
        return close(self, *args, **kwargs)

    PContext.close = close_marking_failures  # type: ignore[method-assign]


#: Whether this torchrun started ranks (:func:`note_ranks_started`): a torchrun that fails in
#: its rendezvous before that leaves its ranks ``not_started``.
_ranks_started = False


def note_ranks_started(path: str) -> None:
    """Note when torchrun first starts its ranks (its process context's ``start()``, once an
    attempt's rendezvous is done): in this process, so that a failure of torchrun itself tells
    ranks that ran from ranks that never did, and in the record ``{"ranks_started": true}`` at
    ``path``, so that the launcher tells them apart for a torchrun that never records its end
    (stopped while it waits in its rendezvous, where it cannot take the signal, then killed).
    :func:`main` writes ``{"ranks_started": false}`` there before, once torch is imported: the
    launcher then knows torchrun is in its rendezvous, not still starting.
    """
    from torch.distributed.elastic.multiprocessing.api import PContext

    start = PContext.start

    def start_noting(self, *args, **kwargs):
        global _ranks_started
        if not _ranks_started:
            _ranks_started = True
            _record(write_json, path, {"ranks_started": True})
        return start(self, *args, **kwargs)

    PContext.start = start_noting  # type: ignore[method-assign]


#: Longest torchrun error kept in the record, characters.
ERROR_MAX_CHARS = 1000


def _write_torchrun_error(path: Path, exc: BaseException) -> None:
    """``{"failed": [], "torchrun_error", "ranks_started"}`` to ``path``: torchrun itself
    failed (not one of its ranks): the exception's type and first line, and whether it had
    started ranks before."""
    first_line = (str(exc).strip().splitlines() or [""])[0]
    error = f"{type(exc).__name__}: {first_line}" if first_line else type(exc).__name__
    write_json(
        path,
        {"failed": [], "torchrun_error": error[:ERROR_MAX_CHARS], "ranks_started": _ranks_started},
    )


def _record(write, path: str, *args) -> None:
    """``write(path, *args)``; a failure to write is logged, never raised (torchrun's own
    work must go on)."""
    try:
        write(Path(path), *args)
    except OSError as err:
        log.get("launcher").warning(f"cannot record how torchrun's ranks ended: {err}")


def _write_failures(path: Path, failures: dict) -> None:
    """``{"failed": [...], "ranks_started": true}`` to ``path``, one entry per failed rank
    (``failures``: torchrun's, by global rank): its local rank, exit code or signal,
    torchrun's reason, and ``stopped`` (true: torchrun stopped it after another rank had
    failed, :func:`note_failures_before_stop`)."""
    marked = any(getattr(f, _BEFORE_STOP, False) for f in failures.values())
    ranks = [
        _failure_entry(failure, stopped=marked and not getattr(failure, _BEFORE_STOP, False))
        for _, failure in sorted(failures.items())
    ]
    write_json(path, {"failed": ranks, "ranks_started": True})


def _write_failures_at_signal(path: Path) -> None:
    """``{"failed": [...], "partial": true, "ranks_started"}`` to ``path``: a stop signal cut
    torchrun short, so it never reported its ranks' ends; listed are the ranks that had
    failed of their own before its stop began (:data:`_failures_at_stop`), and a rank not
    listed did not necessarily complete (``partial``)."""
    ranks = [_failure_entry(f, stopped=False) for _, f in sorted(_failures_at_stop.items())]
    write_json(path, {"failed": ranks, "partial": True, "ranks_started": _ranks_started})


def _failure_entry(failure, *, stopped: bool) -> dict:
    """One rank's entry of the record: ``local_rank``, ``exit_code`` or ``signal`` (the other
    None), torchrun's ``reason`` and ``stopped``."""
    code = failure.exitcode
    return {
        "local_rank": int(failure.local_rank),
        "exit_code": code if code >= 0 else None,
        "signal": -code if code < 0 else None,
        "reason": _reason(failure),
        "stopped": stopped,
    }


#: The module torchrun runs in each rank for zero-code steps (``SCRIPT ARGS`` follow).
AUTORUN_MODULE = "traceml.sdk.autorun"


def _autorun_script(argv: list[str]) -> str:
    """The script torchrun runs through the zero-code entry, or "" (no entry in ``argv``)."""
    for i, arg in enumerate(argv[:-2]):
        if arg == "--module" and argv[i + 1] == AUTORUN_MODULE:
            return argv[i + 2]
    return ""


#: How the launcher passes torchrun the log directory it made (``torchrun_argv``).
LOG_DIR_FLAG = "--log-dir="


def _log_dir(argv: list[str]) -> str:
    """The log directory ``argv`` gives torchrun before the script, or "" (none given)."""
    for arg in argv:
        if not arg.startswith("-"):  # the script: its own arguments follow
            break
        if arg.startswith(LOG_DIR_FLAG):
            return arg[len(LOG_DIR_FLAG) :]
    return ""


def _on_stop_signals(handler) -> None:
    """``handler`` (a function, or ``signal.SIG_IGN``) for every one of :data:`STOP_SIGNALS`."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, handler)


def _removing_log_dir(log_dir: str):
    """A signal handler for torchrun's start-up, before torch has installed its own: remove
    ``log_dir`` (a launcher SIGKILLed then sends ``PR_SET_PDEATHSIG`` SIGTERM while torch is
    still importing), then die of the signal as without a handler."""

    def handle(signum, _frame) -> None:
        remove_log_dir(log_dir)
        orphans.die_of(signum)

    return handle


def main() -> None:
    """Run torchrun with ``sys.argv[1:]``; record failed ranks; re-raise like torchrun."""
    launcher_env = os.environ.pop(LAUNCHER_PID_ENV, "")
    launcher = int(launcher_env) if launcher_env.isdigit() else None
    path = os.environ.pop(RANK_ENDS_FILE_ENV, "")
    argv = sys.argv[1:]
    os.environ[orphans.TORCHRUN_PID_ENV] = str(os.getpid())  # each rank dies with this process
    log_dir = ""
    if launcher is not None:
        log_dir = _log_dir(argv)
        _on_stop_signals(_removing_log_dir(log_dir))  # until torch's own handlers replace it
        # here, not in a preexec_fn, which would make the launcher fork() (see
        # traceml.launcher.torchrun.TorchrunProcess.start)
        orphans.die_with_parent(launcher)
        threading.Thread(
            target=reap_when_orphaned,
            args=(launcher, log_dir),
            name="traceml-orphan-reaper",
            daemon=True,
        ).start()
    # imported once the launcher's death is covered: importing torch takes about a second
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    if path:  # the record this marking is for
        note_failures_before_stop()
        note_ranks_started(path)
        _record(write_json, path, {"ranks_started": False})  # torch imported: the rendezvous
    try:
        torchrun_main(argv)
    except ChildFailedError as exc:
        script = _autorun_script(argv)
        if script:
            exc.name = script
            exc.args = (exc.format_msg(),)
        if path:
            _record(_write_failures, path, exc.failures)
        raise
    except SignalException:
        if path:
            _record(_write_failures_at_signal, path)
        if launcher is not None:
            # a launcher SIGKILLed sends one SIGTERM per thread of it that exits
            # (PR_SET_PDEATHSIG follows each reparenting): torch's handler would raise the next
            # one here, so torchrun, stopping already, ignores them
            _on_stop_signals(signal.SIG_IGN)
            if _wait_gone(launcher, LAUNCHER_DEATH_WAIT_S):
                remove_log_dir(log_dir)  # the launcher's death stopped torchrun
        raise
    except Exception as exc:  # torchrun's own failure: its rendezvous, its store
        if path:
            _record(_write_torchrun_error, path, exc)
        raise


if __name__ == "__main__":
    main()
