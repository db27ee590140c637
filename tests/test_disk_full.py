"""The store on a full disk (a small tmpfs): nothing acknowledged that was not committed.

SQLite rolls a transaction back by itself when the disk is full. Before the fix the store's own
ROLLBACK then raised "no transaction is active", the stored sequence numbers kept the values of
the batches that were rolled back, and the writer's one-by-one retry acknowledged those batches
as duplicates: lost without a word. Needs root (``mount -t tmpfs``); skipped otherwise.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import time

import pytest
from conftest import EXAMPLES, free_port, run_traceml, start_traceml, wait_for
from helpers.aggregator import LiveAggregator, finish, make_client, step
from helpers.batches import rank_batch
from helpers.node_sessions import loss_watch

from traceml import wire
from traceml.core.disk_reserve import RESERVE_BYTES
from traceml.sdk import client as client_mod
from traceml_aggregator.store import NODE_LOSSES_META_KEY, Store
from traceml_aggregator.writer import StoreFailed, Writer

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")


@contextlib.contextmanager
def tmpfs(mount, size: str):
    """A tmpfs of ``size`` (``mount -o size=``) at the new directory ``mount``, unmounted
    afterwards."""
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)], check=True)
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=True)


@pytest.fixture
def small_fs(tmp_path):
    """A 1 MiB tmpfs at ``tmp_path/fs``."""
    with tmpfs(tmp_path / "fs", "1m") as mount:
        yield mount


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
    one by one fails too, so every handler hears a push-back (the rank keeps the batch and
    sends it again) and none is acknowledged; the writer says since when the store fails.
    Resent once the disk has room, each is stored exactly once, and the failure is over."""
    acked: list[int] = []

    async def main():
        writer = Writer(Store(small_fs / "t.sqlite"), lambda b, _: acked.append(b.rank))
        writer.start()
        first = await writer.queue_batch(batch(1, 0))
        fill(small_fs)
        before_s = time.time()
        full = await asyncio.gather(
            *(writer.queue_batch(batch(s, r)) for r, s in ((0, 2), (1, 1), (2, 1))),
            return_exceptions=True,
        )
        failure = writer.store_failure
        (small_fs / "filler").unlink()
        again = await asyncio.gather(
            *(writer.queue_batch(batch(s, r)) for r, s in ((0, 2), (1, 1), (2, 1)))
        )
        steps = await writer.call(stored_steps, writer.store)
        await writer.close()
        return first, full, (before_s, failure, writer.store_failure), again, steps

    first, full, (before_s, failure, after), again, steps = asyncio.run(main())
    assert (first.stored_seq, first.duplicate) == (1, False)
    error = "OperationalError: database or disk is full"
    failed = f"node 0's store cannot commit ({error})"
    assert [(type(e), str(e)) for e in full] == [(StoreFailed, failed)] * 3
    assert failure[1] == error and before_s <= failure[0] <= time.time()
    assert after is None
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

        # silent for any time at all: lost at the next check
        sessions = loss_watch(persist, lost_after_s=0.0, nnodes=3)
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


@pytest.mark.aggregator
def test_a_rank_whose_aggregator_died_after_a_full_disk_does_not_blame_the_disk(small_fs):
    """The store's failure pushes a rank's batch back with its reason; then the aggregator is
    SIGKILLed. What the rank knows now is that node 0 does not answer: its exit line says how
    long it waited for an acknowledgement, after waiting for one, not the store's error, which
    no longer holds (before: the stale error, and no wait for an aggregator that might come
    back)."""
    warnings: list[str] = []
    with LiveAggregator(small_fs / "run", "mine") as agg:
        client = make_client(agg.target, "mine", warnings, rpc_timeout_s=0.5)
        client.submit(client_mod.STEPS, step(0))
        wait_for(lambda: client.stats.acked == 1)
        fill(small_fs)
        client.submit(client_mod.STEPS, step(1))
        wait_for(lambda: client.stats.pushed_back >= 1)
        agg.kill()
        wait_for(lambda: client.stats.send_failures >= 1)
        started = time.monotonic()
        assert client.close(finish(2), timeout_s=2.0) is False
        waited_s = time.monotonic() - started
    assert waited_s >= 2.0
    assert warnings[-1].startswith(
        "telemetry not delivered at exit: 1 records (no acknowledgement within "
    ), warnings
    assert not any("store cannot commit" in w for w in warnings), warnings


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


def run_filling_the_disk(tmp_path, after_fill=None, size: str = "48m"):
    """``traceml run`` of 2 ranks, 300 steps of 30 ms, with its run directory on a tmpfs of
    ``size`` that fills at step 150 (after a few flushes, every 2 s), then
    ``after_fill(run_dir)``; returns when the fill began (Unix s), the launcher's stdout and
    stderr, the summary (None: not saved), and the run directory's listing. The launcher exits
    0; on 48 MiB, the aggregator held :data:`RESERVE_BYTES`, allocated."""
    with tmpfs(tmp_path / "fs", size) as fs:
        run_dir = fs / "filled"
        args = ["run", str(EXAMPLES / "ddp_minimal.py"), "--nproc-per-node=2"]
        args += ["--run-name", "filled", "--logs-dir", str(fs)]
        args += ["--aggregator-port", str(free_port()), "--finalize-timeout-sec", "120"]
        launcher = start_traceml(
            args + ["--", "--steps", "300", "--step-ms", "30", "--mark-step", "150"],
            tmp_path,
            tmp_path / "launcher",
        )
        try:
            out = tmp_path / "launcher.out"
            wait_for(lambda: "at step 150" in out.read_text(), 60, "step 150")
            if size == "48m":
                reserve = run_dir / ".disk_reserve"
                assert reserve.stat().st_blocks * 512 == RESERVE_BYTES  # taken, not sparse
            filled_s = time.time()
            fill(fs)
            if after_fill is not None:
                after_fill(run_dir)
            code = launcher.wait(timeout=200)
        finally:
            launcher.kill()
            launcher.wait()
        err = (tmp_path / "launcher.err").read_text()
        assert code == 0, err
        saved = run_dir / "final_summary.json"
        summary = json.loads(saved.read_text()) if saved.exists() else None
        return filled_s, out.read_text(), err, summary, sorted(p.name for p in run_dir.iterdir())


