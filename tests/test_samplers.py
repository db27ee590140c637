"""Node and process samplers: finding torchrun's workers, NVML missing, and who hosts the node
sampler without the launcher.

Workers are real processes (a parent with torchrun's variables and a forked child that inherits
them, as a DataLoader worker does); NVML is made unloadable for real, by putting a file that is
not a library first on ``LD_LIBRARY_PATH`` under the name ``pynvml`` loads.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import psutil
import pytest
from conftest import SCRIPTS, load_summary, query, run_traceml
from helpers.jobs import run_args
from live_aggregator import LiveAggregator

from traceml.sdk.samplers import Workers

# A "worker": torchrun's variables in its environment, and a forked child that inherits them.
_WORKER = textwrap.dedent(
    """
    import os, sys, time
    if os.fork() == 0:
        time.sleep(60)
        os._exit(0)
    print("ready", flush=True)
    time.sleep(60)
    """
)


def _spawn(code: str, **env: str) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", code], env={**os.environ, **env}, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "ready"
    return proc


@pytest.fixture
def worker():
    proc = _spawn(_WORKER, RANK="5", TORCHELASTIC_RESTART_COUNT="2")
    yield proc
    for child in psutil.Process(proc.pid).children():
        child.kill()
    proc.kill()
    proc.wait()


def test_workers_are_torchrun_processes_not_their_children(worker):
    root = psutil.Process(worker.pid)
    workers = Workers(lambda known: [root, *root.children(recursive=True)])
    assert len(root.children()) == 1  # the forked child carries RANK too, and is left out
    found = workers.find()
    assert {pid: (rank, restart) for pid, (_, rank, restart) in found.items()} == {
        worker.pid: (5, 2)
    }
    first = workers.sample(unix_us=1)
    time.sleep(0.2)
    second = workers.sample(unix_us=2)
    assert [(s.rank, s.restart_count, s.unix_us) for s in first + second] == [(5, 2, 1), (5, 2, 2)]
    assert not first[0].HasField("cpu_percent")  # no previous reading to compare with
    assert second[0].HasField("cpu_percent") and second[0].rss_bytes > 0


def test_a_worker_that_exited_unreaped_has_no_sample():
    """A rank that has exited but that torchrun has not reaped yet (a zombie) reads RSS 0 and
    CPU 0 % through psutil: no sample, not a sample of zeros (the last /metrics and OTLP push of
    a run showed a rank's RSS as 0)."""
    proc = _spawn(
        'print("ready", flush=True); import time; time.sleep(60)',
        RANK="3",
        TORCHELASTIC_RESTART_COUNT="0",
    )
    root = psutil.Process(proc.pid)
    workers = Workers(lambda known: [root])
    try:
        assert [(s.rank, s.rss_bytes > 0) for s in workers.sample(unix_us=1)] == [(3, True)]
        proc.kill()  # not waited for: a zombie until proc.wait()
        deadline = time.monotonic() + 30
        while root.status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert workers.sample(unix_us=2) == []
    finally:
        proc.kill()
        proc.wait()


def test_a_worker_is_recognised_once_it_has_exec_d():
    # torchrun forks, then exec()s the worker with RANK set: in between, the new process
    # still shows torchrun's environment. It must be looked at again later, not written off.
    code = textwrap.dedent(
        """
        import os, sys, time
        print("ready", flush=True)
        time.sleep(0.5)
        env = dict(os.environ, RANK="3", TORCHELASTIC_RESTART_COUNT="0")
        os.execve(sys.executable, [sys.executable, "-c", "import time; time.sleep(60)"], env)
        """
    )
    proc = _spawn(code)
    try:
        workers = Workers(lambda known: [psutil.Process(proc.pid)])
        assert workers.find() == {}
        time.sleep(1.5)
        assert [(rank, restart) for _, rank, restart in workers.find().values()] == [(3, 0)]
    finally:
        proc.kill()
        proc.wait()


def test_an_sdk_rank_without_torchrun_samples_itself():
    workers = Workers(lambda known: [], extra=(os.getpid(), 7, 1))
    [sample] = workers.sample(unix_us=5)
    assert (sample.rank, sample.restart_count) == (7, 1)
    assert sample.rss_bytes > 0


@pytest.mark.torchrun
@pytest.mark.slow
def test_nvml_unloadable_run_exits_0_with_gpu_fields_null_and_a_reason(tmp_path, port):
    libdir = tmp_path / "broken-nvml"
    libdir.mkdir()
    (libdir / "libnvidia-ml.so.1").write_bytes(b"not a shared library\n" * 64)
    result = run_traceml(
        run_args(tmp_path, SCRIPTS / "planted_phases.py", "nonvml", port, "--", "--steps", "3"),
        cwd=tmp_path,
        env={
            "LD_LIBRARY_PATH": f"{libdir}:{os.environ.get('LD_LIBRARY_PATH', '')}",
            "TRACEML_SAMPLE_INTERVAL_SEC": "0.2",
        },
    )
    assert result.returncode == 0, result.stderr
    run_dir = tmp_path / "logs" / "nonvml"
    assert query(run_dir, "SELECT COUNT(*) FROM steps") == [(6,)]  # training untouched
    reasons = query(run_dir, "SELECT DISTINCT gpu_unavailable_reason FROM system_samples")
    assert len(reasons) == 1 and reasons[0][0].startswith("NVML did not start"), reasons
    assert query(run_dir, "SELECT COUNT(*) FROM gpu_samples") == [(0,)]
    # One info line where GPU figures are missing on a GPU host; none on a CPU host.
    info = [line for line in result.stderr.splitlines() if "GPU metrics are off" in line]
    expected = ["traceml: GPU metrics are off on node 0: " + reasons[0][0]]
    assert info == (expected if os.path.exists("/proc/driver/nvidia") else [])


@pytest.mark.torchrun
@pytest.mark.aggregator
@pytest.mark.slow
def test_without_the_launcher_local_rank_0_hosts_the_node_sampler(tmp_path):
    """Plain torchrun and a standalone aggregator: rank 0's SDK samples the node and both
    workers (its siblings under torchrun); rank 1 samples nothing of the node."""
    aggregator = LiveAggregator(tmp_path / "run", "plain", world_size=2).start()
    env = dict(
        os.environ,
        TRACEML_AGGREGATOR=aggregator.target,
        TRACEML_RUN_NAME="plain",
        TRACEML_SAMPLE_INTERVAL_SEC="0.2",
    )
    env.pop("TRACEML_LAUNCHED", None)
    try:
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nproc-per-node=2",
                str(SCRIPTS / "planted_phases.py"),
                "--steps",
                "20",
            ],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=240,
        )
    finally:
        aggregator.stop()
    assert result.returncode == 0, result.stderr
    assert aggregator.query(
        "SELECT sender, sender_id, restart FROM streams WHERE sender = 'node_rank'"
    ) == [("node_rank", 0, 0)]
    assert aggregator.query("SELECT COUNT(*) > 0 FROM system_samples") == [(1,)]
    ranks = aggregator.query("SELECT DISTINCT rank FROM process_samples ORDER BY rank")
    assert ranks == [(0,), (1,)]
    # No launcher asked for the reports: the aggregator wrote them as it was stopped.
    summary = load_summary(tmp_path / "run")
    assert [(r["rank"], r["steps_completed"]) for r in summary["ranks"]] == [(0, 20), (1, 20)]
    assert summary["run"]["complete"] is True


