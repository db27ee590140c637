"""The launcher's two lifecycles as explicit state machines, each with one transition table.

**The launch** (:class:`Phase`, :data:`LAUNCH_TRANSITIONS`), one per node::

    starting --> training --> finalizing --> completed | failed | interrupted
        |            |             |
        +--> failed  +-------------+--> abandoned (a second SIGTERM/SIGINT: ends at once)

``starting``: the checks, the run directory, node 0's aggregator started, node r > 0 waiting
for it and claiming its rank (``failed`` there: no run token, no aggregator, claim refused).
``training``: torchrun runs. ``finalizing``: torchrun exited; the node reports its exit, node 0
writes the summary. The end is decided when training ends: ``interrupted`` after a SIGTERM/
SIGINT, else ``completed`` (torchrun exited 0) or ``failed``. ``abandoned`` is a real end the
list in issue 22 misses: a second signal ends the launcher at once, without a summary (exit
128 + N). The values are the manifests' ``status`` strings.

**Node 0's aggregator** (:class:`AggregatorStatus`, :data:`AGGREGATOR_TRANSITIONS`), the
manifest's ``aggregator.status``: ``not_started`` -> ``starting`` -> ``serving``; a dead one is
restarted on the run's store (``serving`` -> ``starting``, again after a restart that did not
serve: ``failed`` -> ``starting``), one that cannot be is ``failed`` (training goes on without
telemetry); ``stopped`` at the end. It is its own machine because it moves while the launch
stays in ``training``: the launcher starts torchrun before its aggregator serves, and the
aggregator may die and come back during training; one table over both would be their product.

A move the table does not allow is a bug in the launcher: it is logged and made anyway (the
processes are where they are), never raised into the training (fail-open).
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import Enum
from typing import Generic, TypeVar

from traceml.core import log

_log = log.get("launcher")


class Phase(str, Enum):
    """Where one node's launch is (the manifests' ``status`` strings)."""

    STARTING = "starting"
    TRAINING = "training"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    FAILED = "failed"
    INTERRUPTED = "interrupted"
    ABANDONED = "abandoned"


#: Every legal move of a launch: phase -> the phases it may go to (ends go nowhere).
LAUNCH_TRANSITIONS: Mapping[Phase, frozenset[Phase]] = {
    Phase.STARTING: frozenset({Phase.TRAINING, Phase.FAILED, Phase.ABANDONED}),
    Phase.TRAINING: frozenset({Phase.FINALIZING, Phase.ABANDONED}),
    Phase.FINALIZING: frozenset(
        {Phase.COMPLETED, Phase.FAILED, Phase.INTERRUPTED, Phase.ABANDONED}
    ),
    Phase.COMPLETED: frozenset(),
    Phase.FAILED: frozenset(),
    Phase.INTERRUPTED: frozenset(),
    Phase.ABANDONED: frozenset(),
}


class AggregatorStatus(str, Enum):
    """Node 0's aggregator process, as the run manifest's ``aggregator.status`` says."""

    NOT_STARTED = "not_started"
    STARTING = "starting"
    SERVING = "serving"
    FAILED = "failed"
    STOPPED = "stopped"


#: Every legal move of node 0's aggregator: status -> the statuses it may go to.
AGGREGATOR_TRANSITIONS: Mapping[AggregatorStatus, frozenset[AggregatorStatus]] = {
    AggregatorStatus.NOT_STARTED: frozenset({AggregatorStatus.STARTING}),
    AggregatorStatus.STARTING: frozenset(
        {AggregatorStatus.SERVING, AggregatorStatus.FAILED, AggregatorStatus.STOPPED}
    ),
    AggregatorStatus.SERVING: frozenset(
        {AggregatorStatus.STARTING, AggregatorStatus.FAILED, AggregatorStatus.STOPPED}
    ),
    AggregatorStatus.FAILED: frozenset({AggregatorStatus.STARTING, AggregatorStatus.STOPPED}),
    AggregatorStatus.STOPPED: frozenset(),
}

S = TypeVar("S", Phase, AggregatorStatus)


class Machine(Generic[S]):
    """A state and the table of its legal moves.

    Args:
        name: what moves, for the log line of an illegal move ("launch", "aggregator").
        table: state -> the states it may go to.
        initial: the state it starts in.
    """

    def __init__(self, name: str, table: Mapping[S, frozenset[S]], initial: S) -> None:
        self.name = name
        self.table = table
        self.state: S = initial

    def to(self, new: S, why: str = "") -> bool:
        """Move to ``new`` (staying where it is is no move); False when the table does not
        allow it, which is logged as a bug and made anyway (never raised: fail-open)."""
        old = self.state
        if new == old:
            return True
        legal = new in self.table[old]
        if not legal:
            _log.error(
                f"traceml bug: the {self.name} went from {old.value} to {new.value}"
                f"{f' ({why})' if why else ''}, which its transition table does not allow; "
                "going on"
            )
        self.state = new
        return legal
