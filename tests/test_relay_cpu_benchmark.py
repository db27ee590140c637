"""``benchmarks/relay_cpu.py``, small: a real paced job under ``traceml run`` whose node relay's
own CPU is read over a window of steps."""

from __future__ import annotations

import re

import pytest
from helpers.benchmarks import run_benchmark

pytestmark = [pytest.mark.slow, pytest.mark.torchrun]


def test_the_relay_cpu_benchmark_reads_the_relays_thread_over_a_paced_window():
    result = run_benchmark(
        "relay_cpu.py",
        "--nproc",
        "2",
        "--step-ms",
        "50",
        "--steps",
        "100",
        "--mark-step",
        "20",
        timeout_s=240,
    )
    (line,) = re.findall(r"^  run 0: .*$", result.stdout, re.MULTILINE)
    found = re.match(
        r"  run 0: window ([\d.]+) s at ([\d.]+) steps/s a rank; relay ([\d.]+) % of a core",
        line,
    )
    assert found, result.stdout
    window_s, rate, percent = map(float, found.groups())
    # 80 steps paced at 50 ms: 4 s, 20 steps/s (the pacing holds, a loaded machine slows it)
    assert 3.9 <= window_s <= 16.0 and 5.0 <= rate <= 21.0, line
    # the relay's thread was found and read: it carried the ranks' flushes (every 2 s)
    assert 0.0 < percent < 50.0, line
    # node 0's count of what the relay carried: each RelayUp held one batch or more
    batches, messages = map(
        int, re.search(r"stored (\d+) batches from (\d+) RelayUps", line).groups()
    )
    assert batches >= messages >= 1, line
    assert re.search(r"^  median [\d.]+ % of a core: (met|not met)$", result.stdout, re.MULTILINE)
