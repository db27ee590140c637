"""``benchmarks/node0_cost.py``, small: node 0's aggregator wired as it serves, fed relay
messages in process, stores every step sent exactly once and folds each into its live
aggregates (a benchmark whose batches were held for a catch-up never done folded none)."""

from __future__ import annotations

import re

from helpers.benchmarks import run_benchmark


def test_the_node0_cost_benchmark_stores_every_step_it_sends():
    # 4 nodes of 8 ranks, 3 timed messages a node of 2 steps a rank's batch: 192 steps
    result = run_benchmark("node0_cost.py", "--nodes", "4", "--messages", "3", timeout_s=120)
    (line,) = re.findall(
        r"^this: \d+ µs of CPU a relay message, [\d.]+ µs a rank's batch \([\d.]+ s of CPU in "
        r"[\d.]+ s\); steps stored (\d+) and folded into the live aggregates (\d+) of (\d+); "
        r"cyclic GC: \d+ young, \d+ middle, \d+ full collections, [\d.]+ s$",
        result.stdout,
        re.MULTILINE,
    )
    assert line == ("192", "192", "192"), result.stdout
