"""Seconds the run's lifecycle takes around a fault, under real `traceml run` (2 gloo ranks):

(a) from SIGTERM to every process of the run at once (what scancel does) to node 0's
    ``final_summary.json`` on disk, and to the launcher's return; one run per sample;
(b) from a SIGKILL of node 0's aggregator to a replacement serving (the standard gRPC health
    check says SERVING at a new pid); ``--kills`` samples in one run, which allows that many
    restarts (``--aggregator-max-restarts``);
(c) from the last step (its end by the script's own clock, ``faulty_ddp.py --step-log``) to
    the launcher's return, in a run whose aggregator was paused (SIGSTOP) for
    ``--outage-sec`` while training went on: what the outage leaves for the end (the steps
    it buffered are sent, finalization); one run per sample.

Prints the median and the range of each. The targets: (a) under 20 s, (b) about 2 s, (c) no
more than a run without an outage takes (a few seconds). A busy machine only ever adds time
(python and torch start slower).

    .venv/bin/python benchmarks/lifecycle.py --runs 3 --kills 5 --outage-runs 3
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


def start(
    tmp: Path, name: str, port: int, *extra: str, steps: int = 1000000, step_log: Path | None = None
) -> subprocess.Popen:
    argv = [
        sys.executable,
        "-m",
        "traceml",
        "run",
        SCRIPT,
        "--nproc-per-node=2",
        "--run-name",
        name,
        "--aggregator-port",
        str(port),
        "--logs-dir",
        str(tmp / "logs"),
        *extra,
        "--",
        "--steps",
        str(steps),
        "--step-sleep",
        "0.05",
    ]
    if step_log is not None:
        argv += ["--step-log", str(step_log)]
    return subprocess.Popen(
        argv,
        cwd=tmp,
        env=ENV,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
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


def outage_to_return(tmp: Path, index: int, outage_s: float) -> float:
    """s from the last step to the launcher's return, after a pause of the aggregator."""
    name = f"outage-{index}"
    step_log = tmp / f"{name}-steps"
    step_log.mkdir()
    # At 0.05 s a step at least: training outlasts the pause by several seconds.
    launcher = start(tmp, name, free_port(), steps=int((outage_s + 8) / 0.05), step_log=step_log)
    wait_training(tmp, name, launcher)
    manifest = tmp / "logs" / name / "manifest.json"
    pid = json.loads(manifest.read_text())["aggregator"]["pid"]
    os.kill(pid, signal.SIGSTOP)
    time.sleep(outage_s)
    os.kill(pid, signal.SIGCONT)
    launcher.wait(300)
    returned = time.time()
    last_step = max(
        float(line.split()[2])
        for log in step_log.glob("rank*.log")
        for line in log.read_text().splitlines()
    )
    return returned - last_step


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=3, help="SIGTERM runs, one sample each")
    p.add_argument("--kills", type=int, default=5, help="aggregator kills in one run")
    p.add_argument("--outage-runs", type=int, default=3, help="runs with a paused aggregator")
    p.add_argument("--outage-sec", type=float, default=30.0, help="length of each pause, s")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        terms = [sigterm_to_summary(tmp, i) for i in range(args.runs)]
        kills = kill_to_serving(tmp, args.kills)
        outages = [outage_to_return(tmp, i, args.outage_sec) for i in range(args.outage_runs)]
    to_summary = [t for t, _ in terms]
    to_return = [r for _, r in terms]
    print(
        f"(a) SIGTERM to every process -> summary written: median {median(to_summary):.2f} s "
        f"(range {min(to_summary):.2f}-{max(to_summary):.2f}, {len(terms)} runs); "
        f"-> launcher returned: median {median(to_return):.2f} s"
    )
    print(
        f"(b) aggregator SIGKILL -> replacement serving: median {median(kills):.2f} s "
        f"(range {min(kills):.2f}-{max(kills):.2f}, {len(kills)} kills)"
    )
    print(
        f"(c) {args.outage_sec:g} s aggregator pause: last step -> launcher returned: median "
        f"{median(outages):.2f} s (range {min(outages):.2f}-{max(outages):.2f}, "
        f"{len(outages)} runs)"
    )


if __name__ == "__main__":
    main()
