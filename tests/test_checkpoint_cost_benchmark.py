"""``benchmarks/checkpoint_cost.py``, small: a steady-state checkpoint writes no rank's series
again when none took in a chunk of steps since, so it writes less than the first."""

from __future__ import annotations

import re

from helpers.benchmarks import run_benchmark


def test_the_checkpoint_cost_benchmark_measures_the_first_and_the_steady_state():
    # 8 ranks of 600 steps: each rank's first chunk (FOLD_STEPS less its rank) is folded in
    # by then, its second not before 1,016 steps, so the 30 steps after write no series
    result = run_benchmark(
        "checkpoint_cost.py", "--ranks", "8", "--warm-steps", "600", "--repeat", "2", timeout_s=120
    )
    (line,) = re.findall(
        r"^this: steady state \d+ ms of CPU a checkpoint, \d+ µs a rank, ([\d.]+) KiB a rank "
        r"\(the first: \d+ µs, ([\d.]+) KiB a rank\); a restart reads a rank's rows in \d+ µs "
        r"\(at most \d+\)$",
        result.stdout,
        re.MULTILINE,
    )
    steady, first = map(float, line)
    # the first holds each rank's series (a digest and a sample of 600 steps: > 10 KiB)
    assert first - steady > 10, result.stdout
