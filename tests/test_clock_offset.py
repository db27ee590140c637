"""A node's clock offset from node 0's, measured over its real session (traceml/core/clock.py).

This process plays node 1's launcher (:class:`traceml.launcher.session.NodeSession`) with its
wall clock 3 s ahead, as ``TRACEML_TEST_CLOCK_OFFSET_MS`` sets it; a real aggregator process
(the host's own clock) answers its heartbeats. The launcher's estimate of node 0's clock minus
its own is -3 s within its stated bound, and node 0 stores it in the run's store at once.
"""

from __future__ import annotations

import json
import re

import pytest
from conftest import wait_for
from live_aggregator import LiveAggregator
from test_launcher_news import claim

from traceml.core import clock
from traceml.launcher.session import NodeSession

pytestmark = [pytest.mark.aggregator]

AHEAD_NS = 3_000_000_000


def test_a_node_whose_clock_is_off_is_measured_within_its_bound(tmp_path, monkeypatch):
    monkeypatch.setattr(clock, "TEST_OFFSET_NS", AHEAD_NS)
    agg = LiveAggregator(tmp_path / "run", "r", world_size=2, extra_args=("--nnodes", "2"))
    with agg:
        node1 = NodeSession(agg.target, claim(1)).start()
        try:
            assert node1.wait_claim(30).accepted
            best = wait_for(node1.clock.best, 30, "the first clock exchange")
            assert abs(best.offset_us + AHEAD_NS // 1000) <= best.error_us < 50_000
            # node 0 heard it at once (the first exchange runs as the session opens, not a
            # heartbeat interval later) and stored it: it says so once stored
            wait_for(lambda: "node 1's clock is +" in agg.log(), 10, "the stored offset")
        finally:
            node1.close()
    # the log line says how far the node's clock is off: +3 s within its bound
    (m,) = re.finditer(
        r"node 1's clock is ([-+][\d.]+) ms off node 0's aggregator's \(± ([\d.]+) ms\)", agg.log()
    )
    assert abs(float(m[1]) - AHEAD_NS / 1e6) <= float(m[2]) + 0.001
    ((value,),) = agg.query("SELECT value FROM meta WHERE key = 'node_clocks'")
    (stored,) = json.loads(value)
    assert stored["node_rank"] == 1
    assert abs(stored["offset_us"] + AHEAD_NS // 1000) <= stored["error_us"] < 50_000
