"""The Slurm templates on a real Slurm cluster: 2 nodes x 2 (fake) GPUs, in both lab modes.

The lab (tests/slurm_lab) runs stock slurmctld/slurmd on this machine, one slurmd per node with
its own hostname; ``loopback`` puts the nodes on 127.77.0.x of the shared loopback, ``netns``
gives each its own network namespace. The fake GPUs make Slurm set ``SLURM_GPUS_ON_NODE=2``
while torch sees none, so examples/ddp_minimal.py trains with gloo on CPU, 2 workers per node.

The templates are submitted as shipped, adapted only through sbatch options (fewer GPUs and
CPUs than the template asks for), the environment (``PATH`` to this test's Python environment,
``MASTER_PORT``) and their arguments (``--logs-dir``, ``--aggregator-port``, the script's
``--steps``). Ports are free ones, never the defaults 29500/29765.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import GRPC_LINE, ROOT, free_port, load_summary, wait_for
from slurm_lab import SlurmLab, available

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

NODES, GPUS_PER_NODE, STEPS = 2, 2, 12
#: sbatch options that fit the template's job to the lab (2 CPUs per node, 2 fake GPUs).
FIT_TO_LAB = (
    f"--nodes={NODES}",
    "--ntasks-per-node=1",
    f"--gres=gpu:{GPUS_PER_NODE}",
    "--cpus-per-task=1",
)
#: Bound on a whole training job here (2 cores shared by 4 ranks, 2 launchers, the aggregator).
JOB_TIMEOUT_S = 300


@pytest.fixture(scope="module", params=["loopback", "netns"])
def lab(request):
    """The lab, started once per mode for this module and stopped after it."""
    ok, why = available(request.param)
    if not ok:
        pytest.skip(why)
    lab = SlurmLab().start(mode=request.param, nodes=NODES, gpus_per_node=GPUS_PER_NODE)
    yield lab
    lab.stop()


@pytest.fixture(autouse=True)
def no_job_left(lab):
    """Cancel whatever job a test leaves in the queue (one that timed out), so that the next
    test's job is not kept PENDING behind it and a first failure does not fail the rest."""
    yield
    for job in lab.run(["squeue", "-h", "-o", "%i"], check=False).stdout.split():
        lab.cancel(int(job))


def submit(
    lab: SlurmLab,
    tmp_path: Path,
    template: str,
    *args: str,
    sbatch_options: tuple[str, ...] = (),
    **env: str,
) -> int:
    """sbatch ``template`` from the repository root (as the docs say), with ``sbatch_options``
    beside the lab's; ``args`` after it; its job id.

    The job finds ``traceml`` on the ``PATH`` of this test's Python environment (the
    template's "activate your environment" step, done by the submitting shell).
    """
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    return lab.sbatch(
        ROOT / template,
        *FIT_TO_LAB,
        *sbatch_options,
        "-o",
        str(tmp_path / "job-%j.out"),
        env={"PATH": path, **env},
        cwd=ROOT,
        script_args=[f"--logs-dir={tmp_path / 'logs'}", f"--aggregator-port={free_port()}", *args],
    )


def loopback_only(lab: SlurmLab) -> None:
    """Skip in the netns lab: signals and requeues do not depend on the network."""
    if lab.lab_vars()["SLURM_LAB_MODE"] != "loopback":
        pytest.skip("signals and requeues do not depend on the network: the loopback lab runs it")


def wait_marked_step(run_dir: Path) -> None:
    """Wait until rank 0 of ``examples/ddp_minimal.py --mark-step 20`` began step 20."""
    log = run_dir / "nodes" / "node_0" / "training.stdout.log"
    wait_for(lambda: log.exists() and "at step 20" in log.read_text(), JOB_TIMEOUT_S, "step 20")


def job_output(tmp_path: Path, job: int) -> str:
    return (tmp_path / f"job-{job}.out").read_text(errors="replace")


def assert_trained_everywhere(run_dir: Path) -> None:
    """4 ranks on the lab's two nodes, every step of every rank in the summary."""
    summary = load_summary(run_dir)
    assert summary["run"]["world_size"] == NODES * GPUS_PER_NODE
    assert summary["run"]["complete"] is True and summary["run"]["missing_ranks"] == []
    assert summary["run"]["nodes"] == [0, 1]
    assert [
        (r["rank"], r["node_rank"], r["hostname"], r["steps_completed"], r["end"]["state"])
        for r in summary["ranks"]
    ] == [
        (0, 0, "node1", STEPS, "completed"),
        (1, 0, "node1", STEPS, "completed"),
        (2, 1, "node2", STEPS, "completed"),
        (3, 1, "node2", STEPS, "completed"),
    ]
    assert [(n["node_rank"], n["hostname"], n["exit_code"]) for n in summary["nodes"]] == [
        (0, "node1", 0),
        (1, "node2", 0),
    ]


