"""A one-GPU training job with one planted behaviour, for the GPU diagnosis tests.

``--scenario``:

* ``h2d`` — every step copies a large pageable host batch to the GPU for a tiny model;
* ``creep`` — every step keeps a 64 MiB GPU tensor alive (a leak);
* ``plateau`` — ordinary training: memory rises while the allocator warms up, then stays flat.
"""

import argparse

import torch
from torch import nn

import traceml


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--scenario", choices=("h2d", "creep", "plateau"), required=True)
    p.add_argument("--steps", type=int, default=40)
    args = p.parse_args()

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    traceml.init()
    torch.manual_seed(0)
    width = 64 if args.scenario == "h2d" else 2048
    model = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 1)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # h2d: 64M floats (256 MiB) of pageable memory per step, of which the model uses a sliver
    host = torch.randn(64 * 1024 * 1024 if args.scenario == "h2d" else 256 * width)
    leaked = []
    for _ in range(args.steps):
        with traceml.trace_step(model):
            batch = host.to(device)
            x = batch[: 256 * width].view(256, width)
            loss = model(x).square().mean()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if args.scenario == "creep":
                leaked.append(torch.empty(16 * 1024 * 1024, device=device))  # 64 MiB kept
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
