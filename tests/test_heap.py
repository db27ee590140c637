"""The cyclic garbage collector in a serving aggregator (traceml/core/heap.py): start-up objects
frozen, young collections spaced out to :data:`SERVING_THRESHOLDS` while it serves, its work
tallied and said at the stop, the thresholds it had restored after."""

from __future__ import annotations

import gc
import re

import pytest
from live_aggregator import LiveAggregator

from traceml.core.heap import SERVING_TALLY, SERVING_THRESHOLDS, serving_heap

#: The aggregator's stop line of the collector's tally (traceml_aggregator/server.py).
COLLECTOR_LINE = re.compile(
    rf"{re.escape(SERVING_TALLY)}: (\d+) young, (\d+) middle, (\d+) full collections, "
    r"\d+\.\d\d s"
)


def test_serving_spaces_young_collections_out_tallies_them_and_restores_the_thresholds():
    before = gc.get_threshold()
    assert before != SERVING_THRESHOLDS
    with serving_heap() as tally:
        assert gc.get_threshold() == SERVING_THRESHOLDS
        assert gc.get_freeze_count() > 0  # start-up objects in the permanent generation
        gc.collect(0)  # resets the young generation's count of allocations
        counts = list(tally.counts)
        # 20,000 objects the collector tracks, alive: ~28 young collections at CPython's
        # default of 700, none at 50,000.
        kept = [[i] for i in range(20_000)]
        assert tally.counts == counts
        gc.collect(0)
        gc.collect(2)
        assert tally.counts == [counts[0] + 1, counts[1], counts[2] + 1]
        assert tally.seconds > 0
    assert len(kept) == 20_000
    assert gc.get_threshold() == before
    assert tally not in gc.callbacks
    gc.collect()
    assert tally.counts == [counts[0] + 1, counts[1], counts[2] + 1]  # the tally stopped
    gc.unfreeze()  # this test process's heap is pytest's again


@pytest.mark.aggregator
def test_a_stopped_aggregator_says_what_its_collector_did_while_it_served(tmp_path):
    with LiveAggregator(tmp_path / "run", "heap") as agg:
        assert agg.stop() == 0
        lines = COLLECTOR_LINE.findall(agg.log())
    assert len(lines) == 1, agg.log()