def test_template_with_the_wrapper(lab, tmp_path):
    job = submit(
        lab,
        tmp_path,
        "examples/slurm/traceml_ddp.sbatch",
        "--steps",
        str(STEPS),
        MASTER_PORT=str(free_port()),
    )
    state, code = lab.wait(job, timeout=JOB_TIMEOUT_S)
    out = job_output(tmp_path, job)
    assert (state, code) == ("COMPLETED", 0), out
    assert_trained_everywhere(tmp_path / "logs" / f"ddp-{job}")
    # node 1's launcher holds its session stream when it starts torchrun: a fork() made then
    # made gRPC skip its fork handlers and abort the launcher in epoll_wait (EBADF)
    assert [line for line in out.splitlines() if GRPC_LINE.search(line)] == [], out
    assert f"traceml: summary: {tmp_path / 'logs' / f'ddp-{job}' / 'final_summary.json'}" in out


def test_slurm_flag_instead_of_explicit_flags(lab, tmp_path):
    job = submit(
        lab,
        tmp_path,
        "examples/slurm/traceml_ddp_auto.sbatch",
        f"--master-port={free_port()}",
        "--steps",
        str(STEPS),
    )
    state, code = lab.wait(job, timeout=JOB_TIMEOUT_S)
    out = job_output(tmp_path, job)
    assert (state, code) == ("COMPLETED", 0), out
    assert_trained_everywhere(tmp_path / "logs" / f"slurm-{job}")
    for node in (0, 1):
        assert (
            f"traceml: --slurm: --nnodes=2 (SLURM_STEP_NUM_NODES), --node-rank={node} "
            f"(SLURM_NODEID), --nproc-per-node=2 (SLURM_GPUS_ON_NODE), --master-addr=node1 "
            f"(first host of SLURM_STEP_NODELIST=node[1-2]), --run-name=slurm-{job} "
            "(SLURM_JOB_ID)"
        ) in out


def test_wrong_template_fails_fast_naming_the_cause(lab, tmp_path):
    """``srun traceml run ... --node-rank=$SLURM_NODEID`` inline: both nodes claim rank 0."""
    started = time.monotonic()
    job = submit(
        lab,
        tmp_path,
        "tests/scripts/wrong_inline.sbatch",
        "--steps",
        str(STEPS),
        MASTER_PORT=str(free_port()),
    )
    state, code = lab.wait(job, timeout=60)
    elapsed_s = time.monotonic() - started
    out = job_output(tmp_path, job)
    assert state == "FAILED" and code != 0, out
    assert elapsed_s < 60, out
    # Node 2 refuses at once, naming the cause; node 1 (node 0 of the run) stops because of it.
    assert (
        f"traceml: error: this is node 1 of Slurm step {job}.0 (SLURM_NODEID=1), but "
        "--node-rank is 0: $SLURM_NODEID was expanded once, by the batch shell, for every node"
    ) in out
    assert "the run stops there too" in out
    assert "traceml: error: the run cannot rendezvous: the launcher on node2" in out
    # node 0's summary says why nothing trained: its ranks were stopped before they started
    summary = load_summary(tmp_path / "logs" / f"ddp-{job}")
    assert summary["primary_diagnosis"]["kind"] == "NODE_FAILED", summary["primary_diagnosis"]


def test_master_address_of_another_node_fails_fast_on_both(lab, tmp_path):
    """``--master-addr=node2`` (given last, so it wins over the template's): node 0 is node1."""
    job = submit(
        lab,
        tmp_path,
        "examples/slurm/traceml_ddp.sbatch",
        "--master-addr=node2",
        MASTER_PORT=str(free_port()),
    )
    state, code = lab.wait(job, timeout=60)
    out = job_output(tmp_path, job)
    assert (state, code) == ("FAILED", 2), out
    assert (
        "traceml: error: --master-addr node2 is another host, but this host (node1) is node 0 "
        "of the Slurm step"
    ) in out
    assert (
        "traceml: error: --master-addr node2 is this host (node2), but this is node 1 of the "
        "Slurm step"
    ) in out


