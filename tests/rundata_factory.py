"""RunData built by hand, as the store would load it (µs, bytes; None = not measured)."""

from __future__ import annotations

from traceml.analysis.rundata import RankData, RunData, StepTable
from traceml.core import records
from traceml.core.phases import STEP_OPTIONAL_FIELDS

MIB = 1024 * 1024
GPU_FIELDS = {
    "forward_us": "gpu_forward_us",
    "backward_us": "gpu_backward_us",
    "optimizer_us": "gpu_optimizer_us",
    "h2d_us": "gpu_h2d_us",
}


def step(
    i: int,
    *,
    input_wait=1000,
    forward=10_000,
    backward=20_000,
    optimizer=2_000,
    residual=500,
    h2d=None,
    comm=None,
    gpu=False,
    alloc=None,
    **extra,
) -> dict:
    """One stored step (µs); step_us is the sum of its parts."""
    s = dict.fromkeys(STEP_OPTIONAL_FIELDS)
    s.update(
        input_wait_us=input_wait,
        forward_us=forward,
        backward_us=backward,
        optimizer_us=optimizer,
        h2d_us=h2d,
        comm_us=comm,
        dataloader_next_us=input_wait,
    )
    if gpu:
        for cpu, g in GPU_FIELDS.items():
            s[g] = s[cpu]
            if cpu != "h2d_us" and s[cpu] is not None:
                s[cpu] = 50  # launch time only: the CPU clock would hide the work
    if alloc is not None:
        s["peak_allocated_bytes"] = alloc
        s["peak_reserved_bytes"] = alloc + 256 * MIB
    total = sum(v or 0 for v in (input_wait, forward, backward, optimizer, residual, h2d, comm))
    if gpu:
        s["gpu_step_us"] = total - input_wait  # the step body, without the input wait
    s.update(step=i, end_us=(i + 1) * total, step_us=total, **extra)
    return s


def identity(r: int, *, node=0, uuid="", **kw) -> records.Identity:
    """Rank ``r``'s identity as the store would load it (``kw`` replaces any column)."""
    columns = {
        "rank": r,
        "restart": 0,
        "node_rank": node,
        "local_rank": r % 4,
        "world_size": 0,
        "local_world_size": 4,
        "hostname": f"host{node}",
        "pid": 1000 + r,
        "start_unix_us": 1_000_000,
        "torch_version": "",
        "cuda_version": "",
        "backend": "",
        "parallelism": "",
        "device": "cpu",
        "gpu_uuid": uuid,
    }
    return records.Identity.from_row({**columns, **kw})


def finish_marker(r: int, steps_completed: int, **kw) -> records.Finish:
    """Rank ``r``'s finish marker: completed, nothing dropped (``kw`` replaces any column;
    ``last_seq`` -1 and ``received_unix_us`` 0: no batch and no clock of its own)."""
    columns = {
        "rank": r,
        "restart": 0,
        "steps_completed": steps_completed,
        "records_dropped": 0,
        "steps_gpu_unresolved": 0,
        "end_state": "completed",
        "reason": None,
        "last_seq": -1,
        "received_unix_us": 0,
    }
    return records.Finish.from_row({**columns, **kw})


def counts(r: int, *, seq: int, **kw) -> records.SenderCounts:
    """Rank ``r``'s client's running totals as of batch ``seq`` (``kw``: the counts)."""
    return records.SenderCounts(rank=r, restart=0, seq=seq, **kw)


def node_exit(
    n: int, *, exit_code=0, hostname=None, restart_count=0, received_unix_us=0
) -> records.NodeExit:
    """Node ``n``'s torchrun exit (``received_unix_us`` 0: no clock of its own)."""
    return records.NodeExit(n, hostname or f"host{n}", exit_code, restart_count, received_unix_us)


def rank_end(
    r: int,
    end_state: str,
    *,
    node_rank=0,
    local_rank=None,
    exit_code=None,
    signal=None,
    reason=None,
) -> records.RankEnd:
    """Rank ``r``'s end as its node's launcher reported it."""
    local = r % 4 if local_rank is None else local_rank
    return records.RankEnd(r, local, node_rank, end_state, exit_code, signal, reason)


def rank(
    r: int,
    steps: list[dict],
    *,
    node=0,
    uuid="",
    end="completed",
    exit_code=0,
    signal=None,
    finish=True,
    **kw,
) -> RankData:
    return RankData(
        rank=r,
        identity=identity(r, node=node, uuid=uuid),
        steps=StepTable.from_dicts(steps),
        finish=finish_marker(r, len(steps)) if finish else None,
        end=rank_end(r, end, node_rank=node, exit_code=exit_code, signal=signal),
        **kw,
    )


