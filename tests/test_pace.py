"""Node 0's pace (traceml_aggregator/pace.py): the flush interval its Acks ask for, from the
calls that send to it, and the SDK's client flushing at it (traceml/sdk/client.py).

The relay's side (a node's ranks and its launcher's heartbeats at the pace) is in
tests/test_relay.py (the "paced" case of the heartbeat test)."""

from __future__ import annotations

import pytest
from conftest import wait_for
from live_aggregator import LiveAggregator, finish, make_client, step

from traceml.sdk import client as client_mod
from traceml_aggregator.pace import PACE_STEPS_S, FlushPace, flush_pace_s


@pytest.mark.parametrize(
    ("calls", "lost_after_s", "expected"),
    [
        (1, 25.0, 0.0),
        (125, 25.0, 0.0),  # one message a second each is within the budget: no pace
        (126, 25.0, 2.0),
        (250, 25.0, 2.0),
        (251, 25.0, 4.0),
        (500, 25.0, 4.0),
        (501, 25.0, 8.0),
        (1000, 25.0, 8.0),  # 1,000 node relays: 125 messages a second
        (9000, 25.0, 8.0),  # over the budget even at the longest: the longest
        (1000, 23.0, 4.0),  # 3 heartbeats of 8 s are 24 s: not within a 23 s loss
        (1000, 5.0, 0.0),  # not even 3 of 2 s: no pace at all
    ],
)
def test_the_pace_is_the_shortest_step_within_the_budget(calls, lost_after_s, expected):
    assert PACE_STEPS_S == (2.0, 4.0, 8.0)
    assert flush_pace_s(calls, 125.0, lost_after_s) == expected


def test_each_change_of_the_pace_is_handed_on_once():
    """The pace's changes go to its ``on_change`` (the writer's), once each, in seconds: over a
    budget of one message a second, one call is asked for no pace, two for 2 s, three for 4 s,
    and as they close, the same back."""
    changes: list[float] = []
    pace = FlushPace(1.0, 25.0, changes.append)
    pace.opened()
    pace.opened()
    pace.opened()
    pace.closed()
    pace.closed()
    assert changes == [2.0, 4.0, 2.0, 0.0]
    assert pace.ms == 0


@pytest.mark.aggregator
def test_acks_ask_for_the_pace_of_the_streams_open_and_a_client_flushes_at_it(tmp_path):
    """A real aggregator with a budget of one message a second: one rank's stream is within it
    (its Acks ask for no pace: the client keeps its own 20 ms), two are not (both are asked
    for 2 s, the step at which two streams send one message a second, and flush so), and once
    one of them closed the other is asked for none again. Every step is stored once."""
    env = {"TRACEML_AGGREGATOR_MESSAGES_PER_SEC": "1"}
    with LiveAggregator(tmp_path / "run", "paced", env=env) as agg:
        warnings: list[str] = []
        first = make_client(agg.target, "paced", warnings, rank=0)
        first.submit(client_mod.STEPS, step(0))
        wait_for(lambda: first.stats.batches_acked >= 1, 30, "rank 0's first Ack")
        assert first.flush_interval_s == 0.02

        second = make_client(agg.target, "paced", warnings, rank=1)
        second.submit(client_mod.STEPS, step(0))
        wait_for(lambda: second.stats.batches_acked >= 1, 30, "rank 1's first Ack")
        assert second.flush_interval_s == 2.0
        acked = first.stats.batches_acked
        first.submit(client_mod.STEPS, step(1))
        wait_for(lambda: first.stats.batches_acked > acked, 30, "rank 0's Ack beside rank 1")
        assert first.flush_interval_s == 2.0

        assert second.close(finish(1), timeout_s=30) is True
        wait_for(lambda: "asked to flush at their own interval" in agg.log(), 30, "one call")
        first.submit(client_mod.STEPS, step(2))
        wait_for(lambda: first.stats.batches_acked > acked + 1, 30, "rank 0's Ack alone again")
        assert first.flush_interval_s == 0.02
        assert first.close(finish(3), timeout_s=30) is True
        assert agg.stop() == 0
    assert warnings == []
    assert agg.query("SELECT rank, COUNT(*) FROM steps GROUP BY rank") == [(0, 3), (1, 1)]
    assert (
        "calls sending to this aggregator: 2 (budget 1 messages/s); senders are asked to flush "
        "no more often than every 2 s" in agg.log()
    )
