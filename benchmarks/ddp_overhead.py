"""Benchmarks (b) and (c): a 2-rank gloo DDP job under `traceml run` vs plain torchrun.

The same job (``examples/ddp_minimal.py``) runs alternately both ways, in ABBA order so a
drift of the machine's load hits both alike, ``--pairs`` times each:

* A: ``traceml run examples/ddp_minimal.py --nproc-per-node=2 ... -- --steps N``;
* B: ``python -m torch.distributed.run --nproc-per-node=2 examples/ddp_minimal.py --steps N``
  (the script's ``traceml.init()`` warns and does nothing).

(b) training-loop time: what rank 0 prints (``trained N steps in T s``), A/B ratio per pair
and the median ratio (target <= 1.02).
(c) whole-process wall time, start to exit: A − B per pair and the median (target <= +1.5 s),
with where A's extra time goes, from the run manifest's lifecycle (Unix s of each event), and
the CPU time of all the job's processes (launcher, aggregator, torchrun, ranks), which other
load on the machine does not inflate the way it inflates wall time.

With ``--zero-code`` the pair is instead, both under ``traceml run``, alternated the same way:

* E (explicit): the job as above, its steps marked by ``traceml.trace_step``;
* Z (zero-code): the same job with ``--zero-code`` (no TraceML call in the script: steps from
  the optimizer hooks, forward from the DDP wrapper, see docs/frameworks.md);

(d) training-loop time Z/E per pair and the median ratio (target <= 1.01); and, from each run's
telemetry (rank 0), the median step time after step 0 and step 0's time (zero-code finds its
root model as its first step opens: a one-time cost there, not a per-step one).

Usage: ``python benchmarks/ddp_overhead.py [--pairs 5] [--steps 300] [--zero-code]``.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import re
import resource
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import ROOT, free_port, median

SCRIPT = ROOT / "examples" / "ddp_minimal.py"
_TRAINED = re.compile(r"trained (\d+) steps in ([\d.]+) s")


def env() -> dict:
    clean = dict(os.environ)
    for name in ("TRACEML_AGGREGATOR", "TRACEML_RUN_NAME", "TRACEML_LAUNCHED"):
        clean.pop(name, None)
    return clean


def run(argv: list[str], cwd: Path) -> tuple[float, float, float]:
    """(whole-process wall s, training-loop s, CPU s of every process of the job)."""
    cpu_before = _children_cpu_s()
    start = time.perf_counter()
    result = subprocess.run(argv, cwd=cwd, env=env(), capture_output=True, text=True, check=False)
    wall = time.perf_counter() - start
    if result.returncode != 0:
        sys.exit(f"job failed ({result.returncode}): {' '.join(argv)}\n{result.stderr[-2000:]}")
    loop = float(_TRAINED.search(result.stdout).group(2))
    return wall, loop, _children_cpu_s() - cpu_before


def _children_cpu_s() -> float:
    """User + system CPU s of every waited-for descendant (each job waits for its own)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def traceml_job(cwd: Path, name: str, steps: int, *script_args: str) -> list[str]:
    return [
        sys.executable, "-m", "traceml", "run", str(SCRIPT), "--nproc-per-node=2",
        "--run-name", name, "--aggregator-port", str(free_port()), "--logs-dir", str(cwd),
        "--", "--steps", str(steps), *script_args,
    ]


def plain_job(steps: int) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", str(SCRIPT),
        "--steps", str(steps),
    ]


