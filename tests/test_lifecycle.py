"""The aggregator's lifetime, without torchrun: the port check, an owned aggregator that
outlives SIGTERM and ends with its launcher's pipe, a restart that remembers the run, the
offline finalization, and a Finalize that a signal cuts short. Real processes, real gRPC over
real sockets, real SQLite."""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time

import grpc
import psutil
import pytest
from conftest import free_port, query
from helpers.aggregator import aggregator_cmd, listening_port, run_finalize_only
from helpers.batches import node_claim
from helpers.waiting import LOADED_CALL_S
from live_aggregator import LiveAggregator, finish, make_client, step

from traceml import wire
from traceml.core.endpoint import call as rpc
from traceml.launcher import aggregator
from traceml.launcher.config import LaunchError
from traceml.launcher.run import check_port_free
from traceml.launcher.session import NodeSession
from traceml.sdk.client import STEPS


@pytest.mark.aggregator
def test_port_held_only_by_time_wait_is_free(tmp_path):
    """An aggregator SIGKILLed with connected clients leaves its side of each connection in
    TIME_WAIT for 60 s; nothing listens, so the port is free for the next run. The clients are
    plain TCP connections that sent nothing: a gRPC client's stream would leave unread bytes
    (pings, window updates) at the kill, and the kernel resets such a socket instead."""
    with LiveAggregator(tmp_path / "run", "tw") as agg:
        clients = [socket.create_connection(("127.0.0.1", agg.port), timeout=5) for _ in range(2)]
        time.sleep(0.5)  # accepted by the server
        agg.kill()
        deadline = time.monotonic() + 10
        states: set = set()
        while time.monotonic() < deadline:  # the clients see the close and close their ends
            for client in clients:
                if client.fileno() != -1 and client.recv(1) == b"":
                    client.close()
            states = {
                c.status
                for c in psutil.net_connections("tcp")
                if c.laddr and c.laddr.port == agg.port
            }
            if psutil.CONN_TIME_WAIT in states:
                break
            time.sleep(0.1)
        for client in clients:
            client.close()
        assert psutil.CONN_TIME_WAIT in states, states
        with socket.socket(socket.AF_INET6) as plain:  # the check as it was: no SO_REUSEADDR
            with pytest.raises(OSError) as refused:
                plain.bind(("::", agg.port))
            assert refused.value.errno == errno.EADDRINUSE
        check_port_free("127.0.0.1", agg.port)  # does not raise


def test_port_with_a_plain_listener_is_refused():
    with listening_port() as port, pytest.raises(LaunchError, match="already in use"):
        check_port_free("127.0.0.1", port)


def _owned(tmp_path, name: str, *extra: str) -> subprocess.Popen:
    port = free_port()
    process = subprocess.Popen(
        aggregator_cmd(
            tmp_path / name, name, "--port", str(port), "--owned", "--no-summary-at-stop", *extra
        ),
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=open(tmp_path / f"{name}.log", "wb"),
    )
    aggregator.wait_serving(f"127.0.0.1:{port}", 60, process)
    process.target = f"127.0.0.1:{port}"
    return process


@pytest.mark.aggregator
def test_owned_aggregator_outlives_sigterm_and_ends_with_its_pipe(tmp_path):
    process = _owned(tmp_path, "owned")
    process.send_signal(signal.SIGTERM)
    process.send_signal(signal.SIGINT)
    # still serving after both (the health check polls; the process is checked alive)
    aggregator.wait_serving(process.target, LOADED_CALL_S, process)
    assert process.poll() is None
    assert aggregator.stop(process, 30) == 0
    log = (tmp_path / "owned.log").read_text()
    assert "got SIGTERM; serving on until the launcher" in log
    assert "got SIGINT; serving on until the launcher" in log


