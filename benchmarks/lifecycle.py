"""Seconds the run's lifecycle takes around a fault, under real `traceml run` (2 gloo ranks):

(a) from SIGTERM to every process of the run at once (what scancel does) to node 0's
    ``final_summary.json`` on disk, and to the launcher's return; one run per sample;
(b) from a SIGKILL of node 0's aggregator to a replacement serving (the standard gRPC health
    check says SERVING at a new pid); ``--kills`` samples in one run, which allows that many
    restarts (``--aggregator-max-restarts``).

Prints the median and the range of each. The targets: (a) under 20 s, (b) about 2 s. A busy
machine only ever adds time (python and torch start slower).

    .venv/bin/python benchmarks/lifecycle.py --runs 3 --kills 5
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from _common import ROOT, free_port, median

from traceml.launcher.aggregator import wait_serving

SCRIPT = str(ROOT / "tests" / "scripts" / "faulty_ddp.py")
ENV = {**os.environ, "TRACEML_FLUSH_INTERVAL_SEC": "0.2"}


def start(tmp: Path, name: str, port: int, *extra: str) -> subprocess.Popen:
    argv = [
        sys.executable, "-m", "traceml", "run", SCRIPT, "--nproc-per-node=2", "--run-name", name,
        "--aggregator-port", str(port), "--logs-dir", str(tmp / "logs"), *extra,
        "--", "--steps", "1000000", "--step-sleep", "0.05",
    ]
    return subprocess.Popen(
        argv, cwd=tmp, env=ENV, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        stderr=open(tmp / f"{name}.err", "wb"),
    )


def wait_training(tmp: Path, name: str, launcher: subprocess.Popen) -> None:
    log = tmp / "logs" / name / "nodes" / "node_0" / "training.stdout.log"
    while not (log.exists() and "faulty_ddp: training" in log.read_text()):
        if launcher.poll() is not None:
            raise SystemExit((tmp / f"{name}.err").read_text())
        time.sleep(0.05)
    time.sleep(1.0)  # steps are streaming


def sigterm_to_summary(tmp: Path, index: int) -> tuple[float, float]:
    """(s to the summary file, s to the launcher's return) after SIGTERM to every process."""
    name = f"term-{index}"
    launcher = start(tmp, name, free_port())
    wait_training(tmp, name, launcher)
    root = psutil.Process(launcher.pid)
    processes = [root] + root.children(recursive=True)
    signalled = time.time()
    for p in processes:
        try:
            p.send_signal(signal.SIGTERM)
        except psutil.NoSuchProcess:
            pass
    launcher.wait(120)
    returned = time.time()
    summary = tmp / "logs" / name / "final_summary.json"
    return summary.stat().st_mtime - signalled, returned - signalled


def kill_to_serving(tmp: Path, kills: int) -> list[float]:
    """s from each SIGKILL of the aggregator to its replacement serving, in one run."""
    port = free_port()
    launcher = start(tmp, "kills", port, "--aggregator-max-restarts", str(kills))
    wait_training(tmp, "kills", launcher)
    manifest = tmp / "logs" / "kills" / "manifest.json"
    samples = []
    for _ in range(kills):
        pid = json.loads(manifest.read_text())["aggregator"]["pid"]
        killed = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        while json.loads(manifest.read_text())["aggregator"]["pid"] == pid:
            time.sleep(0.01)
        wait_serving(f"127.0.0.1:{port}", 60)
        samples.append(time.monotonic() - killed)
        time.sleep(1.0)  # the ranks resend and stream again
    launcher.send_signal(signal.SIGTERM)
    launcher.wait(120)
    return samples


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=3, help="SIGTERM runs, one sample each")
    p.add_argument("--kills", type=int, default=5, help="aggregator kills in one run")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        terms = [sigterm_to_summary(tmp, i) for i in range(args.runs)]
        kills = kill_to_serving(tmp, args.kills)
    to_summary = [t for t, _ in terms]
    to_return = [r for _, r in terms]
    print(f"(a) SIGTERM to every process -> summary written: median {median(to_summary):.2f} s "
          f"(range {min(to_summary):.2f}-{max(to_summary):.2f}, {len(terms)} runs); "
          f"-> launcher returned: median {median(to_return):.2f} s")
    print(f"(b) aggregator SIGKILL -> replacement serving: median {median(kills):.2f} s "
          f"(range {min(kills):.2f}-{max(kills):.2f}, {len(kills)} kills)")


if __name__ == "__main__":
    main()
