"""Who may send what: the checks of a batch's sender, and the count of what was refused.

A batch names its sender (a rank, or a node's sampler) and its attempt. Before a batch is
queued for the store, :func:`check_batch` refuses one that cannot belong to this run:

* ``rank_out_of_range``: a rank >= the run's world size;
* ``world_size_mismatch``: an identity whose world size is not the run's;
* ``identity_mismatch``: an identity of another rank or attempt than the batch's;
* ``node_rank_out_of_range``: a node rank >= the run's node count (``--nnodes``), as sender,
  in an identity, or in a sample;
* ``script_world_mismatch``: an identity of a process group the script built itself that
  disagrees with the one the run adopted (:mod:`traceml_aggregator.script_world`), and
  ``script_parent``: the torchrun process that started that group;
* ``not_a_rank``: a node sampler's batch carrying what only a rank sends (steps, a FLOPs
  count, an identity, a finish marker), which the store would otherwise file under rank 0.

The store refuses the rest, which needs what it holds: a restart count lower than one already
stored for the sender (``restart_regressed``), and a second process sending as a (rank,
restart) that another process streams (``second_sender``). The token check
(``unauthenticated``, :mod:`traceml_aggregator.auth`), another run's name (``foreign_run``),
sequence numbers below 1 (``bad_sequence``) and batches the store cannot take
(``malformed``) are counted here too.

Every refusal but ``malformed`` concerns the sender (each of its batches would be refused
alike): the SDK sends nothing more after one. A ``malformed`` batch is refused alone
(:data:`BATCH_ONLY`): its Ack carries its own sequence number as ``stored_seq``, and its sender
drops it, counts its records as dropped and goes on with the next. An integer above what the
store holds (``STORE_INT_MAX`` of :mod:`traceml_aggregator.store`, 2**63 - 1) refuses nothing:
the value is dropped, the rest of its batch stored, and each such value counted as
``value_out_of_range``.

Every refusal is answered with its reason and stores nothing; :class:`Rejections` counts
them by kind. The counts go into the summary (``run.rejected``) and the aggregator's log, and
into the store while the aggregator runs (a replacement of a SIGKILLed one goes on from them).
"""

from __future__ import annotations

import json

from traceml.core import log

_log = log.get("aggregator")

#: Log lines per kind of refusal; after that they are only counted (a flood stays a count).
LOGGED_PER_KIND = 5
#: Refusals of one batch alone, not of its sender (see the module docstring).
BATCH_ONLY = frozenset({"malformed"})


class Rejections:
    """Refusals by kind (see the module docstring), each logged for the first few; the first
    one's reason of each kind is kept for the summary (``run.rejected_reasons``)."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.reasons: dict[str, str] = {}
        self._lines: dict[str, int] = {}  # log lines said per kind (this process)

    def restore(self, counts: str | None, reasons: str | None) -> None:
        """Take back the counts and first reasons an earlier aggregator of this run stored
        (JSON objects of kind -> count and kind -> reason, or None)."""
        for kind, n in json.loads(counts or "{}").items():
            self.counts[kind] = self.counts.get(kind, 0) + n
        for kind, reason in json.loads(reasons or "{}").items():
            self.reasons.setdefault(kind, reason)

    @property
    def total(self) -> int:
        """Refusals counted (restored ones included)."""
        return sum(self.counts.values())

    def refuse(self, kind: str, reason: str, count: int = 1) -> str:
        """Count ``count`` refusals of ``kind`` and log them in one line (while the kind's
        lines are fewer than :data:`LOGGED_PER_KIND`); returns ``reason``."""
        lines = self._lines.get(kind, 0) + 1
        self._lines[kind] = lines
        self.counts[kind] = self.counts.get(kind, 0) + count
        self.reasons.setdefault(kind, reason)
        if lines <= LOGGED_PER_KIND:
            more = "; further ones are only counted" if lines == LOGGED_PER_KIND else ""
            _log.warning(f"refused {reason}{more}")
        return reason


def check_batch(batch, world_size: int | None, nnodes: int | None) -> tuple[str, str] | None:
    """``(kind, reason)`` when ``batch`` (a wire Batch) cannot come from this run's senders,
    else None.

    Args:
        batch: the batch, run name already checked.
        world_size: the run's world size (None while unknown: no rank check).
        nnodes: the run's node count (None under plain torchrun: no node check).
    """
    sender = batch.WhichOneof("sender") or "rank"
    if sender == "rank":
        if world_size is not None and batch.rank >= world_size:
            return "rank_out_of_range", f"a batch of rank {batch.rank}: world size is {world_size}"
    elif (
        batch.step_groups
        or batch.flops_counts
        or batch.HasField("identity")
        or batch.HasField("finish")
    ):
        return "not_a_rank", (
            f"a batch of node {batch.node_rank}'s sampler with steps, a FLOPs count, an "
            "identity or a finish marker: only ranks send those"
        )
    elif nnodes is not None and batch.node_rank >= nnodes:
        return "node_rank_out_of_range", (
            f"a batch of node {batch.node_rank}'s sampler: the run has {nnodes} nodes"
        )
    if batch.HasField("identity"):
        ident = batch.identity
        if sender == "rank" and (ident.rank, ident.restart_count) != (
            batch.rank,
            batch.restart_count,
        ):
            return "identity_mismatch", (
                f"a batch of rank {batch.rank} (attempt {batch.restart_count}) introducing rank "
                f"{ident.rank} (attempt {ident.restart_count})"
            )
        if world_size is not None and ident.world_size != world_size:
            return "world_size_mismatch", (
                f"rank {ident.rank}'s identity with world size {ident.world_size}: the run's "
                f"is {world_size}"
            )
        if nnodes is not None and ident.node_rank >= nnodes:
            return "node_rank_out_of_range", (
                f"rank {ident.rank}'s identity on node {ident.node_rank}: the run has {nnodes} "
                f"nodes"
            )
    # (each repeated field is looked at before it is iterated: iterating an empty one costs
    # three times the look, and most batches carry only steps or only samples)
    if sender != "rank" and world_size is not None and batch.process_samples:
        for s in batch.process_samples:
            if s.rank >= world_size:
                return "rank_out_of_range", (
                    f"a process sample of rank {s.rank}: world size is {world_size}"
                )
    if nnodes is not None and batch.system_samples:
        for s in batch.system_samples:
            if s.node_rank >= nnodes:
                return "node_rank_out_of_range", (
                    f"a system sample of node {s.node_rank}: the run has {nnodes} nodes"
                )
    return None