@pytest.mark.slow
@pytest.mark.torchrun
def test_a_disk_that_fills_mid_run_ends_the_run_at_once_with_a_summary_of_what_was_stored(
    tmp_path,
):
    """The run directory's disk fills while 2 ranks train (under the relay, the default). Node
    0's store stops committing; the ranks' batches are pushed back (kept, sent again), not
    taken for a lost aggregator, and saying why: at exit the ranks and the node's sampler stop
    waiting for acknowledgements that cannot come (before: 10 s each). The node's exit is
    counted though it cannot be stored, so finalization does not wait its budget for finish
    markers the store cannot take (before: 330 s, then no summary). The aggregator gives back
    the room it held (``.disk_reserve``) and writes into it the node's exit, the summary, and
    why the summary covers only the steps stored before the disk filled
    (``AGGREGATOR_LOST``)."""
    filled_s, _, err, summary, listing = run_filling_the_disk(tmp_path)
    error = "OperationalError: database or disk is full"
    loss = summary["run"]["telemetry_health"]["aggregator_loss"]
    assert loss["reason"] == f"its store failed to commit: {error}"
    assert filled_s <= loss["lost_unix_s"] <= filled_s + 5
    at = time.strftime("%H:%M:%S UTC", time.gmtime(loss["lost_unix_s"]))
    lines = err.splitlines()
    assert (
        f"traceml: warning: the summary above: the store has failed to commit since {at} "
        f"({error}): the summary covers only what was stored before"
    ) in lines
    undelivered = [line for line in lines if "not delivered at exit" in line]
    assert len(undelivered) == 3, err  # the 2 ranks and the node's sampler
    for line in undelivered:
        assert line.endswith(f" records (node 0's store cannot commit ({error})); 0 dropped before")
    assert "lost node 0's aggregator" not in err and "unreachable" not in err
    assert "no finalization result" not in err
    assert [(r["rank"], r["end"]["state"]) for r in summary["ranks"]] == [
        (0, "completed"),
        (1, "completed"),
    ]
    stored = {r["rank"]: r["records_received"] for r in summary["ranks"]}
    assert sorted(stored) == [0, 1] and all(0 < n < 300 for n in stored.values()), stored
    (lost,) = [f for f in summary["findings"]["health"] if f["kind"] == "AGGREGATOR_LOST"]
    assert lost["evidence"]["steps_stored"] == {str(r): n for r, n in stored.items()}
    assert ".disk_reserve" not in listing and "final_summary.txt" in listing


@pytest.mark.slow
@pytest.mark.torchrun
def test_an_aggregator_killed_on_a_full_disk_leaves_its_room_to_its_replacement(tmp_path):
    """The disk fills, then node 0's aggregator is SIGKILLed. Its launcher gives the bytes the
    dead one held back before it restarts it (before, every replacement failed to open the
    store on the full disk, and the summary written from the store failed too: no summary).
    The replacement serves on the room, the ranks resend what was pushed back, and the
    summary is written, with every step."""

    def kill_the_aggregator(run_dir):
        (pid,) = [int(p) for p in _pgrep("-f", f"traceml_aggregator --run-dir {run_dir} ")]
        os.kill(pid, signal.SIGKILL)

    _, _, err, summary, listing = run_filling_the_disk(tmp_path, kill_the_aggregator)
    assert "the aggregator exited with code 137 during the run; restarted it" in err, err
    assert summary["run"]["telemetry_health"]["aggregator_restarts"] == 1
    assert summary["run"]["telemetry_health"]["aggregator_loss"] is None
    assert [(r["rank"], r["end"]["state"], r["steps_completed"]) for r in summary["ranks"]] == [
        (0, "completed", 300),
        (1, "completed", 300),
    ]
    assert ".disk_reserve" not in listing


@pytest.mark.slow
@pytest.mark.torchrun
def test_a_disk_without_room_even_for_the_reserve_still_prints_a_true_summary(tmp_path):
    """The run directory's disk has not 32 MiB free at the start (a 24 MiB tmpfs): nothing is
    held, and when it fills nothing can be stored at the end either, not even the summary.
    The summary reaches the console, and says what the aggregator knows but could not store:
    both ranks completed (their node's exit), and the store failed since the fill
    (``AGGREGATOR_LOST``). Before, it named the ranks never reported and hid the loss."""
    filled_s, out, err, summary, _ = run_filling_the_disk(tmp_path, size="24m")
    assert summary is None
    text = " ".join(out.split())
    assert "Rank end states completed: 2 of 2 ranks" in text, out
    assert "RANK_NEVER_REPORTED" not in text
    error = "OperationalError: database or disk is full"
    assert "[warning] AGGREGATOR_LOST: Node 0's aggregator stopped storing at " in text
    assert f"(its store failed to commit: {error})" in text
    assert "final_summary.json not written (No space left on device)" in err


def _pgrep(*args: str) -> list[str]:
    return subprocess.run(["pgrep", *args], capture_output=True, text=True).stdout.split()
