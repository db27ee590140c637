"""`traceml run --slurm`: the flags a Slurm job step implies, and the Slurm mistakes refused.

Unit tests on the environment as Slurm sets it (the values seen in real jobs are in
tests/slurm_lab/README.md), plus the command line end to end where it stops before training.
tests/test_slurm_lab.py runs the same on a real Slurm cluster.
"""

from __future__ import annotations

import socket

import psutil
import pytest
from conftest import EXAMPLES, free_port, run_traceml

from traceml.launcher import claim, slurm
from traceml.launcher.config import LaunchConfig, LaunchError

#: Node 1 of a 2-node srun step of job 77, one task per node (as in the lab's jobs).
STEP_ENV = {
    "SLURM_JOB_ID": "77",
    "SLURM_STEP_ID": "0",
    "SLURM_NODEID": "1",
    "SLURM_LOCALID": "0",
    "SLURM_NNODES": "2",
    "SLURM_STEP_NUM_NODES": "2",
    "SLURM_JOB_NODELIST": "gpu[07-08]",
    "SLURM_STEP_NODELIST": "gpu[07-08]",
    "SLURM_GPUS_ON_NODE": "8",
    "SLURM_NTASKS_PER_NODE": "1",
}


def step_of(env: dict, **changes: str | None) -> slurm.SlurmStep:
    """The SlurmStep of ``env`` with ``changes`` applied (None removes a variable)."""
    env = dict(env)
    for name, value in changes.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    step = slurm.SlurmStep.from_env(env)
    assert step is not None
    return step


def derived(
    step: slurm.SlurmStep, explicit: set[str] = frozenset(), **flags
) -> tuple[LaunchConfig, str]:
    config = LaunchConfig(script="train.py", **flags)
    line = slurm.apply(config, set(explicit), step)
    return config, line


# --- workers per node ---------------------------------------------------------------------
def test_gpus_per_node_with_a_type_gives_four_workers_on_every_node():
    for node_id in ("0", "1"):
        step = step_of(
            STEP_ENV, SLURM_GPUS_ON_NODE=None, SLURM_GPUS_PER_NODE="a100:4", SLURM_NODEID=node_id
        )
        config, line = derived(step)
        assert (config.node_rank, config.nproc_per_node) == (int(node_id), 4)
        assert "--nproc-per-node=4 (SLURM_GPUS_PER_NODE)" in line


@pytest.mark.parametrize(
    "value, node_rank, count",
    [
        ("4", 0, 4),
        ("4", 5, 4),
        ("a100:4", 1, 4),
        ("gpu:a100:4", 1, 4),
        ("a100:2,v100:1", 0, 3),  # two GPU types on every node add up
        ("4,2", 0, 4),  # per-node list: node 0 has 4, node 1 has 2
        ("4,2", 1, 2),
        ("2(x3)", 2, 2),
        ("2(x3),1", 3, 1),
    ],
)
def test_gpus_per_node_values(value, node_rank, count):
    assert slurm.gpus_per_node(value, node_rank) == count


@pytest.mark.parametrize(
    "value, node_rank, why",
    [
        ("a100:x", 0, "is not a GPU count"),
        ("a100:2,3", 0, "is not a GPU count"),  # typed and untyped items mixed
        ("four", 0, "is not a GPU count"),
        ("4,2", 2, "lists 2 nodes, not node 2"),
        ("0", 0, "gives node 0 no GPU"),
        ("a100:0", 0, "gives node 0 no GPU"),
    ],
)
def test_bad_gpus_per_node_values_are_clear_errors(value, node_rank, why):
    with pytest.raises(LaunchError) as info:
        slurm.gpus_per_node(value, node_rank)
    message = str(info.value)
    assert why in message
    assert f"SLURM_GPUS_PER_NODE={value!r}" in message and "--nproc-per-node" in message


