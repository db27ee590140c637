"""A training script that never imports TraceML (for the zero-code tests).

Each rank trains a tiny model for ``--seconds`` (default 2.5) of wall time, sleeping between
steps, so the launcher's node sampler sees its workers for a few sampling periods.
"""

import argparse
import time

import torch
from torch import nn


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=2.5)
    args = parser.parse_args()
    model = nn.Linear(16, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    end = time.monotonic() + args.seconds
    while time.monotonic() < end:
        optimizer.zero_grad()
        nn.functional.mse_loss(model(torch.randn(8, 16)), torch.randn(8, 1)).backward()
        optimizer.step()
        time.sleep(0.02)


if __name__ == "__main__":
    main()
