"""How each local rank ended, as the launcher reports it from torchrun's failure record.

A rank that ended on its own (a signal from a user, a scheduler or itself; a non-zero exit) is
``signaled`` or ``failed``; a rank torchrun stopped after that is ``terminated``, whatever
signal it died of. The real torchrun (``traceml.launcher.torchrun_main``) runs a plain script
whose one local rank ends on its own while the other sleeps until torchrun stops it; no
TraceML in the ranks, no aggregator.
"""

from __future__ import annotations

import json
import re
import signal

import psutil
import pytest
from helpers.aggregator import free_port, listening_port
from helpers.jobs import listens
from helpers.waiting import wait_for

from traceml import wire
from traceml.core.rundir import RunDir
from traceml.launcher.config import LaunchConfig
from traceml.launcher.torchrun import TorchrunProcess

pytestmark = [pytest.mark.torchrun]

#: The ranks' script: ``OWN_RANK HOW``. Local rank OWN_RANK ends on its own once the other
#: rank has started (HOW: "sigterm" sends itself SIGTERM, "exit3" exits 3); the other sleeps
#: until torchrun stops it.
SCRIPT = """\
import os, signal, sys, time
own, how, ready = int(sys.argv[1]), sys.argv[2], sys.argv[3]
rank = int(os.environ["LOCAL_RANK"])
if rank != own:
    open(ready, "w").close()
    time.sleep(120)
    sys.exit(0)
while not os.path.exists(ready):
    time.sleep(0.01)
if how == "sigterm":
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(120)
sys.exit(3)
"""

TERMINATED = wire.EndState.END_STATE_TERMINATED
SIGNALED = wire.EndState.END_STATE_SIGNALED
FAILED = wire.EndState.END_STATE_FAILED
NOT_STARTED = wire.EndState.END_STATE_NOT_STARTED
STOPPED_REASON = "stopped by torchrun after another local rank failed"


def ends(report: wire.NodeExit) -> dict[int, tuple]:
    """Rank -> (end state, exit code or None, signal or None, reason)."""
    return {
        e.rank: (
            e.end_state,
            e.exit_code if e.HasField("exit_code") else None,
            e.signal if e.HasField("signal") else None,
            e.reason,
        )
        for e in report.ranks
    }


def torchrun_of(tmp_path, script: str = "never_run.py", **config) -> TorchrunProcess:
    """Node 0's torchrun of run "ends" (two local ranks of ``script``; ``config``: more
    :class:`LaunchConfig` fields), its node directory made, not started."""
    config = {"nproc_per_node": 2, "run_name": "ends", **config}
    torchrun = TorchrunProcess(LaunchConfig(script=script, **config), RunDir(tmp_path / "run", 0))
    torchrun.run_dir.node_dir.mkdir(parents=True)
    return torchrun


def run_torchrun(tmp_path, own: int, how: str) -> tuple[int, wire.NodeExit, list]:
    """Two local ranks under the real torchrun; (its return code, the node's exit report,
    the failure record's entries)."""
    script = tmp_path / "ends.py"
    script.write_text(SCRIPT)
    torchrun = torchrun_of(
        tmp_path,
        str(script),
        script_args=[str(own), how, str(tmp_path / "ready")],
        auto_instrument=False,
    )
    torchrun.start()
    code = torchrun.wait(120)
    assert code is not None
    record = json.loads(torchrun.run_dir.rank_ends.read_text())["failed"]
    return code, torchrun.node_exit(code), record


def test_a_rank_that_sigterms_itself_is_signaled_and_its_neighbour_terminated(tmp_path):
    code, report, record = run_torchrun(tmp_path, own=1, how="sigterm")
    assert code == 1
    assert [(r["local_rank"], r["signal"], r["stopped"]) for r in record] == [
        (0, signal.SIGTERM, True),
        (1, signal.SIGTERM, False),
    ]
    assert re.fullmatch(r"Signal 15 \(SIGTERM\) received by PID \d+", record[1]["reason"])
    assert ends(report) == {
        0: (TERMINATED, None, signal.SIGTERM, STOPPED_REASON),
        1: (SIGNALED, None, signal.SIGTERM, record[1]["reason"]),
    }