def test_children_from_the_kernel_lists_match_psutils_scan(worker):
    """The node sampler's child lookup (per-thread /proc children lists) finds the same tree as
    psutil's scan of every process on the host."""
    from traceml.sdk.samplers import _children

    me = psutil.Process()
    psutil_tree = {p.pid for p in me.children(recursive=True)}
    assert {worker.pid, psutil.Process(worker.pid).children()[0].pid} <= psutil_tree
    assert {p.pid for p in _children(me, recursive=True)} == psutil_tree
    assert {p.pid for p in _children(psutil.Process(worker.pid))} == {
        p.pid for p in psutil.Process(worker.pid).children()
    }


def test_the_children_of_a_pruned_process_are_not_read(worker):
    """A known worker's subtree (its DataLoader workers) is left out of the walk: the worker
    is listed, its forked child is not."""
    from traceml.sdk.samplers import _children

    me = psutil.Process()
    child = psutil.Process(worker.pid).children()[0].pid
    assert {child, worker.pid} <= {p.pid for p in _children(me, recursive=True)}
    pruned = {p.pid for p in _children(me, recursive=True, prune={worker.pid})}
    assert worker.pid in pruned and child not in pruned


def test_known_workers_are_pruned_from_the_next_walk(worker):
    """Workers passes the processes it already knows carry torchrun's variables to its
    candidates: none on the first look, the worker and its child from then on; the worker
    alone is found both times."""
    root = psutil.Process(worker.pid)
    child = root.children()[0].pid
    asked = []

    def candidates(known):
        asked.append(set(known))
        return [root, *root.children(recursive=True)]

    workers = Workers(candidates)
    assert list(workers.find()) == list(workers.find()) == [worker.pid]
    assert asked == [set(), {worker.pid, child}]


def test_an_exited_process_has_no_children():
    """torchrun has exited by the node sampler's last sample: its workers are none, no error."""
    from traceml.sdk.samplers import _children

    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    gone = psutil.Process(proc.pid)
    proc.wait()
    assert _children(gone, recursive=True) == []
