"""A script that starts its own processes: ``torch.multiprocessing.spawn`` of ``--nprocs``
children, each building its own gloo process group and calling ``traceml.init()`` after it,
then training ``--steps`` steps of a tiny DDP model. Run under ``traceml run --nproc-per-node=1``:
torchrun's one worker is only the parent, and every child inherits its ``RANK=0``."""

import argparse
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import traceml


def child(index: int, nprocs: int, port: int, steps: int) -> None:
    # torchrun's agent store belongs to its own workers; a group of the script's own must
    # start its own store (torch.distributed would otherwise wait for one that never comes).
    os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=index, world_size=nprocs
    )
    traceml.init()
    model = DDP(nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(steps):
        with traceml.trace_step(model):
            optimizer.zero_grad()
            model(torch.randn(4, 8)).pow(2).mean().backward()
            optimizer.step()
    dist.destroy_process_group()
    print(f"spawn_ddp: child {index} trained {steps} steps", flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--nprocs", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(child, args=(args.nprocs, port, args.steps), nprocs=args.nprocs)


if __name__ == "__main__":
    main()
