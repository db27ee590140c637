"""A training script that never imports TraceML (for the zero-code tests), unless told to.

Each rank trains a tiny model for ``--seconds`` (default 2.5) of wall time, sleeping between
steps, so the launcher's node sampler sees its workers for a few sampling periods; or, with
``--steps N``, exactly N optimizer steps. ``--trace-from K`` wraps steps K, K+1, ... in an
explicit ``traceml.trace_step(model)`` (the steps before it are zero-code steps).
"""

import argparse
import contextlib
import time

import torch
from torch import nn


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=2.5)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--trace-from", type=int, default=None)
    args = parser.parse_args()
    model = nn.Linear(16, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    end = time.monotonic() + args.seconds
    step = 0
    while (time.monotonic() < end) if args.steps is None else (step < args.steps):
        context = contextlib.nullcontext()
        if args.trace_from is not None and step >= args.trace_from:
            import traceml

            context = traceml.trace_step(model)
        with context:
            optimizer.zero_grad()
            nn.functional.mse_loss(model(torch.randn(8, 16)), torch.randn(8, 1)).backward()
            optimizer.step()
        time.sleep(0.02)
        step += 1


if __name__ == "__main__":
    main()
