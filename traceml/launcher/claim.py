"""A node's claim to its ``--node-rank``: checked before start, registered with node 0.

Static rendezvous trusts every node to know its own rank. When two launchers claim the same
rank (``$SLURM_NODEID`` expanded once by the batch shell makes every node claim 0), torchrun
waits for a node that never comes, until its rendezvous timeout. TraceML catches this three
ways, each where the evidence is:

* before anything starts, on the node itself (:func:`check`): node 0 must run on the host of
  ``--master-addr`` (the rendezvous master and the aggregator are node 0's), and inside Slurm
  ``--node-rank`` must match ``SLURM_NODEID`` (:func:`traceml.launcher.slurm.step_rank`) and
  no other node may be the master's host. A launcher whose claim fails here raises
  :class:`ClaimError` and tells node 0's aggregator (:func:`report_refusal`), so node 0 stops
  too instead of waiting;
* at node 0's aggregator (see ``traceml_aggregator/nodes.py``): every node's launcher sends
  its claim first on its session stream (:mod:`traceml.launcher.session`) before its torchrun
  starts; a rank held by another launcher, or another ``--nnodes`` or ``--master-port`` than
  node 0's, is refused;
* on every node whose session is open: the aggregator pushes the run's failure down each
  session the moment it refuses a claim, and the launcher stops its torchrun.

Telemetry stays fail-open: an aggregator that cannot be reached for a registration only costs
the check, never the run.
"""

from __future__ import annotations

import ipaddress
import os
import socket

from traceml.launcher import aggregator, slurm
from traceml.launcher.config import LaunchConfig, LaunchError

# psutil and grpc are imported where they are used: node 0 starts torchrun before paying for them.


class ClaimError(LaunchError):
    """This launcher's ``--node-rank`` cannot be right (another node must hold it).

    Reported like any :class:`LaunchError` (one line, exit code 2, nothing started), and
    also to node 0's aggregator with :func:`report_refusal`.
    """


def _addresses(host: str) -> set:
    """The IP addresses ``host`` resolves to (an IP literal: itself).

    Raises:
        socket.gaierror: ``host`` does not resolve.
    """
    infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    return {ipaddress.ip_address(info[4][0].split("%")[0]) for info in infos}


def _local_addresses() -> set:
    """The IP addresses of this host's interfaces (in this network namespace)."""
    import psutil

    found = set()
    for addrs in psutil.net_if_addrs().values():
        for addr in addrs:
            if addr.family in (socket.AF_INET, socket.AF_INET6):
                found.add(ipaddress.ip_address(addr.address.split("%")[0]))
    return found


def _same_name(a: str, b: str) -> bool:
    """Host names ``a`` and ``b`` are one (case-insensitive; ``node1`` is ``node1.cluster``)."""
    a, b = a.lower().rstrip("."), b.lower().rstrip(".")
    if a == b:
        return True
    return ("." not in a or "." not in b) and a.split(".")[0] == b.split(".")[0]


def is_this_host(host: str) -> bool:
    """Whether ``host`` (a name or an IP address) is the machine this runs on.

    Yes when it is this machine's host name, resolves to an address of one of this host's
    non-loopback interfaces, is a ``localhost`` address (127.0.0.1, ::1), or resolves to what
    this host's own name resolves to. Any other loopback address (``127.77.0.11``) is not
    taken as proof: on one machine that hosts several nodes (containers, the test suite's
    Slurm lab) every 127.x address is local to every node, so only the names tell them apart.

    Raises:
        LaunchError: ``host`` does not resolve.
    """
    own_name = socket.gethostname()
    try:
        ipaddress.ip_address(host)
    except ValueError:
        if _same_name(host, own_name):
            return True
    try:
        resolved = _addresses(host)
    except (socket.gaierror, UnicodeError) as exc:
        raise LaunchError(f"host {host!r} does not resolve ({exc})") from None
    if any(not a.is_loopback for a in resolved & _local_addresses()):
        return True
    if resolved & {ipaddress.ip_address("127.0.0.1"), ipaddress.ip_address("::1")}:
        return True
    try:
        return bool(resolved & _addresses(own_name))
    except (socket.gaierror, UnicodeError):
        return False


