"""The node-loss watch (``NodeSessions.watch``, traceml_aggregator/sessions.py) on its own:
the aggregator's own pause is not counted as its nodes' silence, and a silent node is still
lost once the bound passed without it. And at the summary (``NodeSessions.lose_unreported``),
a node whose session broke and who reported no exit is lost before the bound."""

from __future__ import annotations

import asyncio
import time

from helpers.node_sessions import loss_watch

from traceml_aggregator.sessions import LOST_CHECK_S, NodeSessions, _Session


async def _persist(key, value) -> None:
    pass


def _sessions(lost_after_s: float) -> NodeSessions:
    return loss_watch(_persist, lost_after_s, nnodes=5)


def test_a_held_aggregator_blames_no_node_and_a_silent_node_is_lost_a_bound_later():
    """Node 1 is expected (heard) just before the aggregator's event loop is held for three
    checks' time, as a SIGSTOP holds it (nothing read, no check run); nodes are lost after
    two checks' time of silence. The overdue check after the hold loses no node: of the
    node's silence, what the hold took past one check's time is not counted. Heard no more,
    the node is lost at the check after its counted silence passed the bound: one check
    later."""

    async def main() -> tuple[list[int], float]:
        sessions = _sessions(2 * LOST_CHECK_S)
        sessions.expect({1})
        watch = asyncio.ensure_future(sessions.watch())
        await asyncio.sleep(0)  # the watch begins its first period
        time.sleep(3 * LOST_CHECK_S)  # the event loop held
        resumed_m = time.monotonic()
        await asyncio.sleep(0.2 * LOST_CHECK_S)  # the overdue check runs
        after_hold = [loss["node_rank"] for loss in sessions.losses]
        while not sessions.losses:
            await asyncio.sleep(0.02)
        lost_after_s = time.monotonic() - resumed_m
        watch.cancel()
        return after_hold, lost_after_s

    after_hold, lost_after_s = asyncio.run(main())
    assert after_hold == []
    # counted silence: 1 check's time before the hold's overdue check, then 1 more; lost at
    # the check after it passes 2 (the watch's checks are 1 check's time apart)
    assert 0.9 * LOST_CHECK_S <= lost_after_s <= 2.5 * LOST_CHECK_S


def test_at_the_summary_a_node_whose_session_broke_and_that_reported_no_exit_is_lost():
    """Nodes 1-4, each with an open session, within a 60 s bound. Node 1's session breaks (its
    launcher killed) and node 1 reports no exit: lost at the summary, after the silence it
    had, not the bound. Node 2's breaks after its exit was stored, node 3's ends cleanly,
    node 4's stays open: none lost. A second call loses no node again."""

    async def main() -> tuple[list[int], list[int], list[dict]]:
        sessions = _sessions(60.0)
        sessions.expect({1, 2, 3, 4})
        opened = {rank: _Session(rank) for rank in (1, 2, 3, 4)}
        for rank, session in opened.items():
            sessions.nodes[rank].session = session
        sessions._close(opened[1], clean=False)
        sessions._close(opened[2], clean=False)
        sessions._close(opened[3], clean=True)
        first = await sessions.lose_unreported({2: {2}})
        return first, await sessions.lose_unreported({2: {2}}), sessions.losses

    first, again, losses = asyncio.run(main())
    assert (first, again) == ([1], [])
    (loss,) = losses
    assert loss["node_rank"] == 1 and loss["resumed_unix_s"] is None
    assert 0.0 <= loss["lost_after_s"] < 1.0  # heard as it was expected, just before