def run_of(ranks: list[RankData], *, missing=(), system=None, gpus=None, exits=None) -> RunData:
    """The run of ``ranks``; ``exits``: node -> its exit's fields (:func:`node_exit`'s), node 0
    exiting with 0 when not given."""
    return RunData(
        run_name="unit",
        world_size=len(ranks),
        ranks={rd.rank: rd for rd in ranks},
        node_exits={
            n: node_exit(n, **e) for n, e in (exits if exits is not None else {0: {}}).items()
        },
        system_samples=system or {},
        gpu_samples=gpus or {},
        missing=list(missing),
    )


def steps(n=40, **kw) -> list[dict]:
    """``n`` identical steps (see :func:`step`)."""
    return [step(i, **kw) for i in range(n)]


def system_sample(t, node=0, cpu=50.0, ram=0.5, reason=None) -> dict:
    """A node's host sample at unix µs ``t``: CPU %, RAM used as a fraction of 64 GiB."""
    return {
        "unix_us": t,
        "node_rank": node,
        "hostname": f"host{node}",
        "cpu_percent": cpu,
        "ram_used_bytes": int(ram * 64 * 1024 * MIB),
        "ram_total_bytes": 64 * 1024 * MIB,
        "gpu_unavailable_reason": reason,
    }


def rss_samples(r: int, n_steps: int, rss_at, every_us: int = 100_000, seed: int = 0) -> list:
    """Process samples of rank ``r`` every ``every_us`` µs over ``n_steps`` default steps
    (:func:`step`: 33.5 ms each, from unix µs 1,000,000), RSS ``rss_at(step)`` bytes (``step``
    fractional) plus up to 2 MiB of noise (seeded)."""
    import random

    rng = random.Random(seed + r)
    return [
        {
            "unix_us": 1_000_000 + t,
            "rank": r,
            "restart": 0,
            "cpu_percent": 50.0,
            "rss_bytes": int(rss_at(t / 33_500)) + rng.randint(0, 2 * MIB),
            "gpu_allocated_bytes": None,
            "gpu_reserved_bytes": None,
        }
        for t in range(0, n_steps * 33_500, every_us)
    ]


def gpu_sample(t, index, util, temp=60.0, reason=None, node=0) -> dict:
    """GPU ``index`` (UUID ``GPU-<node>-<index>``, 80 GiB) of ``node`` at unix µs ``t``."""
    return {
        "unix_us": t,
        "node_rank": node,
        "nvml_index": index,
        "uuid": f"GPU-{node}-{index}",
        "util_percent": util,
        "memory_used_bytes": 1,
        "memory_total_bytes": 80 * 1024 * MIB,
        "temperature_c": temp,
        "power_w": 200.0,
        "unavailable_reason": reason,
    }


def rich_run(n_steps: int = 200) -> RunData:
    """A GPU run on 2 nodes x 4 ranks with something in every report section: one step in 10
    GPU-timed, rank 6 computes 8 ms more per step on a hot GPU, rank 5's memory creeps, the GPUs
    are 60-70 % busy."""
    ranks = []
    for r in range(8):
        node = r // 4
        forward = 18_000 if r == 6 else 10_000
        out = []
        for i in range(n_steps):
            alloc = None
            if i % 10 == 0:
                k = i // 10
                alloc = int((3 + min(k, 2) / 2) * 1024 * MIB) + (k * 30 * MIB if r == 5 else 0)
            s = step(
                i,
                forward=forward,
                h2d=2_000,
                gpu=i % 10 == 0,
                alloc=alloc,
                input_wait=1500 + (i % 7) * 100,
            )
            s["step_us"] += 3000 * (i % 5 == 0)  # some jitter for the charts
            out.append(s)
        ranks.append(rank(r, out, node=node, uuid=f"GPU-{node}-{r % 4}"))
    span = range(1_000_000, 1_000_000 + n_steps * 40_000, 1_000_000)
    system = {
        n: [system_sample(t, node=n, cpu=35.0 + 10 * n, ram=0.3) for t in span] for n in (0, 1)
    }
    gpus = {
        n: [
            gpu_sample(t, g, 60.0 + g + 5 * n, temp=87.0 if (n, g) == (1, 2) else 64.0, node=n)
            for t in span
            for g in range(4)
        ]
        for n in (0, 1)
    }
    exits = {n: {"exit_code": 0, "hostname": f"host{n}", "restart_count": 0} for n in (0, 1)}
    return run_of(ranks, system=system, gpus=gpus, exits=exits)
