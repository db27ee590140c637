"""An Accelerate training loop that never imports TraceML: ``--steps`` optimizer steps.

``Accelerator(cpu=True)`` prepares a tiny MLP, its optimizer and a DataLoader of a synthetic
dataset; ``accelerator.backward(loss)``; gloo DDP on CPU under torchrun.
"""

import argparse

import torch
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=8)
    args = p.parse_args()
    accelerator = Accelerator(cpu=True)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(512, 16, generator=g), torch.randn(512, 1, generator=g))
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer, loader = accelerator.prepare(
        model, optimizer, DataLoader(data, batch_size=8, shuffle=True)
    )
    step = 0
    while step < args.steps:
        for x, y in loader:
            if step >= args.steps:
                break
            optimizer.zero_grad()
            accelerator.backward(nn.functional.mse_loss(model(x), y))
            optimizer.step()
            step += 1


if __name__ == "__main__":
    main()