def test_worker_count_sources_in_order():
    assert step_of(STEP_ENV, SLURM_GPUS_PER_NODE="a100:4").workers_per_node(1) == (
        8,
        "SLURM_GPUS_ON_NODE",
    )
    # CPU-only nodes: no GPU count (or 0), the tasks per node decide.
    for gpus in (None, "0"):
        step = step_of(STEP_ENV, SLURM_GPUS_ON_NODE=gpus, SLURM_NTASKS_PER_NODE="3")
        assert step.workers_per_node(1) == (3, "SLURM_NTASKS_PER_NODE")
    none = step_of(STEP_ENV, SLURM_GPUS_ON_NODE=None, SLURM_NTASKS_PER_NODE=None)
    with pytest.raises(
        LaunchError,
        match="none of SLURM_GPUS_ON_NODE, SLURM_GPUS_PER_NODE, "
        "SLURM_NTASKS_PER_NODE is set; pass --nproc-per-node",
    ):
        none.workers_per_node(0)
    with pytest.raises(LaunchError, match=r"SLURM_GPUS_ON_NODE='x2' is not a whole number >= 1"):
        step_of(STEP_ENV, SLURM_GPUS_ON_NODE="x2").workers_per_node(0)


# --- every derived flag -------------------------------------------------------------------
def test_every_flag_is_derived_and_named_once():
    config, line = derived(step_of(STEP_ENV))
    assert (config.nnodes, config.node_rank, config.nproc_per_node) == (2, 1, 8)
    assert (config.master_addr, config.run_name) == ("gpu07", "slurm-77")
    assert line == (
        "--slurm: --nnodes=2 (SLURM_STEP_NUM_NODES), --node-rank=1 (SLURM_NODEID), "
        "--nproc-per-node=8 (SLURM_GPUS_ON_NODE), "
        "--master-addr=gpu07 (first host of SLURM_STEP_NODELIST=gpu[07-08]), "
        "--run-name=slurm-77 (SLURM_JOB_ID)"
    )


def test_explicit_flags_win():
    explicit = {"nproc_per_node", "run_name", "master_addr"}
    config, line = derived(
        step_of(STEP_ENV), explicit, nproc_per_node=3, run_name="mine", master_addr="gpu07-ib"
    )
    assert (config.nproc_per_node, config.run_name, config.master_addr) == (3, "mine", "gpu07-ib")
    assert (config.nnodes, config.node_rank) == (2, 1)
    assert "nproc-per-node" not in line and "run-name" not in line and "master-addr" not in line
    every = {"nnodes", "node_rank", "nproc_per_node", "master_addr", "run_name"}
    _, line = derived(step_of(STEP_ENV), every)
    assert line == "--slurm: every value it derives was given explicitly"


def test_the_step_counts_not_the_job():
    # srun -N2 on the last two nodes of a 3-node job: Slurm numbers nodes within the step.
    step = step_of(
        STEP_ENV,
        SLURM_JOB_NODELIST="gpu[01-03]",
        SLURM_STEP_NODELIST="gpu[02-03]",
        SLURM_NNODES="2",
        SLURM_STEP_NUM_NODES="2",
        SLURM_NODEID="0",
    )
    config, _ = derived(step)
    assert (config.nnodes, config.node_rank, config.master_addr) == (2, 0, "gpu02")
    # The batch script has no step variables: the job's are used.
    batch = step_of(
        STEP_ENV,
        SLURM_STEP_ID=None,
        SLURM_STEP_NUM_NODES=None,
        SLURM_STEP_NODELIST=None,
        SLURM_NNODES="1",
        SLURM_JOB_NODELIST="gpu07",
        SLURM_NODEID="0",
    )
    config, line = derived(batch)
    assert (config.nnodes, config.node_rank, config.master_addr) == (1, 0, "127.0.0.1")
    assert "(SLURM_NNODES)" in line and "master-addr" not in line


@pytest.mark.parametrize(
    "env, message",
    [
        (None, "--slurm: not inside a Slurm job (SLURM_JOB_ID is not set)"),
        (
            {"SLURM_STEP_ID": None, "SLURM_STEP_NUM_NODES": None},
            "--slurm outside srun: this is the batch script (or an salloc shell) of a 2-node job",
        ),
        (
            {"SLURM_NODEID": "one"},
            "--slurm: SLURM_NODEID='one' is not a whole number >= 0; pass --node-rank",
        ),
        (
            {"SLURM_STEP_NUM_NODES": "0"},
            "--slurm: SLURM_STEP_NUM_NODES='0' is not a whole number >= 1; pass --nnodes",
        ),
        (
            {"SLURM_STEP_NODELIST": "gpu[07-"},
            "--slurm: SLURM_STEP_NODELIST='gpu[07-' is not a Slurm host list",
        ),
    ],
)
def test_unusable_environments_are_clear_errors(env, message):
    step = None if env is None else step_of(STEP_ENV, **env)
    with pytest.raises(LaunchError) as info:
        derived(step)
    assert str(info.value).startswith(message)


