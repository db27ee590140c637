"""The node-loss watch's side of :class:`~traceml_aggregator.sessions.NodeSessions` alone, for
the tests that drive it in process (no claims, exits or finalization wired)."""

from __future__ import annotations

from traceml_aggregator.nodes import NodeRegistry
from traceml_aggregator.sessions import NodeSessions


def loss_watch(persist, lost_after_s: float, nnodes: int) -> NodeSessions:
    """NodeSessions of ``nnodes`` nodes on node 0's host whose loss records go to ``persist``
    (``async fn(meta key, JSON value)``), nodes lost after ``lost_after_s`` of silence."""
    return NodeSessions(
        NodeRegistry(own_host="node0", nnodes=nnodes),
        store_exit=None,
        finalize=None,
        persist=persist,
        foreign=None,
        refuse=None,
        give_up_on=None,
        lost_after_s=lost_after_s,
    )
