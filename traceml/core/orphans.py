"""Processes that must not outlive their parent: node r's torchrun its launcher, a rank its
torchrun.

Under ``traceml run`` a launcher that dies in any way (SIGKILL included) takes its processes
with it (docs/distributed-training.md, "The aggregator dies", its last paragraph). The kernel
does the signalling (``PR_SET_PDEATHSIG``), so it holds however the parent dies: torchrun gets
SIGTERM when its launcher dies, and each rank gets SIGTERM when its torchrun dies, which a
torchrun that stopped its ranks first does only after they ended. Linux only; elsewhere
nothing is set. :func:`die_of` ends a process as a signal's default action does, for the
handlers (the SDK's SIGTERM flush, torchrun's start-up) that must act first.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

#: Environment variable with torchrun's process id, for its ranks (set by
#: ``traceml.launcher.torchrun_main``; read by :func:`die_with_torchrun` in each rank).
TORCHRUN_PID_ENV = "TRACEML_TORCHRUN_PID"
#: ``prctl`` option from <linux/prctl.h>.
PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int, signum: int = signal.SIGTERM) -> bool:
    """Have the kernel send ``signum`` to this process when ``parent_pid``, its parent, dies
    (strictly: when the parent's thread that started it ends); True when set.

    A parent that died before the ``prctl`` took effect shows as a changed parent, and
    ``signum`` is sent at once. Not Linux, or no ``prctl``: False, nothing set.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signum, 0, 0, 0)
    except (OSError, AttributeError):
        return False
    if os.getppid() != parent_pid:
        os.kill(os.getpid(), signum)
    return True


def die_with_torchrun() -> bool:
    """In a rank that ``traceml run``'s torchrun started (its parent is the process named by
    :data:`TORCHRUN_PID_ENV`): SIGTERM when that torchrun dies; True when set. A process the
    rank starts itself (a DataLoader worker, ``torch.multiprocessing.spawn``) inherits the
    variable but has another parent, and is left alone."""
    torchrun = os.environ.get(TORCHRUN_PID_ENV, "")
    if not torchrun.isdigit() or os.getppid() != int(torchrun):
        return False
    return die_with_parent(int(torchrun))


def die_of(signum: int = signal.SIGTERM) -> None:
    """End this process as ``signum``'s default action does (killed by it, as its parent
    sees), from any thread: the disposition back to ``SIG_DFL``, then the signal to itself.
    Where the signal stays blocked in every thread, exit ``128 + signum`` after 5 s (what a
    shell reports for it). Never returns."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signum, signal.SIG_DFL)
    else:  # signal.signal() is main-thread only; the C library's is not
        libc = ctypes.CDLL(None)
        libc.signal.argtypes = (ctypes.c_int, ctypes.c_void_p)
        libc.signal.restype = ctypes.c_void_p
        libc.signal(signum, 0)  # 0: SIG_DFL
    os.kill(os.getpid(), signum)
    time.sleep(5.0)
    os._exit(128 + signum)
