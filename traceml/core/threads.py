"""OS names for TraceML's own threads, so their CPU time can be told apart from training's.

Python before 3.14 starts every ``threading.Thread`` under its process's OS name (the Linux
``comm``, shown by ``top -H``, ``ps -L`` and ``/proc/<pid>/task/<tid>/comm``): a rank's sender
thread looked like one of torch's. :func:`name_os_thread` gives the calling thread its
``threading`` name at the OS level too (truncated to the kernel's 15 bytes), which is how
``benchmarks/ddp_overhead.py`` measures the CPU time of each TraceML thread.
"""

from __future__ import annotations

import threading

#: Longest Linux thread name, bytes (``TASK_COMM_LEN`` less the terminating NUL).
OS_NAME_BYTES = 15


def name_os_thread(name: str | None = None) -> None:
    """Set the calling thread's OS name to ``name`` (default: its ``threading`` name).

    Writes ``/proc/self/task/<tid>/comm`` once (a thread may rename itself). Best-effort: on a
    system without it (another OS) the name stays as it was; never raises.
    """
    name = name or threading.current_thread().name
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/comm", "wb") as comm:
            comm.write(name.encode("utf-8", "replace")[:OS_NAME_BYTES])
    except OSError:
        pass