def test_a_rank_that_exits_3_failed_and_its_neighbour_was_terminated(tmp_path):
    code, report, record = run_torchrun(tmp_path, own=0, how="exit3")
    assert code == 1
    assert [(r["local_rank"], r["exit_code"], r["signal"], r["stopped"]) for r in record] == [
        (0, 3, None, False),
        (1, None, signal.SIGTERM, True),
    ]
    assert ends(report) == {
        0: (FAILED, 3, None, ""),
        1: (TERMINATED, None, signal.SIGTERM, STOPPED_REASON),
    }


def test_ranks_that_both_ended_before_the_stop_keep_their_own_ends(tmp_path):
    """The race CI met: rank 1 got SIGTERM, rank 0's collective then failed, and torchrun's
    poll saw both ended at once: rank 1 died of its SIGTERM, not of torchrun's stop."""
    torchrun = torchrun_of(tmp_path)
    own = {"exit_code": None, "reason": "", "stopped": False}
    failed = [
        {**own, "local_rank": 0, "exit_code": 1},
        {**own, "local_rank": 1, "signal": signal.SIGTERM},
    ]
    torchrun.run_dir.rank_ends.write_text(json.dumps({"failed": failed}))
    assert ends(torchrun.node_exit(1)) == {
        0: (FAILED, 1, None, ""),
        1: (SIGNALED, None, signal.SIGTERM, ""),
    }


def test_a_rank_that_failed_before_a_stop_signal_cut_torchrun_short_keeps_its_failure(tmp_path):
    """Rank 1 exited 3; as torchrun stopped rank 0, the launcher's SIGINT cut it short
    (torch's SignalException), so it never reported its ranks' ends: its record lists the
    failure it had seen, ``partial``. Rank 1 failed; rank 0, not listed, did not complete:
    the signal ended it (before: no record, and both ranks ``terminated`` by the signal)."""
    torchrun = torchrun_of(tmp_path)
    failed = [{"local_rank": 1, "exit_code": 3, "signal": None, "reason": "", "stopped": False}]
    record = {"failed": failed, "partial": True, "ranks_started": True}
    torchrun.run_dir.rank_ends.write_text(json.dumps(record))
    reason = "interrupted: the launcher got SIGINT (scancel, preemption or Ctrl-C)"
    assert ends(torchrun.node_exit(1, interrupted=signal.SIGINT)) == {
        0: (TERMINATED, None, signal.SIGINT, reason),
        1: (FAILED, 3, None, ""),
    }


def test_a_torchrun_whose_rendezvous_port_is_taken_never_starts_its_ranks(tmp_path):
    """torchrun fails in its rendezvous (its store cannot listen: the port is held) before it
    starts a rank: the record says so, with torchrun's error, and both ranks are
    ``not_started`` with that error as their reason (not ``terminated``: nothing stopped
    them)."""
    with listening_port() as port:
        torchrun = torchrun_of(tmp_path, master_port=port)
        torchrun.start()
        code = torchrun.wait(120)
    assert code == 1
    record = json.loads(torchrun.run_dir.rank_ends.read_text())
    assert record["failed"] == [] and record["ranks_started"] is False
    error = record["torchrun_error"]
    assert error.startswith("DistNetworkError: ") and "EADDRINUSE" in error, error
    reason = f"torchrun failed: {error}"
    assert ends(torchrun.node_exit(code)) == {
        0: (NOT_STARTED, None, None, reason),
        1: (NOT_STARTED, None, None, reason),
    }


def test_ranks_of_a_torchrun_that_failed_after_starting_them_are_terminated_with_its_error(
    tmp_path,
):
    """A torchrun that had started ranks, then failed itself (a later rendezvous, after a
    restart): its ranks are ``terminated`` with its error, not ``completed`` (the record
    lists no failed rank)."""
    torchrun = torchrun_of(tmp_path)
    record = {"failed": [], "torchrun_error": "RendezvousTimeoutError: ", "ranks_started": True}
    torchrun.run_dir.rank_ends.write_text(json.dumps(record))
    reason = "torchrun failed: RendezvousTimeoutError: "
    assert ends(torchrun.node_exit(1)) == {
        0: (TERMINATED, None, None, reason),
        1: (TERMINATED, None, None, reason),
    }