def test_scancel_stops_every_node_and_the_summary_says_interrupted(lab, tmp_path):
    """``scancel`` of a training job: Slurm sends SIGTERM to every process of the step (each
    launcher, torchrun, the ranks, node 0's aggregator), and SIGKILL after KillWait (30 s).
    Node 0 writes the summary of the steps before it, in time: the run ``interrupted``, every
    rank ``terminated`` by signal 15, and nothing of the job left running (docs/slurm.md)."""
    loopback_only(lab)
    job = submit(
        lab,
        tmp_path,
        "examples/slurm/traceml_ddp_auto.sbatch",
        f"--master-port={free_port()}",
        "--steps",
        "100000",
        "--mark-step",
        "20",
        "--step-ms",
        "50",
    )
    run_dir = tmp_path / "logs" / f"slurm-{job}"
    wait_marked_step(run_dir)
    lab.cancel(job)
    cancelled = time.monotonic()
    state, _ = lab.wait(job, timeout=120)
    out = job_output(tmp_path, job)
    assert state == "CANCELLED", out
    assert time.monotonic() - cancelled < 30, out  # before Slurm's SIGKILL (KillWait)
    summary = load_summary(run_dir)
    assert summary["run"]["status"] == "interrupted", out
    ends = {(r["end"]["state"], r["end"]["signal"]) for r in summary["ranks"]}
    assert ends == {("terminated", 15)}, summary["ranks"]
    assert all(r["end"]["reason"].startswith("interrupted: ") for r in summary["ranks"])
    health = {f["kind"]: f for f in summary["findings"]["health"]}
    assert "RANK_CRASHED" not in health and "NODE_FAILED" not in health, list(health)
    interrupted = health["RUN_INTERRUPTED"]
    assert interrupted["ranks"] == [0, 1, 2, 3]
    assert interrupted["action"] == "Nothing failed; resubmit or resume from the last checkpoint."
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert (manifest["status"], manifest["run_status"]) == ("interrupted", "interrupted")
    assert lab.run(["squeue", "-h"], check=False).stdout.strip() == ""
    left = [
        p.info["cmdline"]
        for p in psutil.process_iter(["cmdline"])
        if str(tmp_path) in " ".join(p.info["cmdline"] or [])
    ]
    assert left == [], left


@pytest.mark.parametrize(
    "template, name",
    [
        ("examples/slurm/traceml_ddp_auto.sbatch", "slurm"),
        ("examples/slurm/traceml_ddp.sbatch", "ddp"),
    ],
)
def test_a_requeued_job_trains_again_as_a_run_of_its_own(lab, tmp_path, template, name):
    """``scontrol requeue`` of a training job (preemption with requeue does the same): the job
    keeps its id and starts again with ``SLURM_RESTART_COUNT=1``. Its second attempt trains
    to its end as run ``<name>-<job>-restart-1``; the first attempt's summary says
    ``interrupted`` (before: node 0 refused the run directory the first attempt had filled,
    exit code 2, and nothing trained again)."""
    loopback_only(lab)
    job = submit(
        lab,
        tmp_path,
        template,
        "--steps",
        str(STEPS * 10),
        "--mark-step",
        "20",
        "--step-ms",
        "20",
        sbatch_options=("--requeue",),
        MASTER_PORT=str(free_port()),
    )
    first = tmp_path / "logs" / f"{name}-{job}"
    wait_marked_step(first)
    lab.run(["scontrol", "requeue", str(job)])
    requeued = {"JobState": "PENDING", "Restarts": "1"}
    wait_for(lambda: requeued.items() <= lab.job_info(job).items(), 60, "the requeue")
    # Slurm holds a requeued job for ~2 min (its BeginTime); the lab need not wait that long
    lab.run(["scontrol", "update", f"jobid={job}", "starttime=now"])
    state, code = lab.wait(job, timeout=JOB_TIMEOUT_S)
    out = job_output(tmp_path, job)
    assert (state, code) == ("COMPLETED", 0), out
    assert load_summary(first)["run"]["status"] == "interrupted"
    again = load_summary(tmp_path / "logs" / f"{name}-{job}-restart-1")
    assert again["run"]["status"] == "completed", out
    assert [r["steps_completed"] for r in again["ranks"]] == [STEPS * 10] * 4
