"""Which launcher holds which node rank: the aggregator's side of a node's claim (the first
message of its ``NodeSession``).

Every node's launcher claims its ``--node-rank`` before its torchrun starts (see
``traceml/launcher/claim.py``). The aggregator runs on node 0 by construction, so rank 0
belongs to the aggregator's own host; any other rank goes to the first launcher that claims
it. A claim is refused when

* the launcher refused itself (it found, for example, that ``--node-rank`` is not its
  ``SLURM_NODEID``) and says why;
* its ``--nnodes`` is not node 0's, or its rank is outside them;
* its ``--master-port`` is not node 0's: its torchrun would wait for a rendezvous store
  nobody serves, and node 0's for it, each until torch's timeout;
* it claims rank 0 from another host, or a rank that another launcher holds.

A claim refused while some rank is still unclaimed means a node will never join torchrun's
static rendezvous, so the run is marked failed (:attr:`NodeRegistry.run_failure`, the first
such refusal's reason); node 0's launcher reads it in every reply and stops its torchrun
instead of waiting. Once every rank is held, every node is in and the rendezvous can
complete: a late stray claim is refused, but never fails a run that is training.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class NodeRegistry:
    """The claims accepted so far, and the run's failure once a claim was refused.

    Args:
        own_host: this aggregator's host name: node 0's.
        nnodes: the run's node count (``--nnodes``); None when no launcher reports (ranks
            under plain torchrun), which skips the node-count check.
        master_port: node 0's rendezvous port (``--master-port``); None (or a claim without
            one) skips the port check.
    """

    own_host: str
    nnodes: int | None = None
    master_port: int | None = None
    #: node rank (>= 1) -> (host name, launcher pid) of the launcher that holds it; rank 0
    #: is ``own_host``'s.
    holders: dict[int, tuple[str, int]] = field(default_factory=dict)
    run_failure: str = ""

    def claim(self, claim) -> tuple[bool, str]:
        """Accept or refuse a :class:`~traceml.wire.NodeClaim`: ``(accepted, reason)``.

        Idempotent for the launcher that holds the rank. A refusal sets :attr:`run_failure`
        unless an earlier one did or every rank is held (:meth:`complete`).
        """
        who = f"the launcher on {claim.hostname} (pid {claim.launcher_pid})"
        rank, launcher = claim.node_rank, (claim.hostname, claim.launcher_pid)
        holder = self.holders.get(rank)
        if claim.refusal:
            reason = f"{who} refused to start as node {rank}: {claim.refusal}"
        elif self.nnodes is not None and claim.nnodes != self.nnodes:
            reason = f"{who} runs with --nnodes {claim.nnodes}, node 0 with {self.nnodes}"
        elif self.nnodes is not None and rank >= self.nnodes:
            reason = f"{who} claims node rank {rank}, outside 0..{self.nnodes - 1}"
        elif self.master_port and claim.master_port and claim.master_port != self.master_port:
            reason = (
                f"{who} runs with --master-port {claim.master_port}, node 0 with {self.master_port}"
            )
        elif rank == 0 and claim.hostname != self.own_host:
            reason = (
                f"{who} claims node rank 0, but node 0 is {self.own_host}, where the "
                "aggregator runs"
            )
        elif holder not in (None, launcher):
            reason = (
                f"{who} claims node rank {rank}, which the launcher on {holder[0]} "
                f"(pid {holder[1]}) holds"
            )
        else:
            if rank != 0:
                self.holders[rank] = launcher
            return True, ""
        if not self.complete():
            self.fail(reason)
        return False, reason

    def fail(self, reason: str) -> bool:
        """The run cannot go on (``reason``: it cannot rendezvous, or a node's launcher got a
        stop signal): it becomes :attr:`run_failure` unless an earlier failure is (the first
        stays). True when it did."""
        if self.run_failure:
            return False
        self.run_failure = reason
        return True

    def unclaimed(self) -> set[int]:
        """Node ranks 1..nnodes-1 no launcher holds (none while the node count is unknown)."""
        return set(range(1, self.nnodes or 1)) - self.holders.keys()

    def complete(self) -> bool:
        """Every node rank 1..nnodes-1 is held (never, when the node count is unknown)."""
        return self.nnodes is not None and len(self.holders) >= self.nnodes - 1
