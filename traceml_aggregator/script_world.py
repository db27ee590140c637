"""A world the training script built itself: the run's ranks when its processes are not
torchrun's.

A script may start its own processes (``torch.multiprocessing.spawn(fn, nprocs=4)`` under
``traceml run --nproc-per-node=1``), each joining a process group of its own. Each child then
reports the group's rank and world size with ``own_process_group`` set in its identity
(:meth:`traceml.sdk.identity.RankInfo.from_process_group`), and that world is not the run's
(torchrun's: 1). The first such identity whose world size differs from the run's makes its
world the run's (:meth:`ScriptWorld.adopt`): its size is the run's world size from then on,
recorded in the store (meta keys ``world_size`` and :data:`SCRIPT_WORLD_META_KEY`) and named in
the summary (``run.script_world``). Every later identity of the script's group must agree with
it, else it is refused (``script_world_mismatch``) with its reason:

* one world size: the first identity's;
* one node: the first identity's node rank (spawned children share their parent's node);
* distinct ranks: a second process sending as a rank another one streams is refused by the
  store (``second_sender``), as for any rank; ranks beyond the world, by
  :func:`~traceml_aggregator.senders.check_batch` (``rank_out_of_range``);
* the run's token: every call is checked (:mod:`traceml_aggregator.auth`).

Torchrun's own process that started the group (an identity of torchrun's world on that node,
``own_process_group`` unset: the script's parent, instrumented too) is refused as
``script_parent``: the group's ranks report instead, and its rank would collide with theirs.
Other batches of torchrun's ranks are checked against the adopted world like any
(``world_size_mismatch``), so nothing is stored under two worlds at once.
"""

from __future__ import annotations

import json
import time

from traceml.core import log, records

_log = log.get("aggregator")

#: The store's meta key of the adopted world (:meth:`ScriptWorld.adopt`'s record, JSON).
SCRIPT_WORLD_META_KEY = "script_world"


class ScriptWorld:
    """The run's world when the script built its own (see the module docstring).

    Args:
        record: the adopted world as stored (:data:`SCRIPT_WORLD_META_KEY`), None when none
            was: ``{"world_size", "node_rank", "launched_world_size", "adopted_unix_s"}``.
    """

    def __init__(self, record: dict | None = None) -> None:
        self.record = record

    @classmethod
    def restore(cls, meta: dict) -> ScriptWorld:
        """The adopted world of a store's ``meta`` (after an aggregator restart, or for
        ``--finalize-only``)."""
        raw = meta.get(SCRIPT_WORLD_META_KEY)
        return cls(json.loads(raw) if raw else None)

    def world_size(self, launched: int | None) -> int | None:
        """The run's world size: the adopted one, else ``launched`` (torchrun's)."""
        return self.record["world_size"] if self.record else launched

    def check(self, batch, world_size: int | None) -> tuple[tuple[str, str] | None, bool]:
        """``(refusal, adopt)`` for ``batch`` (a wire Batch) in a run whose world size is now
        ``world_size`` (None: unknown): a refusal ``(kind, reason)`` of an identity of the
        script's group that disagrees with the adopted world, or ``adopt`` when its world is
        to become the run's (the first one that differs from ``world_size``)."""
        if not batch.HasField("identity"):
            return None, False
        ident, first = batch.identity, self.record
        if not ident.own_process_group:
            if first is not None and (ident.world_size, ident.node_rank) == (
                first["launched_world_size"],
                first["node_rank"],
            ):
                return (
                    "script_parent",
                    (
                        f"torchrun's rank {ident.rank} of {ident.world_size} (pid {ident.pid}), "
                        f"whose script started its own process group of {first['world_size']}: "
                        "the group's ranks report instead"
                    ),
                ), False
            return None, False
        if first is None:
            return None, world_size is not None and ident.world_size != world_size
        if ident.world_size != first["world_size"]:
            return (
                "script_world_mismatch",
                (
                    f"rank {ident.rank}'s own process group of {ident.world_size}: the script's "
                    f"first one, the run's world, has {first['world_size']}"
                ),
            ), False
        if ident.node_rank != first["node_rank"]:
            return (
                "script_world_mismatch",
                (
                    f"rank {ident.rank}'s own process group on node {ident.node_rank}: the "
                    f"script's is on node {first['node_rank']} (one node)"
                ),
            ), False
        return None, False

    def adopt(self, identity, launched_world_size: int | None) -> dict:
        """Make ``identity``'s group (a wire RankIdentity with ``own_process_group``) the
        run's world, torchrun's having had ``launched_world_size`` ranks; returns the record
        to store (:data:`SCRIPT_WORLD_META_KEY`)."""
        self.record = records.ScriptWorld(
            world_size=identity.world_size,
            node_rank=identity.node_rank,
            launched_world_size=launched_world_size,
            adopted_unix_s=round(time.time(), 3),
        ).to_json()
        _log.info(
            f"the run's world is the script's own process group: {identity.world_size} ranks "
            f"on node {identity.node_rank} (torchrun started {launched_world_size}; rank "
            f"{identity.rank}, pid {identity.pid} said so first)"
        )
        return self.record


def store_record(store, record: dict) -> None:
    """Write the adopted world to ``store`` (on the writer's thread): its size as the run's
    ``world_size`` and the record itself."""
    store.set_meta("world_size", str(record["world_size"]))
    store.set_meta(SCRIPT_WORLD_META_KEY, json.dumps(record, sort_keys=True))
