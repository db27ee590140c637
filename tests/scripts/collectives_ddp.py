"""A small real DDP job (gloo, CPU) that runs every recorded kind of collective in each step.

Each of ``--steps`` steps: a DDP forward/backward (its gradient buckets) and optimizer step,
then, still inside the step, one of each explicit collective: ``all_reduce`` (sync),
``all_gather_into_tensor`` (async, waited on), ``all_gather``, ``reduce_scatter_tensor``,
``broadcast`` and ``barrier``. Then ``--quiet-steps`` steps without any collective: a
forward/backward under ``model.no_sync()`` (gradient accumulation, no bucket all-reduced). At
the end every rank writes its parameters and the results of its collectives to
``--out/result_<rank>.pt`` and, when TraceML recorded them, its collective events to
``--out/events_<rank>.json``. With ``--no-traceml`` TraceML is never imported (the reference
run for bit-identical results).
"""

import argparse
import json
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--quiet-steps", type=int, default=0)
    parser.add_argument("--no-traceml", action="store_true")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    traceml = None
    if not args.no_traceml:
        import traceml

        traceml.init()
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 3)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    results = []
    for _ in range(args.steps):
        x, y = torch.randn(8, 32, generator=g), torch.randn(8, 3, generator=g)
        ctx = traceml.trace_step(model) if traceml else _null()
        with ctx:
            loss = ((model(x) - y) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            t = loss.detach().reshape(1) * (rank + 1)
            dist.all_reduce(t)  # 4 bytes
            gathered = torch.empty(world * 4)
            work = dist.all_gather_into_tensor(
                gathered, torch.full((4,), float(rank)), async_op=True
            )
            work.wait()  # 16 bytes
            parts = [torch.empty(2) for _ in range(world)]
            dist.all_gather(parts, torch.full((2,), rank + 0.5))  # 8 bytes
            scattered = torch.empty(2)
            dist.reduce_scatter_tensor(scattered, torch.arange(2.0 * world) + rank)  # 8 * world
            b = torch.full((3,), float(rank))
            dist.broadcast(b, src=0)  # 12 bytes
            dist.barrier()
        results += [t, gathered, *parts, scattered, b]
    for _ in range(args.quiet_steps):
        x, y = torch.randn(8, 32, generator=g), torch.randn(8, 3, generator=g)
        ctx = traceml.trace_step(model) if traceml else _null()
        with ctx, model.no_sync():
            ((model(x) - y) ** 2).mean().backward()
    torch.save(
        {"params": [p.detach() for p in model.parameters()], "results": results},
        os.path.join(args.out, f"result_{rank}.pt"),
    )
    if traceml:
        from traceml.sdk import collectives

        events = [e.as_dict() for e in collectives.recorder().events]
        with open(os.path.join(args.out, f"events_{rank}.json"), "w") as f:
            json.dump(events, f)
        traceml.shutdown()
    dist.destroy_process_group()


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


if __name__ == "__main__":
    main()