# --- the classic mistakes -----------------------------------------------------------------
def set_env(monkeypatch, env: dict) -> None:
    for name in list(STEP_ENV):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)


def test_node_rank_zero_on_slurm_node_one_names_the_batch_shell_expansion(monkeypatch):
    set_env(monkeypatch, STEP_ENV)
    config = LaunchConfig(script="t.py", nnodes=2, node_rank=0, master_addr="127.0.0.1")
    with pytest.raises(claim.ClaimError) as info:
        claim.check(config)
    message = str(info.value)
    assert "this is node 1 of Slurm step 77.0 (SLURM_NODEID=1), but --node-rank is 0" in message
    assert "$SLURM_NODEID was expanded once, by the batch shell" in message
    assert "examples/slurm/launch.sh" in message and "--slurm" in message
    config = LaunchConfig(script="t.py", nnodes=2, node_rank=1, master_addr="gpu07")
    set_env(monkeypatch, {**STEP_ENV, "SLURM_NODEID": "0"})
    with pytest.raises(
        claim.ClaimError, match="every node's --node-rank must be its own SLURM_NODEID"
    ):
        claim.check(config)


def test_slurm_layout_mistakes(monkeypatch):
    set_env(monkeypatch, {**STEP_ENV, "SLURM_LOCALID": "1"})
    config = LaunchConfig(script="t.py", nnodes=2, node_rank=1, master_addr="gpu07")
    with pytest.raises(LaunchError, match=r"more than one task on this node \(SLURM_LOCALID=1\)"):
        claim.check(config)
    set_env(monkeypatch, STEP_ENV)
    config = LaunchConfig(script="t.py", nnodes=3, node_rank=1, master_addr="gpu07")
    with pytest.raises(LaunchError) as info:
        claim.check(config)
    assert not isinstance(info.value, claim.ClaimError)
    assert "--nnodes 3 is more nodes than this Slurm step has (SLURM_STEP_NUM_NODES=2)" in str(
        info.value
    )


def test_master_address_must_be_node_zero(monkeypatch):
    other = "127.77.0.11"  # another "node"'s loopback address, as in the Slurm lab
    set_env(monkeypatch, {**STEP_ENV, "SLURM_NODEID": "0"})
    node0 = LaunchConfig(script="t.py", nnodes=2, node_rank=0, master_addr=other)
    with pytest.raises(LaunchError) as info:
        claim.check(node0)
    # Slurm vouches for node 0 here: the address is wrong, not the claim.
    assert not isinstance(info.value, claim.ClaimError)
    assert f"--master-addr {other} is another host, but this host" in str(info.value)
    set_env(monkeypatch, STEP_ENV)
    node1 = LaunchConfig(script="t.py", nnodes=2, node_rank=1, master_addr=socket.gethostname())
    with pytest.raises(LaunchError, match="is this host .*, but this is node 1 of the Slurm step"):
        claim.check(node1)
    # Outside Slurm only node 0 can tell: a second "node 0" on another host.
    set_env(monkeypatch, {})
    with pytest.raises(
        claim.ClaimError, match=f"--node-rank is 0, but --master-addr {other} is another host"
    ):
        claim.check(node0)
    claim.check(LaunchConfig(script="t.py", nnodes=2, node_rank=1, master_addr="127.0.0.1"))


def test_single_node_runs_and_the_batch_script_are_never_refused(monkeypatch):
    set_env(monkeypatch, {**STEP_ENV, "SLURM_LOCALID": "3"})
    claim.check(LaunchConfig(script="t.py"))  # one node, on node 1
    set_env(monkeypatch, {k: v for k, v in STEP_ENV.items() if k != "SLURM_STEP_ID"})
    claim.check(LaunchConfig(script="t.py", nnodes=2, node_rank=0))  # the batch script