def test_owned_aggregator_ends_when_its_launcher_is_killed(tmp_path):
    """The launcher's end of the pipe closes however it dies: here a SIGKILLed parent."""
    code = (
        "import subprocess, sys, time;"
        f"p = subprocess.Popen([sys.executable, '-m', 'traceml_aggregator', '--run-dir', "
        f"{str(tmp_path / 'orphan')!r}, '--run-name', 'orphan', '--port', '{free_port()}', "
        "'--owned'], stdin=subprocess.PIPE, start_new_session=True);"
        "print(p.pid, flush=True); time.sleep(600)"
    )
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    child = psutil.Process(int(parent.stdout.readline()))
    parent.kill()
    parent.wait()
    child.wait(60)  # raises psutil.TimeoutExpired if it serves on


@pytest.mark.aggregator
def test_restarted_aggregator_knows_what_the_dead_one_stored(tmp_path):
    """A replacement on the same store takes the finish markers stored before: its Finalize
    is complete at once instead of waiting the budget for a rank that already finished."""
    warnings: list[str] = []
    agg = LiveAggregator(
        tmp_path / "run", "again", world_size=1, extra_args=("--finalize-timeout-sec", "60")
    )
    with agg:
        client = make_client(agg.target, "again", warnings)
        for i in range(3):
            client.submit(STEPS, step(i))
        assert client.close(finish(3))
        agg.kill()
        agg.extra_args += [
            "--restart-reason",
            "killed by the test",
            "--down-since-unix-s",
            f"{time.time() - 1.5:.3f}",
        ]
        agg.start()
        started = time.monotonic()
        reply = rpc(
            agg.target, "Finalize", wire.FinalizeRequest(run_name="again", timeout_s=60), 90
        )
        assert time.monotonic() - started < 10
        assert reply.complete and list(reply.missing_ranks) == [] and not reply.error
        summary = json.loads(open(reply.summary_json_path).read())
        (outage,) = summary["run"]["telemetry_health"]["aggregator_outages"]
        assert outage["reason"] == "killed by the test" and 1.5 <= outage["gap_s"] < 30
        assert summary["run"]["telemetry_health"]["aggregator_restarts"] == 1
        agg.stop()


@pytest.mark.aggregator
def test_a_sigterm_does_not_wait_for_a_starved_live_analysis(tmp_path):
    """The live analysis process stopped (SIGSTOP: what nice 19 on a saturated node looks
    like) in the middle of a Summarize: a SIGTERMed aggregator still writes its summary and
    exits 0 at once, the analysis process gone with it; it waited for the computation before."""
    import threading

    with LiveAggregator(tmp_path / "run", "starved", world_size=1) as agg:
        client = make_client(agg.target, "starved", [])
        for i in range(3):
            client.submit(STEPS, step(i))
        assert client.flush(LOADED_CALL_S)
        aggregator.summarize(agg.target, "starved", LOADED_CALL_S)  # starts the process
        client.submit(STEPS, step(3))  # so that the next Summarize computes anew
        assert client.close(finish(4))
        (analysis,) = [
            child
            for child in psutil.Process(agg.process.pid).children()
            if "spawn_main" in " ".join(child.cmdline())  # not the resource tracker
        ]
        analysis.suspend()
        outcome: list = []

        def ask() -> None:  # waits on the stopped analysis process
            try:
                outcome.append(aggregator.summarize(agg.target, "starved", 60))
            except grpc.RpcError as exc:
                outcome.append(exc)

        try:
            stuck = threading.Thread(target=ask, daemon=True)
            stuck.start()
            # a computation hangs on the stopped process: another call waits behind it (the
            # asker's call has reached the server long before this one's deadline)
            with pytest.raises(grpc.RpcError) as probe:
                aggregator.summarize(agg.target, "starved", 1.0)
            assert probe.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
            started = time.monotonic()
            assert agg.stop(timeout_s=60) == 0
            stopped_s = time.monotonic() - started
            assert not analysis.is_running()
        finally:
            if analysis.is_running():
                analysis.kill()
        stuck.join(60)
    assert stopped_s < 10, f"SIGTERM to exit took {stopped_s:.1f} s"
    # the waiting call ended with the aggregator: cancelled by the server's stop (grpc.aio's
    # words for it)
    (answer,) = outcome
    assert isinstance(answer, grpc.RpcError), answer
    assert (answer.code(), answer.details()) == (
        grpc.StatusCode.UNAVAILABLE,
        "Cancelling all calls",
    ), answer
    summary = json.loads((tmp_path / "run" / "final_summary.json").read_text())
    assert {r["rank"]: r["steps_completed"] for r in summary["ranks"]} == {0: 4}


