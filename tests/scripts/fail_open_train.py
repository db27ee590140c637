"""A small training loop that calls ``traceml.init()``, for the fail-open tests.

Trains ``--steps`` steps of a tiny model under ``traceml.trace_step`` with a planted
``--step-sleep`` (s) per step, then prints ``trained N steps`` and ``training ended at T``
(Unix s) so a test can measure how long the process takes to exit after training.
"""

import argparse
import time

import torch
from torch import nn

import traceml


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--step-sleep", type=float, default=0.0)
    args = parser.parse_args()

    traceml.init()
    model = nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(args.steps):
        with traceml.trace_step(model):
            loss = model(torch.randn(4, 8)).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            time.sleep(args.step_sleep)
    print(f"trained {args.steps} steps", flush=True)
    print(f"training ended at {time.time():.3f}", flush=True)


if __name__ == "__main__":
    main()
