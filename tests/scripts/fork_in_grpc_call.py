"""Forks while a thread is inside gRPC, in a process that imported TraceML's client first.

``python fork_in_grpc_call.py HOST:PORT FORKS``: nothing listens at HOST:PORT; a call waits for
it (``wait_for_ready``), so grpcio's channel thread sits inside gRPC (in its completion queue)
at every fork. gRPC's own fork handlers, when they are on, say so on stderr at such a fork
("Other threads are currently calling into gRPC, skipping fork() handlers"); when they run at
a fork with no such thread, they can hang it (see ``GRPC_FORK_SUPPORT_ENV`` in
``traceml/core/transport.py``). Prints ``exit codes C1 C2 ...``: the children's (each exits at
once).
"""

import os
import sys
import threading
import time

import traceml.sdk.client  # noqa: F401  (as traceml.init() does: before anything imports grpc)

# isort: split
import grpc

target, forks = sys.argv[1], int(sys.argv[2])
channel = grpc.insecure_channel(target)
future = channel.unary_unary("/traceml.test.Nothing/Wait").future(
    b"", timeout=60, wait_for_ready=True
)
deadline = time.monotonic() + 10
(spin,) = [t for t in threading.enumerate() if t is not threading.main_thread()]


def blocked() -> bool:
    """Whether gRPC's channel thread sleeps (in its completion queue: this thread holds no
    lock it could wait for)."""
    with open(f"/proc/self/task/{spin.native_id}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0] == "S"


codes = []
for _ in range(forks):
    while not blocked() and time.monotonic() < deadline:
        time.sleep(0.001)
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    codes.append(os.waitstatus_to_exitcode(status))
print("exit codes", *codes)
sys.stdout.flush()
os._exit(0)  # the call is still waiting: no interpreter shutdown around it
