"""Node 0's pace: how often the aggregator asks its senders to flush.

Node 0 pays gRPC's cost, and much of its own, per message whatever the message carries
(docs/scale.md), and one aggregator process is one core at most. At the SDK's flush interval
(``TRACEML_FLUSH_INTERVAL_SEC``, 2 s) a run of 1,000 nodes sends it 500 node relay messages a
second; every 8 s, 125 that carry the same records. So the aggregator bounds the messages, not
the records: it counts the calls that send to it (each open ``Stream`` and each node relay's
``Relay`` call sends one message a flush) and, once they are more than its budget
(``TRACEML_AGGREGATOR_MESSAGES_PER_SEC``, 125 a second), asks in every ``Ack``
(``flush_interval_ms``) for the shortest of :data:`PACE_STEPS_S` at which they stay within it.
A sender flushes at the longer of that and its own interval (:mod:`traceml.sdk.client`), and a
node's launcher sends its heartbeats as seldom (:mod:`traceml.launcher.session`). While it
paces, node 0's writer has the messages that come within
:data:`~traceml_aggregator.writer.PACED_LINGER_S` share a transaction.

The steps are few and fixed so that a call opened or closed moves no sender's flush ticks but
at a step's bound, and the longest leaves :data:`HEARTBEATS_PER_LOSS` heartbeats in the time
after which node 0 marks a silent node lost (``TRACEML_NODE_LOST_AFTER_SEC``, 25 s: 8 s at
most); a longer pace is never asked for.

What it costs: at a pace, a step reaches node 0 (the live views, the hang watch) up to the
pace after it ended, not up to 2 s; nothing is lost, and a rank's buffer
(``TRACEML_BUFFER_MAX_RECORDS``, 65,536 records) holds 8 s of far more steps than a rank takes.
"""

from __future__ import annotations

from collections.abc import Callable

from traceml.core import log

_log = log.get("aggregator")

#: The flush intervals node 0 may ask for, s, shortest first.
PACE_STEPS_S = (2.0, 4.0, 8.0)
#: A pace leaves at least this many of a node's heartbeats within the time after which node 0
#: marks a silent node lost: a longer one is not asked for.
HEARTBEATS_PER_LOSS = 3


def flush_pace_s(calls: int, messages_per_s: float, lost_after_s: float) -> float:
    """The flush interval node 0 asks of its senders, s; 0.0: none (they keep their own).

    Args:
        calls: the calls that send to node 0 now (open ``Stream`` and ``Relay`` calls).
        messages_per_s: node 0's budget, messages a second
            (``TRACEML_AGGREGATOR_MESSAGES_PER_SEC``).
        lost_after_s: the silence after which node 0 marks a node lost, s
            (``TRACEML_NODE_LOST_AFTER_SEC``).

    Returns:
        0.0 while ``calls`` at one message a second each stay within the budget; else the
        shortest of :data:`PACE_STEPS_S` at which they do, or the longest allowed by
        ``lost_after_s`` (:data:`HEARTBEATS_PER_LOSS`) when none does (0.0 if none is).
    """
    if calls <= messages_per_s:
        return 0.0
    allowed = [s for s in PACE_STEPS_S if s * HEARTBEATS_PER_LOSS <= lost_after_s]
    if not allowed:
        return 0.0
    return next((s for s in allowed if calls / s <= messages_per_s), allowed[-1])


class FlushPace:
    """The pace of the calls open now, as every ``Ack`` carries it (see the module).

    Args:
        messages_per_s: node 0's budget, messages a second.
        lost_after_s: the silence after which node 0 marks a node lost, s.
        on_change: called with the new pace, s (0.0: none), each time it changes (the
            writer's :meth:`~traceml_aggregator.writer.Writer.pace`).

    Attributes:
        calls: the calls that send to node 0, open now.
        ms: the pace in ms, as ``Ack.flush_interval_ms`` carries it (0: none).
    """

    def __init__(
        self,
        messages_per_s: float,
        lost_after_s: float,
        on_change: Callable[[float], None] = lambda pace_s: None,
    ) -> None:
        self.messages_per_s = messages_per_s
        self.lost_after_s = lost_after_s
        self._on_change = on_change
        self.calls = 0
        self.ms = 0

    def opened(self) -> None:
        """A ``Stream`` or ``Relay`` call began."""
        self._count(1)

    def closed(self) -> None:
        """A call :meth:`opened` counted ended."""
        self._count(-1)

    def _count(self, change: int) -> None:
        self.calls += change
        ms = round(flush_pace_s(self.calls, self.messages_per_s, self.lost_after_s) * 1000)
        if ms != self.ms:
            self.ms = ms
            self._on_change(ms / 1000)
            asked = f"no more often than every {ms / 1000:g} s" if ms else "at their own interval"
            _log.info(
                f"calls sending to this aggregator: {self.calls} (budget "
                f"{self.messages_per_s:g} messages/s); senders are asked to flush {asked}"
            )
