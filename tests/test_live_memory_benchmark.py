"""``benchmarks/live_memory.py``, small: a world's live aggregates measured in a fresh process
each, with the windows part full and full."""

from __future__ import annotations

import re

from helpers.benchmarks import run_benchmark


def test_the_live_memory_benchmark_measures_each_world_and_full_windows_hold_more():
    result = run_benchmark("live_memory.py", "--ranks", "64", "--steps", "4", "600", timeout_s=120)
    lines = re.findall(
        r"^\s+(\d+) ranks x\s+(\d+) steps:\s+(\d+) MiB \(\s*([\d.]+) KiB a rank\)$",
        result.stdout,
        re.MULTILINE,
    )
    assert [(ranks, steps) for ranks, steps, _, _ in lines] == [("64", "4"), ("64", "600")]
    (_, _, part_mib, _), (_, _, full_mib, _) = lines
    # a full window (512 steps of 8 fields) and a series of 600 steps (at 64 ranks a series
    # keeps up to 1,024) against 4 steps: at least 64 x 100 KiB more
    assert int(full_mib) - int(part_mib) >= 6, result.stdout