def phases(run_dir: Path, start_unix: float, end_unix: float) -> dict[str, float]:
    """Seconds between the launcher's lifecycle events (from its manifests), in order, then how
    long its aggregator took to serve (which overlaps the start of training)."""
    run = json.loads((run_dir / "manifest.json").read_text())["lifecycle"]
    node = json.loads((run_dir / "nodes" / "node_0" / "manifest.json").read_text())["lifecycle"]
    points = [
        ("launch", start_unix), ("started", run["started"]),
        ("training_started", run["training_started"]),
        ("training_ended", node["training_ended"]), ("finalized", run["finalized"]),
        ("ended", run["ended"]), ("exit", end_unix),
    ]
    serial = {f"{a}->{b}": tb - ta for (a, ta), (b, tb) in itertools.pairwise(points)}
    overlapped = run["aggregator_serving"] - run["started"]
    return serial | {"started->aggregator_serving (overlaps)": overlapped}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--zero-code", action="store_true", help="zero-code vs explicit steps")
    args = parser.parse_args()
    if args.zero_code:
        zero_code_vs_explicit(args.pairs, args.steps)
        return
    walls: dict[str, list[float]] = {"traceml": [], "plain": []}
    loops: dict[str, list[float]] = {"traceml": [], "plain": []}
    cpus: dict[str, list[float]] = {"traceml": [], "plain": []}
    launcher: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory() as tmp:
        cwd = Path(tmp)
        for i in range(args.pairs):
            order = ("traceml", "plain") if i % 2 == 0 else ("plain", "traceml")
            for kind in order:
                if kind == "traceml":
                    name = f"bench-{i}"
                    start_unix = time.time()
                    wall, loop, cpu = run(traceml_job(cwd, name, args.steps), cwd)
                    launcher.append(phases(cwd / name, start_unix, start_unix + wall))
                else:
                    wall, loop, cpu = run(plain_job(args.steps), cwd)
                walls[kind].append(wall)
                loops[kind].append(loop)
                cpus[kind].append(cpu)
            print(f"  pair {i}: loop {loops['traceml'][-1]:.3f} s vs {loops['plain'][-1]:.3f} s, "
                  f"wall {walls['traceml'][-1]:.2f} s vs {walls['plain'][-1]:.2f} s", flush=True)

    ratios = [a / b for a, b in zip(loops["traceml"], loops["plain"])]
    deltas = [a - b for a, b in zip(walls["traceml"], walls["plain"])]
    print(f"(b) training loop, 2-rank gloo DDP, {args.steps} steps, {args.pairs} A/B pairs "
          "(target ratio <= 1.02)")
    print(f"  median loop: traceml run {median(loops['traceml']):.3f} s, "
          f"plain torchrun {median(loops['plain']):.3f} s")
    print(f"  ratio per pair: {', '.join(f'{r:.3f}' for r in ratios)}; "
          f"median {median(ratios):.3f}; ratio of medians "
          f"{median(loops['traceml']) / median(loops['plain']):.3f}")
    print("(c) whole-process wall time (target <= +1.5 s)")
    print(f"  median wall: traceml run {median(walls['traceml']):.2f} s, "
          f"plain torchrun {median(walls['plain']):.2f} s")
    print(f"  extra per pair: {', '.join(f'{d:+.2f}' for d in deltas)} s; "
          f"median {median(deltas):+.2f} s")
    print(f"  CPU of all the job's processes, median: traceml run {median(cpus['traceml']):.2f} s, "
          f"plain torchrun {median(cpus['plain']):.2f} s "
          f"(+{median(cpus['traceml']) - median(cpus['plain']):.2f} s: what a busy machine "
          "turns into wall time)")
    print("  traceml run, median seconds between lifecycle events:")
    for key in launcher[0]:
        print(f"    {key:<40} {median([p[key] for p in launcher]):6.2f}")


def zero_code_vs_explicit(pairs: int, steps: int) -> None:
    """(d): the same job under ``traceml run``, steps marked by the script (E) or found by
    zero-code instrumentation (Z), in ABBA order; prints loop seconds and Z/E ratios."""
    loops: dict[str, list[float]] = {"explicit": [], "zero-code": []}
    step_ms: dict[str, list[float]] = {"explicit": [], "zero-code": []}
    first_ms: dict[str, list[float]] = {"explicit": [], "zero-code": []}
    with tempfile.TemporaryDirectory() as tmp:
        cwd = Path(tmp)
        for i in range(pairs):
            order = ("explicit", "zero-code") if i % 2 == 0 else ("zero-code", "explicit")
            for kind in order:
                extra = ["--zero-code"] if kind == "zero-code" else []
                _, loop, _ = run(traceml_job(cwd, f"{kind}-{i}", steps, *extra), cwd)
                loops[kind].append(loop)
                with contextlib.closing(sqlite3.connect(cwd / f"{kind}-{i}" / "telemetry.sqlite")) as db:
                    times = [r[0] / 1000 for r in db.execute(
                        "SELECT step_us FROM steps WHERE rank = 0 ORDER BY step")]
                first_ms[kind].append(times[0])
                step_ms[kind].append(median(times[1:]))
            print(f"  pair {i}: loop zero-code {loops['zero-code'][-1]:.3f} s vs explicit "
                  f"{loops['explicit'][-1]:.3f} s; median step {step_ms['zero-code'][-1]:.2f} vs "
                  f"{step_ms['explicit'][-1]:.2f} ms; step 0 {first_ms['zero-code'][-1]:.0f} vs "
                  f"{first_ms['explicit'][-1]:.0f} ms", flush=True)
    ratios = [z / e for z, e in zip(loops["zero-code"], loops["explicit"])]
    print(f"(d) training loop under traceml run, 2-rank gloo DDP, {steps} steps, {pairs} pairs "
          "(target zero-code/explicit <= 1.01)")
    print(f"  median loop: zero-code {median(loops['zero-code']):.3f} s, "
          f"explicit {median(loops['explicit']):.3f} s")
    print(f"  ratio per pair: {', '.join(f'{r:.3f}' for r in ratios)}; median {median(ratios):.3f}")
    step_ratios = [z / e for z, e in zip(step_ms["zero-code"], step_ms["explicit"])]
    print(f"  median step after step 0, ratio per pair: "
          f"{', '.join(f'{r:.3f}' for r in step_ratios)}; median {median(step_ratios):.3f}")
    print(f"  step 0, median: zero-code {median(first_ms['zero-code']):.0f} ms, "
          f"explicit {median(first_ms['explicit']):.0f} ms")


if __name__ == "__main__":
    main()
