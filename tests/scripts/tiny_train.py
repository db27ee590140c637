"""The tiny traced training loop of several test scripts (fail_open_train.py, idle_steps.py,
fail_once.py): a script imports it from its own directory, which Python puts first on the
path of a script, under torchrun as alone."""

import time
from collections.abc import Callable

import torch
from torch import nn

import traceml


def tiny_model() -> tuple[nn.Module, torch.optim.Optimizer]:
    """A ``Linear(16, 1)`` model and its SGD optimizer (lr 0.01)."""
    model = nn.Linear(16, 1)
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def train(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    steps: int,
    *,
    step_sleep_s: float = 0.0,
    after_step: Callable[[int], None] | None = None,
) -> None:
    """``steps`` traced steps (``traceml.trace_step(model)``) on a batch of 8 random rows, each
    sleeping ``step_sleep_s`` s inside the step; ``after_step(i)`` runs after step ``i``,
    outside any step."""
    for i in range(steps):
        with traceml.trace_step(model):
            optimizer.zero_grad()
            nn.functional.mse_loss(model(torch.randn(8, 16)), torch.randn(8, 1)).backward()
            optimizer.step()
            time.sleep(step_sleep_s)
        if after_step is not None:
            after_step(i)
