"""How a rank ended, in the words every side uses, and the reason that marks an interrupted run.

The end-state names are those of ``EndState`` in ``proto/traceml/wire/v1/finish.proto``
without their ``END_STATE_`` prefix, in lower case: the wire carries the enum's numbers, and
:func:`traceml.wire.end_state_name` converts a number to its name, which is what the store keeps
and what the analysis reads. They are declared here, not in the wire, so that the offline
library (:mod:`traceml.analysis`, :mod:`traceml.report`) compares end states without importing
protobuf or gRPC; ``tests/test_offline_imports.py`` fails when the enum and
:data:`REPORTED_END_STATES` disagree.

The interrupted reason: the launcher writes it, the analysis reads it. A rank stopped because
its launcher got SIGTERM or SIGINT (scancel, preemption, Ctrl-C), not because it or another rank
failed.
"""

from __future__ import annotations

import signal

#: Finished normally (exit code 0).
COMPLETED = "completed"
#: Exited with a non-zero code or raised.
FAILED = "failed"
#: Killed by a signal (SIGSEGV, SIGKILL, ...).
SIGNALED = "signaled"
#: Stopped by torchrun or the launcher after another rank failed.
TERMINATED = "terminated"
#: Never started: torchrun failed before it started its node's ranks (its rendezvous: a
#: ``--master-port`` in use, node 0 unreachable; its store).
NOT_STARTED = "not_started"
#: The end states a rank or its launcher reports, in the order of their ``EndState`` numbers
#: (1, 2, ...; 0 is ``END_STATE_UNSPECIFIED``, never set on purpose).
REPORTED_END_STATES = (COMPLETED, FAILED, SIGNALED, TERMINATED, NOT_STARTED)

INTERRUPTED_PREFIX = "interrupted: "
#: The reason of ranks their launcher stopped before they started, as node 0 said the run
#: cannot rendezvous (a claim it refused, a node whose torchrun ended first), then why.
CANNOT_RENDEZVOUS_PREFIX = "stopped: the run cannot rendezvous: "


def interrupted_reason(signal_name: str, node_rank: int | None = None) -> str:
    """The reason of a rank stopped by its launcher's ``signal_name`` ("SIGTERM"), or, given
    ``node_rank``, by the run's end as that node's launcher got it."""
    who = launcher_text(node_rank)
    return f"{INTERRUPTED_PREFIX}{who} got {signal_name} (scancel, preemption or Ctrl-C)"


def interrupting_node(reason: str, node_rank: int | None) -> int | None:
    """The node whose launcher got the stop signal, from a rank's :func:`interrupted_reason`:
    the node it names, or ``node_rank`` (the rank's own) for "the launcher"; None when neither
    is known."""
    who = reason.removeprefix(INTERRUPTED_PREFIX).split(" got ", 1)[0]
    named = who.removeprefix("node ").removesuffix("'s launcher")
    return int(named) if named.isdigit() else node_rank


def launcher_text(node_rank: int | None) -> str:
    """``node 1's launcher``; ``the launcher`` (the rank's own) for None."""
    return "the launcher" if node_rank is None else f"node {node_rank}'s launcher"


def signal_name(number: int) -> str:
    """``SIGTERM`` for 15; ``signal 99`` for a number that is no signal (a hostile client's)."""
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def is_interrupted(reason: str | None) -> bool:
    """True for a reason written by :func:`interrupted_reason`."""
    return reason is not None and reason.startswith(INTERRUPTED_PREFIX)