def check(config: LaunchConfig) -> None:
    """Refuse a node-rank claim or a master address that cannot be right, before anything
    starts.

    In order: the Slurm layout (:func:`traceml.launcher.slurm.check`); inside a Slurm step
    that the run spans, ``--node-rank`` must be ``SLURM_NODEID``; on node 0 of a multi-node
    run, ``--master-addr`` must be this host; and inside such a Slurm step, on any other
    node it must not be.

    Raises:
        ClaimError: this launcher must not be the node it claims to be (when Slurm vouches
            for node 0 but the master address is another host, the address is wrong instead:
            a plain :class:`LaunchError`).
        LaunchError: another mistake: the Slurm task layout, a master address that does not
            resolve or is not node 0's.
    """
    step = slurm.SlurmStep.from_env(os.environ)
    slurm.check(config, step)
    slurm_rank = slurm.step_rank(config, step)
    if slurm_rank is not None and slurm_rank != config.node_rank:
        cause = (
            "$SLURM_NODEID was expanded once, by the batch shell, for every node, so every "
            "node claims rank 0"
            if config.node_rank == 0
            else "every node's --node-rank must be its own SLURM_NODEID"
        )
        raise ClaimError(
            f"this is node {slurm_rank} of Slurm step {step.job_id}.{step.step_id} "
            f"(SLURM_NODEID={step.node_id}), but --node-rank is {config.node_rank}: {cause}; "
            f"{slurm.WRAPPER_HINT}"
        )
    if config.nnodes < 2:
        return
    master, here = config.master_addr, socket.gethostname()
    master_here = is_this_host(master)
    if config.owns_aggregator and not master_here:
        if slurm_rank is not None:
            raise LaunchError(
                f"--master-addr {master} is another host, but this host ({here}) is node 0 of "
                f"the Slurm step: the master address must be the first host of "
                f"{step.nodelist_source} ({step.nodelist}), or use --slurm"
            )
        raise ClaimError(
            f"--node-rank is 0, but --master-addr {master} is another host (this is {here}): "
            "node 0 hosts the rendezvous and the aggregator, so it must run on the master "
            f"address; if every node was given --node-rank 0, {slurm.WRAPPER_HINT}"
        )
    if not config.owns_aggregator and master_here and slurm_rank is not None:
        raise LaunchError(
            f"--master-addr {master} is this host ({here}), but this is node {slurm_rank} of the "
            f"Slurm step: the master address must be node 0's, the first host of "
            f"{step.nodelist_source} ({step.nodelist}), or use --slurm"
        )


def node_claim(config: LaunchConfig, refusal: str = ""):
    """This launcher's :class:`~traceml.wire.NodeClaim` (``refusal``: why it refuses itself)."""
    from traceml import wire

    return wire.NodeClaim(
        run_name=str(config.run_name),
        node_rank=config.node_rank,
        nnodes=config.nnodes,
        master_port=config.master_port or 0,
        hostname=socket.gethostname(),
        launcher_pid=os.getpid(),
        refusal=refusal,
    )


def open_session(config: LaunchConfig, refusal: str = "", target: str = ""):
    """Open this node's session with node 0's aggregator at ``target`` (default
    ``config.launcher_target``), its claim first: a started
    :class:`~traceml.launcher.session.NodeSession` (``refusal``: the launcher refuses itself,
    and says why)."""
    from traceml.launcher.session import NodeSession

    return NodeSession(target or config.launcher_target, node_claim(config, refusal)).start()


def report_refusal(config: LaunchConfig, reason: str) -> str:
    """Tell node 0's aggregator that this launcher refused to start, so node 0 stops too.

    Waits for the aggregator at most ``config.aggregator_start_sec`` (as long as node 0 may
    take to start it). Never raises.

    Returns:
        One line for the user: what node 0 was told, or why it could not be.
    """
    from traceml.core.rundir import RunDir
    from traceml.launcher import credentials

    target = config.aggregator_target
    try:
        aggregator.wait_serving(target, float(config.aggregator_start_sec))
    except aggregator.AggregatorUnavailable as exc:
        return f"node 0 was not told ({exc})"
    missing = credentials.obtain_now(
        config, RunDir(config.run_dir, config.node_rank), float(config.aggregator_start_sec)
    )
    if missing:
        return f"node 0 was not told ({missing})"
    session = open_session(config, refusal=reason, target=target)
    try:
        if session.wait_claim(float(config.aggregator_start_sec)) is None:
            return f"node 0's aggregator at {target} was not told ({session.error or 'no answer'})"
    finally:
        session.close()
    return f"told node 0's aggregator at {target}: the run stops there too"