def test_hint_for_a_single_node_run_on_every_node():
    config = LaunchConfig(script="t.py")
    assert "add --slurm" in slurm.hint(config, step_of(STEP_ENV))
    assert slurm.hint(config, step_of(STEP_ENV, SLURM_STEP_NUM_NODES="1")) == ""
    assert slurm.hint(config, None) == ""
    assert slurm.hint(LaunchConfig(script="t.py", nnodes=2), step_of(STEP_ENV)) == ""


def test_is_this_host():
    assert claim.is_this_host(socket.gethostname())
    assert claim.is_this_host("localhost") and claim.is_this_host("127.0.0.1")
    assert not claim.is_this_host("127.77.0.11")
    public = [
        a.address
        for addrs in psutil.net_if_addrs().values()
        for a in addrs
        if a.family == socket.AF_INET and not a.address.startswith("127.")
    ]
    if public:
        assert claim.is_this_host(public[0])
    with pytest.raises(LaunchError, match="does not resolve"):
        claim.is_this_host("bad..name")


# --- the command line ---------------------------------------------------------------------
@pytest.mark.torchrun
def test_cli_prints_the_derived_flags_and_keeps_the_given_ones(tmp_path):
    env = {**STEP_ENV, "SLURM_GPUS_ON_NODE": "", "SLURM_GPUS_PER_NODE": "a100:4"}
    proc = run_traceml(
        ["run", "missing.py", "--slurm", "--run-name=mine", "--master-port=1234"],
        tmp_path,
        env=env,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.splitlines()
    assert lines[0] == (
        "traceml: --slurm: --nnodes=2 (SLURM_STEP_NUM_NODES), --node-rank=1 (SLURM_NODEID), "
        "--nproc-per-node=4 (SLURM_GPUS_PER_NODE), "
        "--master-addr=gpu07 (first host of SLURM_STEP_NODELIST=gpu[07-08])"
    )
    assert lines[1] == "traceml: error: training script 'missing.py' not found"


@pytest.mark.torchrun
def test_cli_refuses_a_wrong_claim_and_says_node0_could_not_be_told(tmp_path):
    port = free_port()
    proc = run_traceml(
        [
            "run",
            str(EXAMPLES / "ddp_minimal.py"),
            "--nnodes=2",
            "--node-rank=0",
            "--run-name=r",
            f"--aggregator-port={port}",
            f"--logs-dir={tmp_path}",
        ],
        tmp_path,
        env={**STEP_ENV, "TRACEML_AGGREGATOR_START_SEC": "1"},
        timeout=60,
    )
    assert proc.returncode == 2
    assert (
        "traceml: error: this is node 1 of Slurm step 77.0 (SLURM_NODEID=1), but "
        "--node-rank is 0" in proc.stderr
    )
    assert (
        f"traceml: node 0 was not told (no TraceML aggregator serving at 127.0.0.1:{port} "
        "after 1 s)" in proc.stderr
    )
    assert not (tmp_path / "r").exists()


def test_a_requeued_job_gets_a_run_of_its_own():
    """A job Slurm requeued (preemption, ``scontrol requeue``) keeps its id: its next attempt
    is named after its restart count, not refused because the first attempt's run directory
    holds telemetry (tests/test_slurm_lab.py requeues a real job)."""
    config, line = derived(step_of(STEP_ENV, SLURM_RESTART_COUNT="2"))
    assert config.run_name == "slurm-77-restart-2"
    assert "--run-name=slurm-77-restart-2 (SLURM_JOB_ID, SLURM_RESTART_COUNT)" in line
    config, line = derived(step_of(STEP_ENV, SLURM_RESTART_COUNT="0"))
    assert (config.run_name, "--run-name=slurm-77 (SLURM_JOB_ID)" in line) == ("slurm-77", True)
    with pytest.raises(
        LaunchError,
        match=r"^--slurm: SLURM_RESTART_COUNT='x' is not a whole number >= 0; pass --run-name$",
    ):
        derived(step_of(STEP_ENV, SLURM_RESTART_COUNT="x"))
