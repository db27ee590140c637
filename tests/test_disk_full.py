"""The store on a full disk (a small tmpfs): nothing acknowledged that was not committed.

SQLite rolls a transaction back by itself when the disk is full. Before the fix the store's own
ROLLBACK then raised "no transaction is active", the stored sequence numbers kept the values of
the batches that were rolled back, and the writer's one-by-one retry acknowledged those batches
as duplicates: lost without a word. Needs root (``mount -t tmpfs``); skipped otherwise.
"""

from __future__ import annotations

import asyncio
import json
import os
import sqlite3
import subprocess

import pytest
from conftest import EXAMPLES, free_port, run_traceml
from helpers.batches import rank_batch

from traceml import wire
from traceml_aggregator.nodes import NodeRegistry
from traceml_aggregator.sessions import NodeSessions
from traceml_aggregator.store import NODE_LOSSES_META_KEY, Store
from traceml_aggregator.writer import Writer

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")


@pytest.fixture
def small_fs(tmp_path):
    """A 1 MiB tmpfs at ``tmp_path/fs``, unmounted afterwards."""
    mount = tmp_path / "fs"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], check=True)
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=True)


def fill(directory) -> None:
    """Take every free byte of ``directory``'s filesystem (file ``filler``)."""
    with open(directory / "filler", "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError:
            pass


def batch(seq: int, rank: int, steps: int = 200) -> wire.Batch:
    return rank_batch(
        seq,
        range(steps),
        rank=rank,
        row=lambda i: {"step": i, "end_us": i + 1, "step_us": 1000 + i},
    )


def stored_steps(store: Store) -> dict[int, int]:
    return dict(store.query("SELECT rank, COUNT(*) FROM steps GROUP BY rank", by_name=False))


def test_a_full_disk_fails_the_transaction_and_forgets_its_seqs(small_fs):
    store = Store(small_fs / "t.sqlite")
    assert [r.stored_seq for r in store.write_batches([batch(1, 0)], 0)] == [1]
    fill(small_fs)
    with pytest.raises(sqlite3.OperationalError, match="full"):
        store.write_batches([batch(2, 0), batch(1, 1)], 0)
    (small_fs / "filler").unlink()
    # Resent after space came back: stored, not taken for duplicates of what was rolled back.
    results = store.write_batches([batch(2, 0), batch(1, 1)], 0)
    assert [(r.stored_seq, r.duplicate) for r in results] == [(2, False), (1, False)]
    assert stored_steps(store) == {0: 400, 1: 200}
    store.close()


def test_the_writer_acknowledges_nothing_on_a_full_disk_and_everything_after(small_fs):
    """Batches of three ranks share a transaction that the full disk fails; the writer's retry
    one by one fails too, so every handler learns of the error (the rank resends) and none is
    acknowledged; resent once the disk has room, each is stored exactly once."""
    acked: list[int] = []

    async def main():
        writer = Writer(Store(small_fs / "t.sqlite"), lambda b, _: acked.append(b.rank))
        writer.start()
        first = await writer.queue_batch(batch(1, 0))
        fill(small_fs)
        full = await asyncio.gather(
            *(writer.queue_batch(batch(s, r)) for r, s in ((0, 2), (1, 1), (2, 1))),
            return_exceptions=True,
        )
        (small_fs / "filler").unlink()
        again = await asyncio.gather(
            *(writer.queue_batch(batch(s, r)) for r, s in ((0, 2), (1, 1), (2, 1)))
        )
        steps = await writer.call(stored_steps, writer.store)
        await writer.close()
        return first, full, again, steps

    first, full, again, steps = asyncio.run(main())
    assert (first.stored_seq, first.duplicate) == (1, False)
    assert [type(e) for e in full] == [sqlite3.OperationalError] * 3
    assert [(r.stored_seq, r.duplicate) for r in again] == [(2, False), (1, False), (1, False)]
    assert steps == {0: 400, 1: 200, 2: 200}
    assert sorted(acked) == [0, 0, 1, 2]


def test_node_loss_detection_goes_on_through_a_full_disk(small_fs, caplog):
    """Node 1 is lost while the disk is full: its loss record cannot be stored, the check says
    so and returns (before, the store's error ended the watch that runs the check, and no node
    was marked lost for the rest of the run). Node 2, lost once the disk has room, is marked,
    and both records are stored."""

    async def main():
        writer = Writer(Store(small_fs / "t.sqlite"), lambda b, _: None)
        writer.start()

        async def persist(key, value):
            await writer.call(writer.store.set_meta, key, json.dumps(value))

        sessions = NodeSessions(
            NodeRegistry(own_host="node0", nnodes=3),
            store_exit=None,
            finalize=None,
            persist=persist,
            foreign=None,
            refuse=None,
            lost_after_s=0.0,  # silent for any time at all: lost at the next check
        )
        sessions.expect({1})
        fill(small_fs)
        on_full_disk = await sessions.check_lost()
        (small_fs / "filler").unlink()
        sessions.expect({2})
        with_room = await sessions.check_lost()
        stored = await writer.call(writer.store.meta)
        await writer.close()
        return on_full_disk, with_room, json.loads(stored[NODE_LOSSES_META_KEY])

    on_full_disk, with_room, losses = asyncio.run(main())
    assert (on_full_disk, with_room) == ([1], [2])
    assert "warning: the node losses were not stored (database or disk is full)" in caplog.text
    assert [(r["node_rank"], r["resumed_unix_s"]) for r in losses] == [(1, None), (2, None)]


def test_an_atomic_write_on_a_full_disk_raises_and_leaves_no_temporary_file(small_fs):
    """The run directory's files (manifests, the run token, the reports) are written through a
    temporary file and a rename: on a full disk the write raises ENOSPC, the file keeps its
    old content, and the temporary file is gone."""
    from traceml.core.rundir import write_atomic

    path = small_fs / "manifest.json"
    write_atomic(path, "old\n", mode=0o600, sync=True)
    fill(small_fs)
    with pytest.raises(OSError) as raised:
        write_atomic(path, "x" * 65536, mode=0o600, sync=True)
    assert raised.value.errno == 28  # ENOSPC
    assert sorted(p.name for p in small_fs.iterdir()) == ["filler", "manifest.json"]
    assert path.read_text() == "old\n" and oct(path.stat().st_mode & 0o777) == "0o600"


@pytest.mark.torchrun
def test_a_launch_on_a_full_disk_is_refused_in_one_line_and_leaves_nothing(tmp_path, small_fs):
    """``traceml run --logs-dir`` on a full disk: node 0 cannot write the run token, so the
    launch is refused before anything starts (one line, exit code 2) and the directories it
    made for the run are removed: the disk holds what it held."""
    fill(small_fs)
    args = ["run", str(EXAMPLES / "ddp_minimal.py"), "--run-name", "full"]
    args += ["--logs-dir", str(small_fs), "--aggregator-port", str(free_port())]
    result = run_traceml(args, tmp_path, timeout=60)
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [
        f"traceml: error: cannot write the run token to {small_fs / 'full' / 'run_token'}: "
        "No space left on device"
    ]
    assert sorted(p.name for p in small_fs.iterdir()) == ["filler"]