@pytest.mark.serial
@pytest.mark.aggregator
def test_finalize_is_cut_short_by_a_signal(tmp_path):
    """A finalization asked over node 0's session, waiting its 300 s budget for ranks that
    never come, returns within 0.2 s of the launcher's signal; the one that follows (which
    replaces it at the aggregator) writes the partial summary at once, and only it does."""
    with LiveAggregator(tmp_path / "run", "cut", world_size=2) as agg:
        claim = node_claim(
            0, nnodes=1, hostname=socket.gethostname(), launcher_pid=os.getpid(), run_name="cut"
        )
        session = NodeSession(agg.target, claim).start()
        try:
            assert session.wait_claim(30).accepted
            asked = time.monotonic()
            reply = session.finalize("cut", 300, cancelled=lambda: time.monotonic() - asked > 1.0)
            assert reply is None and time.monotonic() - asked < 3.0
            reply = session.finalize("cut", 0.01)
            assert time.monotonic() - asked < 10.0
            assert list(reply.missing_ranks) == [0, 1] and reply.summary_json_path
            written = os.stat(reply.summary_json_path).st_mtime_ns
            time.sleep(1.0)  # the first request, dropped, writes nothing later
            assert os.stat(reply.summary_json_path).st_mtime_ns == written
        finally:
            session.close()
        agg.stop()


@pytest.mark.aggregator
def test_finalize_only_writes_the_summary_from_the_store(tmp_path):
    from traceml import wire

    warnings: list[str] = []
    agg = LiveAggregator(tmp_path / "run", "offline", world_size=1)
    with agg:
        client = make_client(agg.target, "offline", warnings)
        client.submit(STEPS, step(0))
        assert client.close(finish(1))
        agg.kill()
    report = wire.NodeExit(run_name="offline", node_rank=0, exit_code=0)
    report.ranks.add(rank=0, local_rank=0, end_state=wire.EndState.END_STATE_COMPLETED, exit_code=0)
    (tmp_path / "exit.pb").write_bytes(report.SerializeToString())
    result = run_finalize_only(
        tmp_path / "run", "offline", "--nnodes", "1", "--node-exit-file", str(tmp_path / "exit.pb")
    )
    assert result.returncode == 0, result.stderr
    summary = json.loads((tmp_path / "run" / "final_summary.json").read_text())
    assert summary["run"]["complete"] is True and summary["run"]["status"] == "completed"
    assert "summary written from the store" in result.stderr


@pytest.mark.aggregator
def test_finalize_only_leaves_out_a_node_exit_file_that_is_empty_or_damaged(tmp_path):
    """A 0-byte node exit file (a launcher's write on a full disk) decodes to an empty report
    of no run, and a damaged one does not decode: each is left out with one warning and the
    summary is still written, its rank missing (before: the empty one was stored as node 0's
    exit with code 0, the damaged one lost the summary)."""
    warnings: list[str] = []
    agg = LiveAggregator(tmp_path / "run", "offline", world_size=1)
    with agg:
        client = make_client(agg.target, "offline", warnings)
        client.submit(STEPS, step(0))
        client.flush(30)
        agg.kill()
    for content, why in (
        (b"", "not a node exit of run 'offline' (run ''; an empty file reads as none)"),
        (b"\xff\xff\xff", "DecodeError: Error parsing message"),
    ):
        (tmp_path / "exit.pb").write_bytes(content)
        result = run_finalize_only(
            tmp_path / "run", "offline", "--node-exit-file", str(tmp_path / "exit.pb")
        )
        assert result.returncode == 0, result.stderr
        warning = f"traceml-aggregator: warning: --node-exit-file {tmp_path / 'exit.pb'} left out: "
        assert warning + why in result.stderr, result.stderr
        summary = json.loads((tmp_path / "run" / "final_summary.json").read_text())
        assert summary["nodes"] == []  # no node exit stored: node 0 is not said to exit 0
        assert summary["run"]["missing_ranks"] == [0]


