"""Waiting for the launcher's child processes to exit without polling them.

While training runs, node 0's launcher waits for torchrun to exit and watches its aggregator.
Polling both (``Popen.wait(timeout)`` sleeps and calls ``waitpid`` up to every 50 ms) woke the
launcher ~20 times a second: 4.2 ms of CPU a second on the loaded 2-core test machine, taken
from training on a saturated node. :class:`ExitWatch` sleeps in ``poll(2)`` on one *pidfd* per
process (Linux >= 5.3), which becomes readable as the process exits: the launcher wakes when a
child exits or when its own next watch is due, and sees a child's exit at once.
"""

from __future__ import annotations

import os
import select
import subprocess

#: Longest sleep between two looks at the processes where pidfds are missing (another OS, an
#: older kernel), s.
FALLBACK_POLL_S = 0.2


class ExitWatch:
    """Sleeps until one of some processes exits, or a timeout.

    Holds one pidfd per process it was asked about (closed once that process is no longer
    asked about, and by :meth:`close`).
    """

    def __init__(self) -> None:
        self._fds: dict[int, int] = {}  # pid -> pidfd
        self._pidfds = hasattr(os, "pidfd_open")

    def wait(self, processes: list[subprocess.Popen], timeout_s: float) -> None:
        """Return once one of ``processes`` has exited (not reaped: ``Popen.poll()`` does that),
        or after ``timeout_s`` seconds (at once for one that has exited already).

        Where pidfds are missing it waits on the first process in steps of at most
        :data:`FALLBACK_POLL_S`, as a polling loop would.
        """
        timeout_s = max(0.0, timeout_s)
        if self._pidfds:
            try:
                self._wait_pidfds(processes, timeout_s)
                return
            except OSError:  # no pidfd support in this kernel: poll from now on
                self.close()
                self._pidfds = False
        try:
            processes[0].wait(min(timeout_s, FALLBACK_POLL_S))
        except subprocess.TimeoutExpired:
            pass

    def _wait_pidfds(self, processes: list[subprocess.Popen], timeout_s: float) -> None:
        poller = select.poll()
        wanted = {p.pid for p in processes}
        for pid in set(self._fds) - wanted:
            os.close(self._fds.pop(pid))
        for process in processes:
            if process.returncode is not None:
                return  # reaped already
            if process.pid not in self._fds:
                try:
                    self._fds[process.pid] = os.pidfd_open(process.pid)
                except ProcessLookupError:
                    return  # reaped by someone else: exited
            poller.register(self._fds[process.pid], select.POLLIN)
        poller.poll(timeout_s * 1000)

    def close(self) -> None:
        """Close every pidfd."""
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
