"""A job whose rank ``--fail-rank`` fails in the first attempt only (for the restart test).

Run with ``traceml run ... --max-restarts 1``. Attempt 0 (``TORCHELASTIC_RESTART_COUNT=0``):
every rank traces ``--first-steps`` steps, waits ``--settle-sec`` so that their telemetry is
flushed (tests set ``TRACEML_FLUSH_INTERVAL_SEC`` well below it), then the failing rank raises
while the others wait to be stopped by torchrun. Attempt 1: every rank traces ``--steps`` steps
and exits 0. No process group, so the ranks never wait for each other.
"""

import argparse
import os
import time

import torch
from torch import nn

import traceml


def train(model, optimizer, steps: int) -> None:
    for _ in range(steps):
        with traceml.trace_step(model):
            optimizer.zero_grad()
            nn.functional.mse_loss(model(torch.randn(8, 16)), torch.randn(8, 1)).backward()
            optimizer.step()
        time.sleep(0.01)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--first-steps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--fail-rank", type=int, default=1)
    parser.add_argument("--settle-sec", type=float, default=1.5)
    args = parser.parse_args()
    traceml.init()
    model = nn.Linear(16, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    if int(os.environ["TORCHELASTIC_RESTART_COUNT"]) == 0:
        train(model, optimizer, args.first_steps)
        time.sleep(args.settle_sec)
        if int(os.environ["RANK"]) == args.fail_rank:
            raise RuntimeError("planted failure in the first attempt")
        time.sleep(120)  # stopped by torchrun when the failing rank's group restarts
    train(model, optimizer, args.steps)


if __name__ == "__main__":
    main()
