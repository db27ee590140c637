"""A minimal, real DistributedDataParallel training job instrumented with TraceML.

Runs under ``traceml run examples/ddp_minimal.py --nproc-per-node=2`` (or plain ``torchrun``):
gloo on CPU, nccl when CUDA is present (one GPU per local rank). A small MLP learns a noisy
linear regression from a synthetic dataset through a real DataLoader with a
DistributedSampler.

Options: ``--steps N`` optimizer steps per rank (default 50), ``--batch-size`` (32),
``--workers`` DataLoader workers (0), ``--hidden`` MLP width (256), ``--zero-code``: the same
loop without TraceML's two lines (``traceml run`` then finds its steps by itself),
``--mark-step K``: rank 0 prints ``at step K`` as step K begins, ``--step-ms MS``: each step
takes at least MS ms (the loop sleeps the rest: a job at a fixed step rate, as benchmarks want).
Rank 0 ends with ``trained N steps in T s``: the training loop's wall time (benchmarks compare it
with and without TraceML, and measure CPU time between the two lines).
"""

import argparse
import contextlib
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--zero-code", action="store_true")
    parser.add_argument("--mark-step", type=int, default=-1)
    parser.add_argument("--step-ms", type=float, default=0.0)
    args = parser.parse_args()

    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, local_rank = dist.get_rank(), int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device(f"cuda:{local_rank}" if use_cuda else "cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    if args.zero_code:
        untraced = contextlib.nullcontext()  # reusable: no allocation per step
        trace_step = lambda model: untraced  # noqa: E731
    else:
        import traceml

        traceml.init()
        trace_step = traceml.trace_step

    torch.manual_seed(0)
    features = torch.randn(4096, 64)
    targets = features @ torch.randn(64, 1) + 0.1 * torch.randn(4096, 1)
    dataset = TensorDataset(features, targets)
    sampler = DistributedSampler(dataset, shuffle=True, seed=0)
    loader = DataLoader(
        dataset,
        batch_size=args.batch_size,
        sampler=sampler,
        num_workers=args.workers,
        pin_memory=use_cuda,
        drop_last=True,
    )

    model = nn.Sequential(
        nn.Linear(64, args.hidden),
        nn.ReLU(),
        nn.Linear(args.hidden, args.hidden),
        nn.ReLU(),
        nn.Linear(args.hidden, 1),
    ).to(device)
    model = DDP(model, device_ids=[local_rank] if use_cuda else None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss_fn = nn.MSELoss()

    step, epoch = 0, 0
    loop_start = time.perf_counter()
    while step < args.steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            if step >= args.steps:
                break
            if step == args.mark_step and rank == 0:
                print(f"at step {step}", flush=True)
            with trace_step(model):
                x = x.to(device, non_blocking=True)
                y = y.to(device, non_blocking=True)
                optimizer.zero_grad(set_to_none=True)
                loss = loss_fn(model(x), y)
                loss.backward()
                optimizer.step()
            step += 1
            if args.step_ms:
                time.sleep(max(0.0, loop_start + step * args.step_ms / 1000 - time.perf_counter()))
        epoch += 1

    if rank == 0:
        elapsed = time.perf_counter() - loop_start
        print(f"trained {step} steps in {elapsed:.3f} s, final loss {loss.item():.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