def test_a_torchrun_stopped_while_it_waits_for_a_node_that_never_joins_never_started_its_ranks(
    tmp_path,
):
    """Node 0 of two, alone: torchrun waits in its rendezvous for node 1, which never comes.
    The launcher's SIGTERM cannot reach it there, so it is killed after the grace
    (``end_stuck_stop``). It recorded nothing (it never started a rank), and its ranks are
    ``not_started``, interrupted, not ``terminated`` as ranks that ran."""
    port = free_port()
    torchrun = torchrun_of(tmp_path, nnodes=2, node_rank=0, master_port=port)
    torchrun.start()
    assert torchrun.process is not None
    pid = torchrun.process.pid
    wait_for(
        lambda: listens(psutil.Process(pid), port),
        60,
        "torchrun's store listening (its rendezvous)",
    )
    torchrun.forward_signal(signal.SIGTERM)
    wait_for(torchrun.end_stuck_stop, 60, "torchrun killed, stuck", poll_s=0.5)
    code = torchrun.wait(10)
    assert code == -signal.SIGKILL
    # torchrun_main's record of its import of torch only: it never started a rank
    assert json.loads(torchrun.run_dir.rank_ends.read_text()) == {"ranks_started": False}
    reason = (
        "interrupted: the launcher got SIGTERM (scancel, preemption or Ctrl-C) before torchrun "
        "started its ranks"
    )
    assert ends(torchrun.node_exit(code, signal.SIGTERM)) == {
        0: (NOT_STARTED, None, signal.SIGTERM, reason),
        1: (NOT_STARTED, None, signal.SIGTERM, reason),
    }


def test_a_torchrun_waiting_in_its_rendezvous_is_said_then_its_start_after_the_late_node(
    tmp_path, capsys
):
    """Node 0 of two starts no rank: past ``TRACEML_RENDEZVOUS_WARN_SEC`` its launcher says
    where torchrun waits, each once: still starting while it imports torch (torchrun_main has
    recorded nothing yet), then in its rendezvous, with where and what for (plain torchrun says
    nothing until its timeout, minutes later). Node 1 then joins: the ranks start, and that is
    said, with how long it took. Only the launcher's own lines are read: torch's (its exit
    barrier's warnings as the two nodes end) land on the same stream."""
    script = tmp_path / "ends.py"
    script.write_text("pass\n")
    port = free_port()
    both = {"nnodes": 2, "master_port": port, "rendezvous_warn_sec": 0.01}
    node0 = torchrun_of(tmp_path / "n0", str(script), node_rank=0, **both)
    node0.start()
    said: list[str] = []

    def say() -> str:
        node0.say_rendezvous_wait()
        err = capsys.readouterr().err
        said.extend(line + "\n" for line in err.splitlines() if line.startswith("traceml: "))
        return "".join(said)

    wait_for(lambda: "warning" in say(), 60, "node 0 to say it starts no rank")
    assert re.fullmatch(
        r"traceml: warning: torchrun has started no rank in \d+ s: it is still starting "
        r"\(importing torch, slow on a busy or network file system\)\n",
        say(),
    ), said
    wait_for(lambda: "rendezvous at" in say(), 60, "node 0 to say it waits in its rendezvous")
    assert re.fullmatch(
        r"traceml: warning: torchrun has started no rank in \d+ s: it waits in its rendezvous "
        rf"at 127\.0\.0\.1:{port} for all 2 nodes \(--nnodes\) to join; check that every node "
        r"runs `traceml run` with the same --master-addr, --master-port and --nnodes, and can "
        r"reach that address\n",
        said[1],
    ), said
    node1 = torchrun_of(tmp_path / "n1", str(script), node_rank=1, **both)
    node1.start()
    wait_for(lambda: "started its ranks" in say(), 60, "node 0's ranks to start")
    assert re.fullmatch(
        r"traceml: torchrun started its ranks after \d+ s in its rendezvous\n", said[2]
    )
    assert (node0.wait(60), node1.wait(60)) == (0, 0)
    assert len(say().splitlines()) == 3, said  # each said once
