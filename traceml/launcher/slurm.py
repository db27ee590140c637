"""Slurm: the launch flags a job step implies, and the Slurm-specific launch mistakes.

``traceml run train.py --slurm``, run once per node by ``srun``, fills every launch flag the
user did not give from the job step's environment (explicit flags always win):

=====================  ==========================================================================
``--nnodes``           ``SLURM_STEP_NUM_NODES`` (the step's nodes), else ``SLURM_NNODES``
``--node-rank``        ``SLURM_NODEID``: this node's index in the step, 0..nnodes-1
``--nproc-per-node``   ``SLURM_GPUS_ON_NODE``, else ``SLURM_GPUS_PER_NODE`` read as a count
                       (``4``, ``a100:4``, or a per-node list ``4,2`` / ``2(x3)``), else
                       ``SLURM_NTASKS_PER_NODE`` (CPU-only or task-based allocations)
``--master-addr``      the first host of ``SLURM_STEP_NODELIST``, else ``SLURM_JOB_NODELIST``
                       (expanded with python-hostlist): the node whose ``SLURM_NODEID`` is 0
``--run-name``         ``slurm-<SLURM_JOB_ID>``; ``slurm-<SLURM_JOB_ID>-restart-<N>`` once Slurm
                       requeued the job N times (``SLURM_RESTART_COUNT``: preemption,
                       ``scontrol requeue``, a node failure), so that each attempt of the
                       job, which keeps its id, has a run directory of its own
=====================  ==========================================================================

The step's values are used, not the job's: inside ``srun`` Slurm numbers ``SLURM_NODEID``
within the step (a step on the job's second node alone has ``SLURM_NODEID=0``), and the step's
node list starts with that node.

``--slurm`` is not automatic inside an allocation: a plain ``traceml run`` in the batch script
or in an ``salloc`` shell runs on the first node only, and deriving ``--nnodes=N`` there would
make it wait for nodes that never start a launcher. Instead :func:`hint` says, once, when a
single-node run is started on every node of a multi-node step.

:func:`check` refuses the classic Slurm layout mistakes before anything starts, and
:func:`step_rank` is the node rank Slurm vouches for; comparing it with ``--node-rank`` and
``--master-addr`` (and telling node 0 about a wrong claim) is :mod:`traceml.launcher.claim`'s.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

import hostlist

from traceml.launcher.config import LaunchConfig, LaunchError

#: ``type:count`` of ``--gpus-per-node``: ``a100:4``, ``gpu:a100:4``.
_TYPED_COUNT = re.compile(r"^(?:[^:,()\s]+:)+(\d+)$")

#: What to do about the per-node ``$SLURM_NODEID`` expansion, in every message about it.
WRAPPER_HINT = (
    "put the `traceml run` command in a script that srun runs on every node "
    "(examples/slurm/launch.sh), or let every node read its own rank with "
    "`srun traceml run ... --slurm`"
)


@dataclass(frozen=True)
class SlurmStep:
    """What the ``SLURM_*`` environment says about this process's place in a job.

    Only :meth:`from_env` builds one; every field is the raw text of its variable (None when
    unset or empty), so errors can quote exactly what Slurm set.
    """

    job_id: str
    #: ``SLURM_STEP_ID``: set inside ``srun``; None in the batch script or an ``salloc`` shell.
    step_id: str | None
    node_id: str | None
    local_id: str | None
    nnodes: str | None
    nnodes_source: str
    nodelist: str | None
    nodelist_source: str
    gpus_on_node: str | None
    gpus_per_node: str | None
    ntasks_per_node: str | None
    #: ``SLURM_RESTART_COUNT``: how many times Slurm requeued the job (unset before the first).
    restart_count: str | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> SlurmStep | None:
        """The step this process runs in, or None outside Slurm (no ``SLURM_JOB_ID``)."""

        def get(name: str) -> str | None:
            value = environ.get(name, "").strip()
            return value or None

        job_id = get("SLURM_JOB_ID")
        if job_id is None:
            return None
        nnodes_source = "SLURM_STEP_NUM_NODES" if get("SLURM_STEP_NUM_NODES") else "SLURM_NNODES"
        nodelist_source = (
            "SLURM_STEP_NODELIST" if get("SLURM_STEP_NODELIST") else "SLURM_JOB_NODELIST"
        )
        return cls(
            job_id=job_id,
            step_id=get("SLURM_STEP_ID"),
            node_id=get("SLURM_NODEID"),
            local_id=get("SLURM_LOCALID"),
            nnodes=get(nnodes_source),
            nnodes_source=nnodes_source,
            nodelist=get(nodelist_source),
            nodelist_source=nodelist_source,
            gpus_on_node=get("SLURM_GPUS_ON_NODE"),
            gpus_per_node=get("SLURM_GPUS_PER_NODE"),
            ntasks_per_node=get("SLURM_NTASKS_PER_NODE"),
            restart_count=get("SLURM_RESTART_COUNT"),
        )

    # --- the values, parsed ----------------------------------------------------------------
    def node_count(self) -> int:
        """The step's node count.

        Raises:
            LaunchError: unset or not a whole number >= 1.
        """
        return _count(self.nnodes, self.nnodes_source, minimum=1, flag="--nnodes")

    def node_rank(self) -> int:
        """``SLURM_NODEID``, this node's index in the step.

        Raises:
            LaunchError: unset or not a whole number >= 0.
        """
        return _count(self.node_id, "SLURM_NODEID", minimum=0, flag="--node-rank")

    def run_name(self) -> tuple[str, str]:
        """The run name of this attempt of the job, and its source: ``slurm-<job id>``, and
        ``slurm-<job id>-restart-<N>`` once Slurm requeued the job N times (the job keeps its
        id, and the first attempt's run directory holds its telemetry).

        Raises:
            LaunchError: ``SLURM_RESTART_COUNT`` is set but not a whole number >= 0.
        """
        restarts = (
            0
            if self.restart_count is None
            else _count(self.restart_count, "SLURM_RESTART_COUNT", minimum=0, flag="--run-name")
        )
        if not restarts:
            return f"slurm-{self.job_id}", "SLURM_JOB_ID"
        return f"slurm-{self.job_id}-restart-{restarts}", "SLURM_JOB_ID, SLURM_RESTART_COUNT"

    def first_host(self) -> str:
        """The first host of the step's node list: node 0, the rendezvous master.

        Raises:
            LaunchError: the list is unset, empty or not a Slurm host list.
        """
        if self.nodelist is None:
            raise LaunchError(f"--slurm: {self.nodelist_source} is not set; pass --master-addr")
        try:
            hosts = hostlist.expand_hostlist(self.nodelist)
        except hostlist.BadHostlist as exc:
            raise LaunchError(
                f"--slurm: {self.nodelist_source}={self.nodelist!r} is not a Slurm host list "
                f"({exc}); pass --master-addr"
            ) from None
        if not hosts:
            raise LaunchError(f"--slurm: {self.nodelist_source} is empty; pass --master-addr")
        return hosts[0]

    def workers_per_node(self, node_rank: int) -> tuple[int, str]:
        """Workers (ranks) to start on node ``node_rank`` and the variable they come from.

        ``SLURM_GPUS_ON_NODE`` (a plain count; 0 or unset on CPU-only nodes), else
        ``SLURM_GPUS_PER_NODE`` (see :func:`gpus_per_node`), else ``SLURM_NTASKS_PER_NODE``.

        Raises:
            LaunchError: none of them is set, or the first one set is malformed.
        """
        if self.gpus_on_node not in (None, "0"):
            name = "SLURM_GPUS_ON_NODE"
            return _count(self.gpus_on_node, name, 1, "--nproc-per-node"), name
        if self.gpus_per_node is not None:
            return gpus_per_node(self.gpus_per_node, node_rank), "SLURM_GPUS_PER_NODE"
        if self.ntasks_per_node is not None:
            name = "SLURM_NTASKS_PER_NODE"
            return _count(self.ntasks_per_node, name, 1, "--nproc-per-node"), name
        raise LaunchError(
            "--slurm cannot tell how many workers to start on this node: none of "
            "SLURM_GPUS_ON_NODE, SLURM_GPUS_PER_NODE, SLURM_NTASKS_PER_NODE is set; "
            "pass --nproc-per-node"
        )


def _count(raw: str | None, name: str, minimum: int, flag: str) -> int:
    """``raw`` (from variable ``name``) as a whole number >= ``minimum``.

    Raises:
        LaunchError: unset or malformed; the message names the variable and ``flag``.
    """
    if raw is None:
        raise LaunchError(f"--slurm: {name} is not set; pass {flag}")
    if not re.fullmatch(r"[0-9]+", raw) or int(raw) < minimum:
        raise LaunchError(
            f"--slurm: {name}={raw!r} is not a whole number >= {minimum}; pass {flag}"
        )
    return int(raw)


def gpus_per_node(value: str, node_rank: int) -> int:
    """The GPU count on node ``node_rank`` that a ``SLURM_GPUS_PER_NODE`` value gives.

    Reads ``4``; ``type:count`` (``a100:4``), several of which add up (``a100:2,v100:1`` is
    3 GPUs on every node); and a per-node list in ``SLURM_TASKS_PER_NODE``'s syntax
    (``4,2``: 4 on node 0 and 2 on node 1; ``2(x3)``: 2 on each of 3 nodes), parsed with
    python-hostlist. A single-entry list applies to every node.

    Raises:
        LaunchError: ``value`` is none of these, counts 0 GPUs, or lists fewer nodes than
            ``node_rank + 1``.
    """
    items = value.split(",")
    typed = [_TYPED_COUNT.match(item.strip()) for item in items]
    if all(typed):
        count = sum(int(m.group(1)) for m in typed)
    else:
        try:
            counts = hostlist.parse_slurm_tasks_per_node(value)
        except hostlist.BadHostlist:
            raise LaunchError(
                f"--slurm: SLURM_GPUS_PER_NODE={value!r} is not a GPU count (N, type:N, or a "
                "per-node list such as 4,2 or 2(x3)); pass --nproc-per-node"
            ) from None
        if len(counts) == 1:
            count = counts[0]
        elif node_rank < len(counts):
            count = counts[node_rank]
        else:
            raise LaunchError(
                f"--slurm: SLURM_GPUS_PER_NODE={value!r} lists {len(counts)} nodes, "
                f"not node {node_rank}; pass --nproc-per-node"
            )
    if count < 1:
        raise LaunchError(
            f"--slurm: SLURM_GPUS_PER_NODE={value!r} gives node {node_rank} no GPU; "
            "pass --nproc-per-node"
        )
    return count


def apply(config: LaunchConfig, explicit: set[str], step: SlurmStep | None) -> str:
    """Fill the fields of ``config`` not in ``explicit`` from the Slurm step (``--slurm``).

    Args:
        config: the launch, as the flags gave it; changed in place.
        explicit: names of the ``LaunchConfig`` fields the user gave on the command line
            (they win): ``nnodes``, ``node_rank``, ``nproc_per_node``, ``master_addr``,
            ``run_name``.
        step: :meth:`SlurmStep.from_env` of the launcher's environment.

    Returns:
        One line naming every derived value and its source, for the launcher to print once.

    Raises:
        LaunchError: not inside a Slurm job, ``--slurm`` in a multi-node job outside
            ``srun`` (the batch script runs on the first node only), or a variable a derived
            value needs is unset or malformed.
    """
    if step is None:
        raise LaunchError("--slurm: not inside a Slurm job (SLURM_JOB_ID is not set)")
    derived: list[str] = []

    def derive(field: str, flag: str, value, source: str) -> None:
        setattr(config, field, value)
        derived.append(f"{flag}={value} ({source})")

    nnodes = config.nnodes
    if "nnodes" not in explicit:
        nnodes = step.node_count()
        if nnodes > 1 and step.step_id is None:
            raise LaunchError(
                f"--slurm outside srun: this is the batch script (or an salloc shell) of a "
                f"{nnodes}-node job, which runs on its first node only; start `traceml run "
                "--slurm` with srun, one task per node (#SBATCH --ntasks-per-node=1)"
            )
        derive("nnodes", "--nnodes", nnodes, step.nnodes_source)
    node_rank = config.node_rank
    if "node_rank" not in explicit:
        node_rank = step.node_rank()
        derive("node_rank", "--node-rank", node_rank, "SLURM_NODEID")
    if "nproc_per_node" not in explicit:
        count, source = step.workers_per_node(node_rank)
        derive("nproc_per_node", "--nproc-per-node", count, source)
    if "master_addr" not in explicit and nnodes > 1:
        derive(
            "master_addr",
            "--master-addr",
            step.first_host(),
            f"first host of {step.nodelist_source}={step.nodelist}",
        )
    if "run_name" not in explicit:
        derive("run_name", "--run-name", *step.run_name())
    if not derived:
        return "--slurm: every value it derives was given explicitly"
    return "--slurm: " + ", ".join(derived)


def _multi_node_step(config: LaunchConfig, step: SlurmStep | None) -> bool:
    """Whether the checks apply: a multi-node run inside ``srun`` (``SLURM_STEP_ID`` set).

    The batch script, an ``salloc`` shell and single-node runs may sit anywhere.
    """
    return step is not None and step.step_id is not None and config.nnodes > 1


def check(config: LaunchConfig, step: SlurmStep | None) -> None:
    """Refuse a multi-node launch whose layout contradicts the Slurm step it runs in.

    * ``SLURM_LOCALID`` > 0: Slurm started several tasks on this node, so several launchers
      would share it (TraceML starts one worker per GPU itself).
    * ``--nnodes`` larger than the step's nodes: node ranks outside the allocation, which
      would never start.

    Raises:
        LaunchError: one of the above; the message names the variables and the fix.
    """
    if not _multi_node_step(config, step):
        return
    if step.local_id not in (None, "0"):
        raise LaunchError(
            f"Slurm started more than one task on this node (SLURM_LOCALID={step.local_id}), "
            "so several `traceml run` would share it: run one task per node "
            "(#SBATCH --ntasks-per-node=1); TraceML starts one worker per GPU itself"
        )
    try:
        step_nodes = step.node_count()
    except LaunchError:
        return  # a step without a usable node count: nothing to compare with
    if config.nnodes > step_nodes:
        raise LaunchError(
            f"--nnodes {config.nnodes} is more nodes than this Slurm step has "
            f"({step.nnodes_source}={step.nnodes}), so node rank {step_nodes} and up would never "
            f"start: pass --nnodes={step_nodes} (or --slurm)"
        )


def step_rank(config: LaunchConfig, step: SlurmStep | None) -> int | None:
    """This node's ``SLURM_NODEID`` when it must be ``--node-rank``, else None.

    It must when a multi-node run spans the whole ``srun`` step (``--nnodes`` is the step's
    node count): then Slurm numbers the nodes exactly as static rendezvous needs them, and
    node 0 is the first host of the step's node list.
    """
    if not _multi_node_step(config, step):
        return None
    try:
        step_nodes, rank = step.node_count(), step.node_rank()
    except LaunchError:
        return None
    return rank if config.nnodes == step_nodes else None


def hint(config: LaunchConfig, step: SlurmStep | None) -> str:
    """A note when a single-node run starts on every node of a multi-node step, else "".

    That is ``srun traceml run train.py`` without ``--slurm`` or the multi-node flags: every
    node then runs its own one-node job.
    """
    if step is None or step.step_id is None or config.nnodes != 1:
        return ""
    try:
        step_nodes = step.node_count()
    except LaunchError:
        return ""
    if step_nodes < 2:
        return ""
    return (
        f"note: this Slurm step has {step_nodes} nodes but --nnodes is 1, so every node runs "
        "a separate single-node job; add --slurm to run one job across them"
    )
