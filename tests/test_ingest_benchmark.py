"""The ingest benchmark's CI run (``benchmarks/ingest.py --short``): both wires, both pacings,
each against the aggregator (every record checked in the store by the benchmark itself) and
against gRPC alone (``benchmarks/transport_floor.py``). It must finish; the targets are for
the full run (docs/scale.md), not for this one."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.mark.slow
def test_the_short_ingest_benchmark_runs_both_wires_and_the_transport_floor_side_by_side():
    result = subprocess.run(
        [sys.executable, str(BENCHMARKS / "ingest.py"), "--short"],
        cwd=BENCHMARKS, capture_output=True, text=True, timeout=300, check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    runs = re.findall(
        r"^\s+(stream|unary)\s+8 ranks, a batch every ([\d.]+) s, 0 viewers(, gRPC transport alone)?:",
        result.stdout, re.MULTILINE,
    )
    alone = ", gRPC transport alone"
    assert runs == [(wire, pace, server) for pace in ("0", "0.2") for wire in ("stream", "unary")
                    for server in ("", alone)]  # fmt: skip
    # 8 ranks x 3 batches x 10 records each time, every one found in the aggregator's store.
    assert result.stdout.count("240 records in") == 8
    assert result.stdout.count("the aggregator against gRPC alone") == 4
    assert result.stdout.count("stream against unary, 8 ranks") == 2
