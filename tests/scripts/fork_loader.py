"""Training with a forking DataLoader while telemetry streams, for the fork-safety test.

``--epochs`` epochs over a DataLoader with ``--workers`` workers and the ``fork`` start method
(no persistent workers, so every epoch forks them again) while the SDK's sender thread pushes
a batch per step. A worker that dies makes the DataLoader raise (exit code 1); one that hangs
hits the DataLoader ``timeout``. Prints ``trained N steps in E epochs``.
"""

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import traceml


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--batches", type=int, default=8, help="batches per epoch")
    args = parser.parse_args()

    traceml.init()
    batch_size = 16
    dataset = TensorDataset(
        torch.randn(args.batches * batch_size, 8), torch.randn(args.batches * batch_size, 1)
    )
    loader = DataLoader(
        dataset,
        batch_size=batch_size,
        num_workers=args.workers,
        multiprocessing_context="fork",
        persistent_workers=False,
        timeout=120,
    )
    model = nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    steps = 0
    for _ in range(args.epochs):
        for x, y in loader:
            with traceml.trace_step(model):
                loss = nn.functional.mse_loss(model(x), y)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
            steps += 1
    print(f"trained {steps} steps in {args.epochs} epochs", flush=True)


if __name__ == "__main__":
    main()
