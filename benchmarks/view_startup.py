"""Benchmark: how long ``traceml view`` of a saved summary takes, start to exit, and what its
imports cost; and what importing the offline library (a notebook's ``traceml.analysis`` and
``traceml.report``) costs.

Each trial runs, in fresh interpreters:

* ``view``: ``python -m traceml view SUMMARY`` (its output captured), wall s from the start of
  the process to its exit, and its CPU s (user + system: what a busy machine inflates least);
* ``view imports``: the same command under ``python -X importtime``: every import's own time,
  summed over all modules and per top-level package (``traceml``, ``typer``, ``pydantic``,
  ``numpy``, ``grpc``, ``google`` for protobuf, ``other``: the standard library and the rest);
  ms;
* ``library``: ``python -c "import traceml.analysis.summary, traceml.report.html"`` (the whole
  analysis and every report format, what a notebook loads), wall s, and whether it loaded gRPC.

With ``--baseline DIR`` (another source tree, e.g. ``git archive 8672646 | tar -x -C /tmp/base``)
every measurement is also made with that tree (``PYTHONPATH=DIR``), the trials alternating
between the two, and the medians are printed side by side. The interpreter is this one; a busy
machine only adds time, to both sides alike.

Usage: ``python benchmarks/view_startup.py [--trials 9] [--summary PATH] [--baseline DIR]``.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: A stored summary of the test suite (4 ranks on 2 nodes, an input straggler).
DEFAULT_SUMMARY = ROOT / "tests" / "golden" / "cpu_input_straggler.json"
#: Top-level packages whose import time is shown on its own; the rest is ``other``.
PACKAGES = ("traceml", "typer", "pydantic", "numpy", "grpc", "google")
#: The target of issue 22 for ``traceml view`` of a summary, s.
VIEW_TARGET_S = 0.5
LIBRARY = "import sys, traceml.analysis.summary, traceml.report.html; print('grpc' in sys.modules)"


def _run(argv: list[str], tree: Path) -> subprocess.CompletedProcess:
    """``argv`` run with the source tree ``tree`` (``PYTHONPATH``; in ``tree``, since ``python
    -c``/``-m`` put the working directory first on the path), output captured as text."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    return subprocess.run(argv, cwd=tree, env=env, capture_output=True, text=True)


def _timed(argv: list[str], tree: Path) -> tuple[float, float, str]:
    """Seconds from starting ``argv`` to its exit, its CPU seconds (user + system), and its
    stdout.

    Raises:
        RuntimeError: it exited with a non-zero code.
    """
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = _run(argv, tree)
    elapsed = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    if proc.returncode:
        raise RuntimeError(
            f"{' '.join(argv)} (PYTHONPATH={tree}): exit {proc.returncode}\n{proc.stderr}"
        )
    return elapsed, cpu, proc.stdout


def import_ms(summary: Path, tree: Path) -> dict[str, float]:
    """Own import time of every module loaded by ``traceml view SUMMARY``, ms, summed per
    top-level package (:data:`PACKAGES`, ``other``) and in all (``total``)."""
    argv = [sys.executable, "-X", "importtime", "-m", "traceml", "view", str(summary)]
    proc = _run(argv, tree)
    sums = dict.fromkeys((*PACKAGES, "other"), 0.0)
    for line in proc.stderr.splitlines():
        if not line.startswith("import time:") or "self [us]" in line:
            continue
        own_us, _, name = line.removeprefix("import time:").split("|")
        top = name.strip().split(".")[0]
        sums[top if top in PACKAGES else "other"] += int(own_us) / 1000
    sums["total"] = sum(sums.values())
    return sums


def trial(summary: Path, tree: Path) -> dict[str, float]:
    """One measurement of every figure with the source tree ``tree``."""
    view_s, view_cpu_s, _ = _timed([sys.executable, "-m", "traceml", "view", str(summary)], tree)
    library_s, _, grpc = _timed([sys.executable, "-c", LIBRARY], tree)
    figures = {
        "view s": view_s,
        "view CPU s": view_cpu_s,
        "library s": library_s,
        "library loads grpc": float(grpc.strip() == "True"),
    }
    figures.update({f"view imports {k} ms": v for k, v in import_ms(summary, tree).items()})
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=9)
    parser.add_argument("--summary", type=Path, default=DEFAULT_SUMMARY)
    parser.add_argument("--baseline", type=Path, help="another source tree, timed alternately")
    args = parser.parse_args()
    args.summary = args.summary.resolve()
    trees = {"this tree": ROOT}
    if args.baseline:
        trees["baseline"] = args.baseline.resolve()
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
    for _ in range(args.trials):
        for name, tree in trees.items():
            runs[name].append(trial(args.summary, tree))
    keys = list(runs["this tree"][0])
    width = max(map(len, keys))
    print(
        f"medians of {args.trials} trials, {args.summary.name}; target: view <= {VIEW_TARGET_S} s"
    )
    print(f"{'':<{width}}  " + "  ".join(f"{name:>10}" for name in trees))
    for key in keys:
        cells = [statistics.median(r[key] for r in runs[name]) for name in trees]
        print(f"{key:<{width}}  " + "  ".join(f"{c:>10.3f}" for c in cells))


if __name__ == "__main__":
    main()
