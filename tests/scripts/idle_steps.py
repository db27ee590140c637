"""Training with an idle phase of more than a minute (a checkpoint save, an evaluation), for
the keepalive test: ``--steps`` steps, sleeping ``--idle-sec`` seconds after step ``--idle-after``
(outside any step). Prints ``trained N steps``.
"""

import argparse
import time

import torch
from torch import nn

import traceml


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--idle-after", type=int, default=3)
    parser.add_argument("--idle-sec", type=float, default=70.0)
    args = parser.parse_args()

    traceml.init()
    model = nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for i in range(args.steps):
        with traceml.trace_step(model):
            loss = nn.functional.mse_loss(model(torch.randn(16, 8)), torch.randn(16, 1))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        if i + 1 == args.idle_after:
            time.sleep(args.idle_sec)
    print(f"trained {args.steps} steps", flush=True)


if __name__ == "__main__":
    main()
