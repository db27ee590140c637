"""A small real DDP job (gloo, CPU) with the plants of issue 30, for tests/test_diagnosis_depth.py.

Every rank sleeps ``--forward-ms`` inside the model's forward (stable compute). Then:

* ``--leak R:M,..``: rank R keeps M MiB of tensors alive every step (a list of tensors that
  only grows: a host leak), each leaking rank at its own M;
* ``--cache-mib M --cache-steps K``: every rank fills a cache of M MiB over its first K steps,
  then keeps it and allocates nothing more (a first-epoch cache: a plateau);
* ``--slow-rank R --slow-from A [--slow-to B]``: rank R's forward sleeps ``--slow-ms`` more from
  step A until step B (excluded; the end of the run without it);
* ``--input-ms L --workers W --prefetch P``: the batches come from a DataLoader with W worker
  processes that each take L ms per batch and prefetch P batches each, so the first steps run
  on prefetched batches (the workers get 3 x P x L ms to fill their queues before the first
  step) and then every step waits for data;
* ``--ddp 0``: the model is not wrapped in DDP (the ranks do not wait for one another);
* ``--plateau-x F``: once the cache is full, the run goes on for at least F times as long as
  the cache took to fill (at least ``--forward-ms`` a step), so that the flat memory after it
  outlasts the growth however slowly a loaded host fills pages. The fill's time is the
  slowest rank's (one all-reduce after the fill), so that every rank runs the same steps.

Each rank writes what it measured itself to ``--clock-out``/rank<r>.json: its RSS after every
step (``rss_bytes``, from /proc/self/statm), its step times (ms) and the number of steps.
"""

import argparse
import json
import math
import os
import time

import torch
import torch.distributed as dist
from planted_truth import Batches, Model  # this script's directory is on sys.path
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader

import traceml

MIB = 1024 * 1024
PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes() -> int:
    """This process's resident set size, bytes."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def _filled(mib: float) -> torch.Tensor:
    """``mib`` MiB of float32, every page touched (resident)."""
    return torch.ones(int(mib * MIB) // 4)


#: The most steps a run with ``--plateau-x`` may take (the size of its dataset).
MAX_STEPS = 100_000


def _plateau_steps(args: argparse.Namespace, fill_s: float) -> int:
    """The steps after the cache's fill that outlast it ``--plateau-x`` times: the slowest
    rank's fill time (seconds, one all-reduce) over the shortest a step can take."""
    slowest = torch.tensor([fill_s], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return min(
        MAX_STEPS - args.cache_steps,
        math.ceil(args.plateau_x * slowest.item() * 1000.0 / args.forward_ms),
    )


#: The script's options: (flag, type, default); see the module docstring.
OPTIONS = (
    ("--steps", int, 80),
    ("--forward-ms", float, 20.0),
    ("--leak", str, ""),
    ("--cache-mib", float, 0.0),
    ("--cache-steps", int, 20),
    ("--slow-rank", int, -1),
    ("--slow-from", int, 0),
    ("--slow-to", int, None),
    ("--slow-ms", float, 60.0),
    ("--input-ms", float, 0.0),
    ("--workers", int, 0),
    ("--prefetch", int, 2),
    ("--ddp", int, 1),
    ("--plateau-x", float, 0.0),
)


def main() -> None:
    p = argparse.ArgumentParser()
    for flag, kind, default in OPTIONS:
        p.add_argument(flag, type=kind, default=default)
    p.add_argument("--clock-out", required=True)
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    traceml.init()
    leak_mib = dict(
        (int(r), float(m)) for r, m in (spec.split(":") for spec in args.leak.split(",") if spec)
    ).get(rank, 0.0)
    slow_to = args.slow_to if args.slow_to is not None else args.steps

    torch.manual_seed(0)
    loader_kw = {}
    if args.workers:
        loader_kw = {"num_workers": args.workers, "prefetch_factor": args.prefetch}
    batches = Batches(MAX_STEPS if args.plateau_x else args.steps, lambda i: args.input_ms)
    loader = DataLoader(batches, batch_size=None, **loader_kw)
    net = Model()
    model = DDP(net) if args.ddp else net
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = nn.MSELoss()
    kept: list[torch.Tensor] = []  # the leak, and the cache
    clock = {"rss_bytes": [], "step_ms": [], "steps": 0}
    it = iter(loader)
    # set-up time (a model loading, say): the workers fill their queues. Both ranks' queues
    # must be full: a rank whose worker is a batch behind waits for every batch from then on
    # while the other waits for it inside the all-reduce (an input straggler, not a bound)
    if args.workers:
        time.sleep(args.input_ms / 1000.0 * args.prefetch * 3)
    steps, step, t_first = args.steps, 0, time.perf_counter()
    while step < steps:
        net.sleep_ms = args.forward_ms
        if rank == args.slow_rank and args.slow_from <= step < slow_to:
            net.sleep_ms += args.slow_ms
        t0 = time.perf_counter()
        with traceml.trace_step(model):
            x, y = next(it)
            optimizer.zero_grad(set_to_none=True)
            loss_fn(model(x), y).backward()
            optimizer.step()
        clock["step_ms"].append((time.perf_counter() - t0) * 1000.0)
        # outside the step, so that filling pages (slow on a loaded host) is no step time
        if leak_mib:
            kept.append(_filled(leak_mib))
        if args.cache_mib and step < args.cache_steps:
            kept.append(_filled(args.cache_mib / args.cache_steps))
        clock["rss_bytes"].append(rss_bytes())
        clock["steps"] += 1
        if args.plateau_x and step == args.cache_steps - 1:
            steps = max(steps, step + 1 + _plateau_steps(args, time.perf_counter() - t_first))
        step += 1
    with open(os.path.join(args.clock_out, f"rank{rank}.json"), "w") as f:
        json.dump(clock, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