def _refusal(reason: str) -> str:
    """``--finalize-only``'s whole stderr when it refuses the store for ``reason``."""
    return f"traceml-aggregator: error: --finalize-only: {reason}: nothing to finalize\n"


@pytest.mark.aggregator
def test_finalize_only_refuses_a_directory_without_a_store_and_creates_nothing(tmp_path):
    missing, empty = tmp_path / "nope", tmp_path / "empty"
    empty.mkdir()
    for run_dir in (missing, empty):
        result = run_finalize_only(run_dir, "x")
        assert result.returncode == 2, result.stderr
        assert result.stderr == _refusal(f"{run_dir} holds no TraceML store (telemetry.sqlite)")
    assert not missing.exists() and list(empty.iterdir()) == []


@pytest.mark.aggregator
def test_finalize_only_refuses_another_runs_store_and_a_live_one(tmp_path):
    """The store records its run's name: another --run-name is refused, the summary unwritten.
    While an aggregator holds the store (locking_mode=EXCLUSIVE), it is refused as locked."""
    warnings: list[str] = []
    run_dir = tmp_path / "run"
    database = run_dir / "telemetry.sqlite"
    with LiveAggregator(run_dir, "named", world_size=1) as agg:
        client = make_client(agg.target, "named", warnings)
        client.submit(STEPS, step(0))
        client.flush(30)
        result = run_finalize_only(run_dir, "named")  # the aggregator still holds the store
        assert result.returncode == 2, result.stderr
        assert result.stderr == _refusal(
            f"{database} is locked: another aggregator holds it (a live run's store)"
        )
        assert client.close(finish(1))
        assert agg.stop() == 0
    (run_dir / "final_summary.json").unlink()
    result = run_finalize_only(run_dir, "WRONG")
    assert result.returncode == 2, result.stderr
    assert result.stderr == _refusal(
        f"{database} is the store of run 'named', not of --run-name 'WRONG'"
    )
    assert not (run_dir / "final_summary.json").exists()
    assert run_finalize_only(run_dir, "named").returncode == 0  # its own name is accepted


@pytest.mark.aggregator
def test_finalize_only_refuses_a_corrupt_store_in_one_line(tmp_path):
    """Random bytes, and a real store cut to its first page: exit 2, one line naming the file
    and SQLite's cause, no traceback."""
    noise = tmp_path / "noise"
    noise.mkdir()
    (noise / "telemetry.sqlite").write_bytes(random.Random(7).randbytes(64 * 1024))
    result = run_finalize_only(noise, "x")
    assert result.returncode == 2, result.stderr
    assert result.stderr == _refusal(
        f"cannot read {noise / 'telemetry.sqlite'}: file is not a database"
    )
    warnings: list[str] = []
    cut = tmp_path / "cut"
    with LiveAggregator(cut, "cut", world_size=1) as agg:
        client = make_client(agg.target, "cut", warnings)
        for i in range(200):
            client.submit(STEPS, step(i))
        assert client.close(finish(200))
        assert agg.stop() == 0
    database = cut / "telemetry.sqlite"
    with open(database, "r+b") as file:
        file.truncate(database.stat().st_size // 2)
    result = run_finalize_only(cut, "cut")
    assert result.returncode == 2, result.stderr
    assert result.stderr == _refusal(f"cannot read {database}: database disk image is malformed")


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_tee_drains_the_pipe_when_the_log_disk_is_full(tmp_path):
    """4 MiB through a pipe whose log lives on a 1 MiB tmpfs: the writer (a rank's print)
    never blocks, the console gets every byte, the log stops at the full disk and the rest is
    counted."""
    from traceml.launcher.torchrun import Tee

    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)], check=True)
    try:
        read_end, write_end = os.pipe()
        console_path = tmp_path / "console"
        with open(read_end, "rb") as source, open(console_path, "wb") as console:
            tee = Tee(source, console, disk / "training.stdout.log")
            chunk = b"y" * 65536
            with open(write_end, "wb", buffering=0) as sink:
                for _ in range(64):  # a blocked pipe (64 KiB) would stop this loop
                    sink.write(chunk)
            tee.join(30)
        assert console_path.stat().st_size == 64 * 65536
        saved = (disk / "training.stdout.log").stat().st_size
        assert 0 < saved <= 1024 * 1024
        assert tee.bytes_not_saved == 64 * 65536 - saved  # every byte: saved or counted
        assert tee.log_error == "No space left on device"
    finally:
        subprocess.run(["umount", str(disk)], check=True)


