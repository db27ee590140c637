"""The ingest benchmark's CI run (``benchmarks/ingest.py --short``): both wires, both pacings,
every record checked in the store by the benchmark itself. It must finish; the targets are for
the full run (docs/scale.md), not for this one."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.mark.slow
def test_the_short_ingest_benchmark_runs_both_wires_side_by_side():
    result = subprocess.run(
        [sys.executable, str(BENCHMARKS / "ingest.py"), "--short"],
        cwd=BENCHMARKS, capture_output=True, text=True, timeout=300, check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    runs = re.findall(r"^\s+(stream|unary)\s+8 ranks, a batch every ([\d.]+) s", result.stdout,
                      re.MULTILINE)
    assert runs == [("stream", "0"), ("unary", "0"), ("stream", "0.2"), ("unary", "0.2")]
    # 8 ranks x 3 batches x 10 records each time, every one found in the store.
    assert result.stdout.count("240 records in") == 4
    assert result.stdout.count("stream against unary, 8 ranks") == 2
