"""Wire messages built by hand: a rank's identity and batch of steps, a node sampler's batch, a
node's claim and exit report. Each test module says only what differs (its step rows, its run
name)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from traceml import wire
from traceml.wire.records import add_steps

#: When the runs built here started, unix µs (2023-11-14 22:13:20 UTC).
START_US = 1_700_000_000_000_000


def tiny_step(i: int) -> dict[str, int]:
    """Step ``i`` as the smallest valid row: 1 µs long, ending at ``i + 1`` µs."""
    return {"step": i, "end_us": i + 1, "step_us": 1}


def rank_batch(
    seq: int,
    steps: Iterable[int] = (),
    *,
    rank: int = 0,
    run_name: str = "r",
    restart: int = 0,
    row: Callable[[int], dict] = tiny_step,
    **fields,
) -> wire.Batch:
    """Rank ``rank``'s batch ``seq`` of attempt ``restart``, with one step row ``row(i)`` (a
    dict of wire step fields, µs) for each ``i`` of ``steps``; ``fields`` are more
    :class:`wire.Batch` fields (``identity``, ``finish``...)."""
    batch = wire.Batch(run_name=run_name, rank=rank, restart_count=restart, seq=seq, **fields)
    add_steps(batch, (row(i) for i in steps))
    return batch


def rank_identity(
    rank: int, restart: int = 0, *, world_size: int = 2, **fields
) -> wire.RankIdentity:
    """Rank ``rank``'s identity in attempt ``restart`` of run ``r``: DDP on CPU (gloo), one node
    (``h0``) of ``world_size`` ranks, local rank ``rank``, pid ``100 + rank``, started at
    :data:`START_US` (unix µs); ``fields`` are more :class:`wire.RankIdentity` fields
    (``torch_version``...)."""
    return wire.RankIdentity(
        run_name="r",
        rank=rank,
        local_rank=rank,
        node_rank=0,
        world_size=world_size,
        local_world_size=world_size,
        hostname="h0",
        pid=100 + rank,
        restart_count=restart,
        start_unix_us=START_US,
        parallelism="ddp",
        device="cpu",
        backend="gloo",
        **fields,
    )


def node_batch(seq: int, *, node_rank: int = 0, run_name: str = "r", **fields) -> wire.Batch:
    """Node ``node_rank``'s sampler batch ``seq`` (no rank), with ``fields``."""
    return wire.Batch(run_name=run_name, node_rank=node_rank, seq=seq, **fields)


def rank_end(
    rank: int,
    state: str | int = "completed",
    exit_code: int | None = None,
    local_rank: int | None = None,
) -> wire.RankEnd:
    """One rank's end in a node exit report: ``state`` is an EndState name in lower case
    (``completed``, ``failed``...) or a raw EndState number; the exit code is 0 for
    ``completed`` and 1 otherwise unless given; the local rank is the rank unless given."""
    return wire.RankEnd(
        rank=rank,
        local_rank=rank if local_rank is None else local_rank,
        end_state=(
            state
            if isinstance(state, int)
            else getattr(wire.EndState, f"END_STATE_{state.upper()}")
        ),
        exit_code=(0 if state == "completed" else 1) if exit_code is None else exit_code,
    )


def node_exit(
    ranks: Iterable[wire.RankEnd],
    *,
    exit_code: int = 0,
    node_rank: int = 0,
    run_name: str = "r",
    hostname: str = "h0",
) -> wire.NodeExit:
    """Node ``node_rank``'s exit report: its launcher's ``exit_code`` and its ranks' ends."""
    return wire.NodeExit(
        run_name=run_name,
        node_rank=node_rank,
        hostname=hostname,
        exit_code=exit_code,
        ranks=list(ranks),
    )


def node_claim(
    node_rank: int,
    *,
    nnodes: int,
    hostname: str,
    launcher_pid: int,
    refusal: str = "",
    run_name: str = "r",
    master_port: int = 0,
) -> wire.NodeClaim:
    """The claim of node rank ``node_rank`` in a run of ``nnodes`` nodes by the launcher
    ``launcher_pid`` on ``hostname``; ``refusal``: why that launcher refused to start (empty:
    it did not); ``master_port``: its rendezvous port (0: not said)."""
    return wire.NodeClaim(
        run_name=run_name,
        node_rank=node_rank,
        nnodes=nnodes,
        hostname=hostname,
        launcher_pid=launcher_pid,
        refusal=refusal,
        master_port=master_port,
    )