def test_tee_creates_the_log_of_a_silent_pipe(tmp_path):
    """A node whose ranks print nothing on a stream still has its ``training.*.log`` (empty):
    the tee creates the log as it starts, not at the first chunk (issue 24, item 11)."""
    from traceml.launcher.torchrun import Tee

    read_end, write_end = os.pipe()
    log_path = tmp_path / "training.stdout.log"
    with open(read_end, "rb") as source, open(tmp_path / "console", "wb") as console:
        tee = Tee(source, console, log_path)
        os.close(write_end)  # the ranks exit without a byte on this stream
        tee.join(30)
    assert log_path.is_file() and log_path.stat().st_size == 0
    assert (tee.bytes_not_saved, tee.log_error) == (0, "")


def stored_meta_now(run_dir, scratch) -> dict:
    """The store's ``meta`` as a replacement would find it if the aggregator died now: the
    database and its WAL, copied while the aggregator holds them (its lock is exclusive)."""
    scratch.mkdir(exist_ok=True)
    for name in ("telemetry.sqlite", "telemetry.sqlite-wal"):
        if (run_dir / name).exists():
            shutil.copyfile(run_dir / name, scratch / name)
    return dict(query(scratch, "SELECT key, value FROM meta"))


@pytest.mark.aggregator
def test_a_killed_aggregators_replacement_has_its_ledger_and_refusals(tmp_path):
    """The stream ledger and the refusal counts reach the store while the aggregator runs
    (not only with the reports): after a SIGKILL the replacement's summary has them. A sender
    the checks refused never enters the ledger (issue 24, item 8)."""
    from traceml_aggregator.streams import STREAMS_META_KEY

    warnings: list[str] = []
    agg = LiveAggregator(
        tmp_path / "run", "kept", world_size=1, extra_args=("--finalize-timeout-sec", "60")
    )
    with agg:
        foreign = rpc(agg.target, "Push", wire.Batch(run_name="other", rank=0, seq=1), 30)
        assert foreign.rejected
        stranger = make_client(agg.target, "kept", warnings)
        stranger.rank = 5  # world size 1: refused on its stream
        stranger.submit(STEPS, step(0))
        assert not stranger.close()
        client = make_client(agg.target, "kept", warnings)
        for i in range(3):
            client.submit(STEPS, step(i))
        assert client.close(finish(3))
        expected_streams = [
            {
                "sender": "rank",
                "id": 0,
                "restart": 0,
                "finished": True,
                "streams": 1,
                "state": "closed",
            }
        ]
        expected_rejected = {"foreign_run": 1, "rank_out_of_range": 1}
        deadline = time.monotonic() + 30
        while True:
            meta = stored_meta_now(agg.run_dir, tmp_path / "copy")
            streams = [
                {k: v for k, v in e.items() if k != "since_unix_s"}
                for e in json.loads(meta.get(STREAMS_META_KEY, "[]"))
            ]
            rejected = json.loads(meta.get("rejected", "{}"))
            if (streams, rejected) == (expected_streams, expected_rejected):
                break
            assert time.monotonic() < deadline, (streams, rejected)
            time.sleep(0.1)
        agg.kill()
        agg.extra_args += ["--restart-reason", "killed by the test"]
        agg.start()
        reply = rpc(agg.target, "Finalize", wire.FinalizeRequest(run_name="kept", timeout_s=60), 90)
        assert reply.complete and not reply.error
        summary = json.loads(open(reply.summary_json_path).read())
        agg.stop()
    assert summary["run"]["rejected"] == expected_rejected
    streams = summary["run"]["telemetry_health"]["sender_streams"]
    assert [{k: v for k, v in e.items() if k != "since_unix_s"} for e in streams] == (
        expected_streams
    )
