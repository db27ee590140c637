"""Forks while the telemetry client reconnects all along to an aggregator that is not there.

``python fork_outage.py HOST:PORT FORKS``: nothing listens at HOST:PORT, and the client retries
at once (its first backoff set to 0.5 ms), so its sender thread is making a channel and a
stream, or closing them, at almost any moment; the script forks FORKS children (each exits at
once) and prints ``forks N bad B worst_s W send_failures F``: children that did not exit 0,
the longest fork() in s, and the client's failed sends (evidence that it was reconnecting).
"""

import os
import sys
import time

from traceml.sdk import client as client_mod
from traceml.sdk.client import STEPS, ClientConfig, TelemetryClient

client_mod.FIRST_BACKOFF_S = 0.0005
target, forks = sys.argv[1], int(sys.argv[2])
client = TelemetryClient(
    target,
    "outage",
    rank=0,
    warn=lambda line: None,
    config=ClientConfig(
        flush_interval_s=0.001, batch_max_records=1, rpc_timeout_s=2.0, max_backoff_s=0.001
    ),
)
client.submit(STEPS, {"step": 0, "end_us": 1, "step_us": 1})
while client.stats.send_failures < 3:
    time.sleep(0.001)
worst, bad = 0.0, 0
for _ in range(forks):
    started = time.monotonic()
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    worst = max(worst, time.monotonic() - started)
    _, status = os.waitpid(pid, 0)
    bad += os.waitstatus_to_exitcode(status) != 0
print(f"forks {forks} bad {bad} worst_s {worst:.3f} send_failures {client.stats.send_failures}")
sys.stdout.flush()
os._exit(0)  # the sender thread is still retrying: no interpreter shutdown around it
