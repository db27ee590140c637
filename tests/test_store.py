"""The SQLite store: a batch is stored at most once per (sender, restart, seq), across reopens."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from helpers.batches import node_batch, node_exit, rank_end, tiny_step
from helpers.batches import rank_batch as batch

from traceml import wire
from traceml.wire.records import add_steps, step_group_columns
from traceml_aggregator.live import LiveAggregates
from traceml_aggregator.store import Store
from traceml_aggregator.writer import PACED_LINGER_S, QueueFull, Writer


def results(store: Store, *batches) -> list[tuple[int, bool]]:
    return [(r.stored_seq, r.duplicate) for r in store.write_batches(list(batches), 0)]


def rows(store: Store, sql: str) -> list[tuple]:
    return [tuple(row) for row in store.query(sql)]


def count(store: Store, sql: str) -> int:
    return rows(store, sql)[0][0]


def test_a_resent_batch_is_acknowledged_not_stored_again(tmp_path):
    store = Store(tmp_path / "t.sqlite")
    first = results(store, batch(1, range(5)), batch(2, range(5, 10)))
    assert first == [(1, False), (2, False)]
    # The same seq again, even in the same transaction as a new one, is a duplicate.
    again = results(store, batch(2, range(5, 10)), batch(3, range(10, 12)), batch(3, range(10, 12)))
    assert again == [(2, True), (3, False), (3, True)]
    # An older seq after a newer one: the ack names the highest stored seq.
    assert results(store, batch(1, range(5))) == [(3, True)]
    assert count(store, "SELECT COUNT(*) FROM steps") == 12
    assert rows(store, "SELECT * FROM streams") == [("rank", 0, 0, 3)]


def test_the_key_is_sender_restart_and_seq(tmp_path):
    store = Store(tmp_path / "t.sqlite")
    stored = results(
        store,
        batch(1, range(3), rank=0),
        batch(1, range(3), rank=1),  # another rank
        batch(1, range(3), rank=0, restart=1),  # rank 0's next torchrun attempt
    )
    node = node_batch(1)  # node 0's sampler, not rank 0
    node.system_samples.add(unix_us=1, node_rank=0, hostname="h")
    stored += results(store, node)
    assert stored == [(1, False)] * 4
    assert count(store, "SELECT COUNT(*) FROM steps") == 9
    assert count(store, "SELECT COUNT(*) FROM system_samples") == 1
    assert count(store, "SELECT COUNT(*) FROM streams") == 4


def test_records_stored_counts_what_committed_and_nothing_else(tmp_path):
    """The aggregator's closing line reports ``records_stored``: steps, process samples,
    system samples and FLOPs counts of the batches committed; a duplicate, a refusal and a
    rolled-back transaction add nothing."""
    store = Store(tmp_path / "t.sqlite")
    steps = batch(1, range(3), rank=0, restart=1)
    steps.flops_counts.add(step=0, forward_flops=10, count_us=5)
    steps.process_samples.add(unix_us=1, rank=0)
    node = node_batch(1)
    for i in range(2):
        node.system_samples.add(unix_us=1 + i, node_rank=0, hostname="h")
        node.process_samples.add(unix_us=1 + i, rank=1)
    assert results(store, steps, node) == [(1, False), (1, False)]
    assert store.records_stored == 3 + 1 + 1 + 2 + 2
    # a duplicate, and a batch of an attempt older than the stored one (refused)
    stored = store.write_batches([steps, batch(1, range(4), rank=0, restart=0)], 0)
    assert [(r.duplicate, r.kind) for r in stored] == [(True, ""), (False, "restart_regressed")]
    overflow = batch(1, [0], rank=2, row=lambda i: {"step": i, "end_us": 2**64 - 1, "step_us": 1})
    with pytest.raises(OverflowError):  # rolled back
        store.write_batches([batch(1, range(5), rank=1), overflow], 0)
    assert store.records_stored == 9
    assert count(store, "SELECT COUNT(*) FROM steps") == 3


def test_idempotency_survives_a_reopen(tmp_path):
    path = tmp_path / "t.sqlite"
    store = Store(path)
    results(store, batch(1, range(4)), batch(2, range(4, 8)))
    store.close()

    store = Store(path)  # a restarted aggregator on the same run directory
    assert results(store, batch(2, range(4, 8)), batch(3, range(8, 9))) == [(2, True), (3, False)]
    assert count(store, "SELECT COUNT(*) FROM steps") == 9


def test_a_failed_transaction_stores_nothing_and_forgets_its_seqs(tmp_path):
    store = Store(tmp_path / "t.sqlite")
    good = batch(1, range(3), rank=0)
    # 2**64 - 1 is a valid uint64 on the wire but not an SQLite integer: the insert fails.
    bad = batch(1, [0], rank=1, row=lambda i: {"step": i, "end_us": 2**64 - 1, "step_us": 1})
    with pytest.raises(OverflowError):
        store.write_batches([good, bad], 0)
    assert count(store, "SELECT COUNT(*) FROM steps") == 0
    # The good batch, resent, is stored: its seq was not remembered as stored.
    assert results(store, good) == [(1, False)]
    assert count(store, "SELECT COUNT(*) FROM steps") == 3


@pytest.mark.parametrize("n", [1, 31, 32, 33, 95, 512])
def test_every_step_of_a_group_is_stored_once_whatever_its_size(tmp_path, n):
    """Groups go in multi-row INSERTs of 32, 16, ... 1 rows: every split must add up."""
    store = Store(tmp_path / "t.sqlite")
    assert results(store, batch(1, range(n), rank=5, restart=2)) == [(1, False)]
    assert rows(store, "SELECT rank, restart, step, end_us, step_us FROM steps ORDER BY step") == [
        (5, 2, i, i + 1, 1) for i in range(n)
    ]


def test_one_step_batches_of_many_ranks_share_statements_and_keep_their_order(tmp_path):
    """A relay message's batches, one step of each of 10 ranks, rank 5's with its forward
    measured: each run of groups with the same fields is bound together (ranks 0-4, rank 5,
    ranks 6-9: statements of 4 + 1, 1 and 4 rows, where one per batch would be 10), and the
    rows keep the order the batches came in, each with its own fields."""
    store = Store(tmp_path / "t.sqlite")
    timed = {5: lambda i: {**tiny_step(i), "forward_us": 7}}
    batches = [batch(1, [0], rank=r, row=timed.get(r, tiny_step)) for r in range(10)]
    statements: list[str] = []
    store._db.set_trace_callback(statements.append)  # each statement as it runs
    assert [r.duplicate for r in store.write_batches(batches, 0)] == [False] * 10
    store._db.set_trace_callback(None)
    inserts = [sql.count("), (") + 1 for sql in statements if sql.startswith("INSERT INTO steps")]
    assert inserts == [4, 1, 1, 4], statements
    assert rows(store, "SELECT rank, forward_us FROM steps ORDER BY rowid") == [
        (r, 7 if r == 5 else None) for r in range(10)
    ]


def test_a_malformed_step_group_fails_its_transaction_before_any_row(tmp_path):
    store = Store(tmp_path / "t.sqlite")
    good = batch(1, range(3), rank=0)
    bad = batch(1, range(2), rank=1)
    bad.step_groups[0].forward_us.append(7)  # one value for two steps
    with pytest.raises(ValueError, match="columns of another length: forward_us"):
        store.write_batches([good, bad], 0)
    assert count(store, "SELECT COUNT(*) FROM steps") == 0
    assert results(store, good) == [(1, False)]
    assert rows(store, "SELECT rank, step, end_us, step_us, forward_us FROM steps") == [
        (0, 0, 1, 1, None),
        (0, 1, 2, 1, None),
        (0, 2, 3, 1, None),
    ]


def test_finish_marker_and_identity_are_stored_with_their_batch(tmp_path):
    store = Store(tmp_path / "t.sqlite")
    first = batch(1, range(2), identity=wire.RankIdentity(run_name="r", rank=0, world_size=2))
    last = batch(2, range(2, 3), finish=wire.RankFinish(last_seq=2, steps_completed=3))
    results(store, first, last)
    assert rows(store, "SELECT rank, world_size FROM ranks") == [(0, 2)]
    assert rows(store, "SELECT steps_completed, last_seq FROM rank_finish") == [(3, 2)]


def test_the_writer_isolates_a_batch_the_store_cannot_take(tmp_path):
    """Batches queued together share a transaction; one that fails it fails alone."""
    good = batch(1, range(3), rank=0)
    bad = batch(1, range(2), rank=1, finish=wire.RankFinish(end_state=77))  # no such state
    stored: list[int] = []

    async def main():
        writer = Writer(Store(tmp_path / "t.sqlite"), lambda b, _: stored.append(b.rank))
        futures = [asyncio.ensure_future(writer.queue_batch(b)) for b in (good, bad)]
        await asyncio.sleep(0)  # both queued before the writer takes them: one transaction
        writer.start()
        done = await asyncio.gather(*futures, return_exceptions=True)
        steps = await writer.call(count, writer.store, "SELECT COUNT(*) FROM steps")
        await writer.close()
        return done, steps, writer.batches_stored

    (good_result, bad_result), steps, batches_stored = asyncio.run(main())
    assert (good_result.stored_seq, good_result.duplicate) == (1, False)
    # Refused (its sender stops), not failed (its sender would resend it for ever).
    assert (bad_result.kind, bad_result.duplicate) == ("malformed", False)
    assert bad_result.rejected.startswith("a malformed batch (")
    assert (steps, batches_stored, stored) == (3, 1, [0])


def test_the_writer_hands_on_stored_the_groups_the_store_decoded_and_the_live_fold_takes_them(
    tmp_path,
):
    """A batch stored now reaches ``on_stored`` with its step groups as the store decoded
    them (``step_group_columns`` of each, in order; a duplicate does not reach it), and the
    live fold takes those instead of decoding the batch again: given other columns, the
    window holds theirs."""
    two = batch(1, range(3), rank=0)
    add_steps(two, [{"step": 3, "end_us": 30, "step_us": 9, "forward_us": 4}])
    handed: list[tuple] = []

    async def main():
        writer = Writer(Store(tmp_path / "t.sqlite"), lambda b, g: handed.append((b.seq, g)))
        writer.start()
        await writer.queue_batch(two)
        await writer.queue_batch(batch(1, range(3), rank=0))  # a resend: a duplicate
        await writer.close()

    asyncio.run(main())
    assert handed == [(1, [step_group_columns(g) for g in two.step_groups])]
    assert [names for names, _ in handed[0][1]] == [
        ("step", "end_us", "step_us"),
        ("step", "end_us", "step_us", "forward_us"),
    ]
    live = LiveAggregates("r", 1)
    live.on_batch(two, [(("step", "end_us", "step_us"), [[7], [70], [11]])] * 2)
    assert live.ranks[0].steps.tail(4) == {"step": (7, 7), "end_us": (70, 70), "step_us": (11, 11)}


def test_a_relay_message_is_one_item_whose_batches_are_answered_each_in_order(tmp_path):
    """``queue_batches`` (a ``RelayUp``'s batches) queues one item with one future: a copy of
    a batch of the same message is refused at once (the copy queued is stored once), a
    malformed batch is refused alone in the results, the others are stored in the one
    transaction with the batches queued beside them, and the results come in the message's
    order; a message that waits past the push-back bound counts each of its batches."""
    good = [batch(1, range(2), rank=r) for r in (0, 1, 2)]
    bad = batch(1, range(2), rank=3, finish=wire.RankFinish(end_state=77))  # no such state
    stored: list[int] = []

    async def main():
        writer = Writer(Store(tmp_path / "t.sqlite"), lambda b, _: stored.append(b.rank))
        alone = asyncio.ensure_future(writer.queue_batch(batch(1, [5], rank=9)))
        message, refused = writer.queue_batches([good[0], good[1], good[1], bad, good[2]])
        assert message is not None and writer._queue.qsize() == 2  # one item each
        writer.start()
        results = await message
        steps = await writer.call(rows, writer.store, "SELECT rank, step FROM steps")
        # a message that waits: pushed back as a whole, each of its batches counted
        stalled = Writer(Store(tmp_path / "s.sqlite"), lambda b, _: None, pushback_after_s=0.0)
        stalled._sweeper = asyncio.ensure_future(stalled._push_back_waiting())
        waiting, _ = stalled.queue_batches([batch(1, [0], rank=r) for r in (0, 1, 2)])
        with pytest.raises(QueueFull, match="not stored within 0 s"):
            await waiting
        await stalled.close()
        await writer.close()
        return refused, results, (await alone), steps, writer, stalled.batches_pushed_back

    refused, results, alone, steps, writer, pushed_back = asyncio.run(main())
    assert {i: str(exc) for i, exc in refused.items()} == {
        2: "a copy of this batch waits to be stored"
    }
    assert [(r.stored_seq, r.duplicate, r.kind) for r in results] == [
        (1, False, ""),
        (1, False, ""),
        (0, False, "malformed"),
        (1, False, ""),
    ]
    assert (alone.stored_seq, alone.duplicate) == (1, False)
    assert sorted(steps) == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1), (9, 5)]
    assert (stored, writer.batches_stored, writer.batches_pushed_back) == ([9, 0, 1, 2], 4, 1)
    assert pushed_back == 3


def noting_writer(path: Path, transactions: list[list[int]]) -> Writer:
    """A started writer of a real store at ``path`` whose every transaction's ranks, in order,
    go to ``transactions`` (one list each); on a running event loop."""
    store = Store(path)
    write = store.write_batches
    store.write_batches = lambda batches, *a: (
        transactions.append([b.rank for b in batches]) or write(batches, *a)
    )
    writer = Writer(store, lambda b, _: None)
    writer.start()
    return writer


def test_while_node_0_paces_a_message_that_finds_the_writer_idle_waits_to_share_its_transaction(
    tmp_path,
):
    """While node 0 asks its senders for a pace (``Writer.pace``), a relay message that finds
    the writer idle waits ``PACED_LINGER_S`` for others: one queued 20 ms after it shares its
    transaction. Without a pace each goes at once, in a transaction of its own."""
    transactions: list[list[int]] = []

    async def main():
        writer = noting_writer(tmp_path / "t.sqlite", transactions)
        for pace_s, ranks in ((8.0, (0, 1)), (0.0, (2, 3))):
            writer.pace(pace_s)
            first, _ = writer.queue_batches([batch(1, [0], rank=ranks[0])])
            await asyncio.sleep(0.02)
            second, _ = writer.queue_batches([batch(1, [0], rank=ranks[1])])
            await asyncio.gather(first, second)
        await writer.close()

    assert PACED_LINGER_S == 0.2
    asyncio.run(main())
    assert transactions == [[0, 1], [2], [3]]


def test_a_linger_never_holds_a_batch_its_sender_waits_on_nor_a_drain(tmp_path):
    """A batch its sender waits on (``urgent``: a backlog drained one batch in flight, a
    close, a ``traceml.summary()``) never waits while node 0 paces, and ends a linger under
    way, as a ``drain`` does: each is stored at once, not after the linger (set to 60 s here,
    so a linger that held one would outlast the 20 s each is given)."""
    transactions: list[list[int]] = []

    async def main():
        writer = noting_writer(tmp_path / "t.sqlite", transactions)
        writer.pace(8.0)
        writer.linger_s = 60.0
        urgent = batch(1, [0], rank=0)
        urgent.urgent = True
        alone, _ = writer.queue_batches([urgent])  # never waits
        await asyncio.wait_for(alone, 20)
        lingering, _ = writer.queue_batches([batch(1, [0], rank=1)])
        await asyncio.sleep(0.02)
        urgent = batch(1, [0], rank=2)
        urgent.urgent = True
        ending, _ = writer.queue_batches([urgent])  # ends the linger under way
        await asyncio.wait_for(asyncio.gather(lingering, ending), 20)
        lingering, _ = writer.queue_batches([batch(1, [0], rank=3)])
        await asyncio.sleep(0.02)
        assert await writer.drain(20) is True  # a drain ends it too
        await writer.close()

    asyncio.run(main())
    assert transactions == [[0], [1, 2], [3]]


def test_a_failing_on_stored_stops_neither_the_writer_nor_later_batches(tmp_path):
    """``on_stored`` raising for a batch (a bug of the live state) is counted; that batch and
    every later one are stored and answered (issue 24, item 8: one exception stopped the
    writer, and every later ``queue_batch`` future waited for ever)."""
    seen: list[int] = []

    def on_stored(b, _groups) -> None:
        seen.append(b.seq)
        if b.seq == 1:
            raise KeyError("a bug")

    async def main():
        writer = Writer(Store(tmp_path / "t.sqlite"), on_stored)
        writer.start()
        answered = [
            await asyncio.wait_for(writer.queue_batch(batch(s, range(2 * s - 2, 2 * s))), 10)
            for s in (1, 2, 3)
        ]
        steps = await writer.call(count, writer.store, "SELECT COUNT(*) FROM steps")
        await writer.close()
        return answered, steps, writer

    answered, steps, writer = asyncio.run(main())
    assert [(r.stored_seq, r.duplicate, r.rejected) for r in answered] == [
        (1, False, ""),
        (2, False, ""),
        (3, False, ""),
    ]
    assert (steps, seen, writer.batches_stored, writer.on_stored_errors) == (6, [1, 2, 3], 3, 1)


def test_a_value_beyond_the_stores_integers_is_dropped_not_its_batch(tmp_path):
    """The wire's integers go to 2**64 - 1, SQLite's to 2**63 - 1: a value between is
    dropped, counted, and the rest of its batch is stored with the batches that shared its
    transaction (issue 24, item 4: the batch was refused, and its sender sent no more)."""
    big = 1 << 63
    good = batch(1, range(3), rank=0)
    wide = wire.Batch(run_name="r", rank=1, seq=1)
    add_steps(
        wide,
        [
            {"step": 0, "end_us": 1, "step_us": 1, "flops": big},  # the flops alone dropped
            {"step": 1, "end_us": 2, "step_us": 1, "flops": 7},
            {"step": 2, "end_us": 2**64 - 1, "step_us": 1, "flops": 7},  # the whole step dropped
            {"step": 3, "end_us": 4, "step_us": 1, "flops": big, "peak_allocated_bytes": big},
        ],
    )
    wide.process_samples.add(unix_us=5, rss_bytes=big, cpu_percent=1.0)
    wide.flops_counts.add(step=0, forward_flops=3, count_us=big)

    async def main():
        writer = Writer(Store(tmp_path / "t.sqlite"), lambda b, _: None)
        futures = [asyncio.ensure_future(writer.queue_batch(b)) for b in (good, wide)]
        await asyncio.sleep(0)  # both queued before the writer takes them: one transaction
        writer.start()
        done = await asyncio.gather(*futures)
        steps = await writer.call(
            rows,
            writer.store,
            "SELECT rank, step, flops, peak_allocated_bytes FROM steps ORDER BY rank, step",
        )
        process = await writer.call(rows, writer.store, "SELECT rss_bytes FROM process_samples")
        flops = await writer.call(rows, writer.store, "SELECT count_us FROM rank_flops")
        await writer.close()
        return done, steps, process, flops

    done, steps, process, flops = asyncio.run(main())
    assert [(r.stored_seq, r.rejected, r.values_dropped) for r in done] == [(1, "", 0), (1, "", 6)]
    assert steps == [
        (0, 0, None, None),
        (0, 1, None, None),
        (0, 2, None, None),
        (1, 0, None, None),
        (1, 1, 7, None),
        (1, 3, None, None),
    ]
    assert (process, flops) == ([(None,)], [(0,)])


def test_drain_waits_for_what_was_queued_before_it_not_for_a_flood(tmp_path):
    """A Summarize drains the writer under a flood of batches: it waits for the batches queued
    before it, not for an empty queue, which a flood never leaves (it timed out then)."""
    stored: list[int] = []

    async def main():
        writer = Writer(Store(tmp_path / "t.sqlite"), lambda b, _: stored.append(b.seq))
        early = [asyncio.ensure_future(writer.queue_batch(batch(s, range(2)))) for s in (1, 2)]
        await asyncio.sleep(0)
        writer.start()
        flooding, later = True, []

        async def flood():  # the queue is never empty while it runs
            while flooding and len(later) < 20_000:
                later.append(
                    asyncio.ensure_future(writer.queue_batch(batch(len(later) + 3, range(1))))
                )
                await asyncio.sleep(0)

        flooder = asyncio.ensure_future(flood())
        drained = await writer.drain(5.0)
        seen, flooding = list(stored), False
        await asyncio.gather(*early, flooder)
        await asyncio.gather(*later)
        await writer.close()
        return drained, seen, len(later), len(stored)

    drained, seen, flooded, total = asyncio.run(main())
    assert drained is True
    assert seen[:2] == [1, 2]
    assert 0 < flooded < 20_000 and total == flooded + 2


def test_a_second_process_reusing_the_stream_is_refused_not_dropped(tmp_path):
    """Another job with this run's name and rank starts again at seq 1: its batches must be
    refused with a reason (the SDK then warns and stops), never acknowledged as duplicates."""
    store = Store(tmp_path / "t.sqlite")
    ident = wire.RankIdentity(run_name="r", rank=0, pid=100, hostname="h")
    assert results(store, batch(1, range(3), identity=ident)) == [(1, False)]
    # the same process resending its first batch: a duplicate
    assert results(store, batch(1, range(3), identity=ident)) == [(1, True)]
    other = wire.RankIdentity(run_name="r", rank=0, pid=200, hostname="h")
    [refused] = store.write_batches([batch(1, range(3), identity=other)], 0)
    assert (refused.duplicate, refused.rejected, refused.kind) == (
        False,
        "rank 0 (attempt 0) of this run already streamed from pid 100 on h, not from pid 200: "
        "use a new run name, or, for processes the script starts itself "
        "(torch.multiprocessing.spawn), call traceml.init() after init_process_group so that "
        "each reports its own rank",
        "second_sender",
    )
    assert count(store, "SELECT COUNT(*) FROM steps") == 3


def test_an_empty_step_group_stores_nothing_and_returns(tmp_path):
    """A StepColumns with no column (a sender's bug, or a fuzzer's) is no step; before the fix
    its insert zipped two endless repeats and the writer thread never came back. Run in a
    child limited to 1 GiB and 60 s, so that a regression fails instead of eating the host."""
    import subprocess
    import sys

    code = f"""
import resource, sys
resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
sys.path.insert(0, {str(Path(__file__).parent)!r})
from test_store import Store, batch, count, results
store = Store({str(tmp_path / "t.sqlite")!r})
empty = batch(1, range(2))
empty.step_groups.add()  # no column at all
print(results(store, empty), count(store, "SELECT COUNT(*) FROM steps"))
"""
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )
    assert (result.returncode, result.stdout) == (0, "[(1, False)] 2\n"), result.stderr[-500:]


def test_a_node_exit_that_fails_leaves_no_transaction_open(tmp_path):
    """An end state this version does not know fails its report alone; before the fix the
    transaction stayed open and every later write of the run failed with it."""
    store = Store(tmp_path / "t.sqlite")
    with pytest.raises(ValueError):
        store.write_node_exit(node_exit([rank_end(0, 99, 1)], exit_code=1, hostname="h"), 0)
    assert results(store, batch(1, range(3))) == [(1, False)]
    store.write_node_exit(node_exit([rank_end(0, "failed")], exit_code=1, hostname="h"), 5)
    assert rows(store, "SELECT node_rank, exit_code, received_unix_us FROM node_exits") == [
        (0, 1, 5)
    ]
    assert rows(store, "SELECT rank, end_state FROM rank_ends") == [(0, "failed")]
    assert count(store, "SELECT COUNT(*) FROM steps") == 3


def test_a_second_process_ahead_of_the_stored_stream_is_refused(tmp_path):
    """Another process introducing itself as a stored (rank, restart) with a sequence number
    above the stored one would overwrite the identity and add its steps: refused."""
    store = Store(tmp_path / "t.sqlite")
    ident = wire.RankIdentity(run_name="r", rank=0, pid=100, hostname="h")
    assert results(store, batch(1, range(3), identity=ident)) == [(1, False)]
    other = wire.RankIdentity(run_name="r", rank=0, pid=200, hostname="h")
    [refused] = store.write_batches([batch(50, range(3, 9), identity=other)], 0)
    assert (refused.kind, refused.duplicate) == ("second_sender", False)
    assert rows(store, "SELECT pid FROM ranks") == [(100,)]
    assert count(store, "SELECT COUNT(*) FROM steps") == 3
    # The stream goes on: its next batch is stored.
    assert results(store, batch(2, range(3, 5))) == [(2, False)]


def test_an_attempt_older_than_a_stored_one_is_refused_across_reopens(tmp_path):
    store = Store(tmp_path / "t.sqlite")
    assert results(store, batch(1, range(2), restart=1)) == [(1, False)]
    [refused] = store.write_batches([batch(1, range(2, 4), restart=0)], 0)
    assert refused.kind == "restart_regressed"
    assert refused.rejected == "a batch of rank 0 from attempt 0: attempt 1 is already stored"
    # Another rank's attempt 0, and the latest attempt, are still stored.
    assert results(store, batch(1, range(2), rank=1), batch(2, range(2, 3), restart=1)) == [
        (1, False),
        (2, False),
    ]
    store.close()
    reopened = Store(tmp_path / "t.sqlite")
    [again] = reopened.write_batches([batch(1, range(2, 4), restart=0)], 0)
    assert again.kind == "restart_regressed"
    assert count(reopened, "SELECT COUNT(*) FROM steps") == 5
