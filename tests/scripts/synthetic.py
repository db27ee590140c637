"""What the framework and planted-phase test scripts share: their command line and their data.

Imported by the scripts next to it (fw_hf.py, fw_lightning.py, planted_phases.py,
planted_zero_code.py): torchrun and ``traceml run`` both put the script's directory first on
``sys.path``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from torch.utils.data import Dataset


def arguments(steps: int, *, framework: bool = False) -> argparse.ArgumentParser:
    """The scripts' parser: ``--steps`` (default ``steps``); for a ``framework`` script
    ``--out DIR`` (its Trainer's output, required) and ``--callback`` (TraceML's callback),
    else ``--truth-dir DIR`` (where each rank writes what it timed itself, default none)."""
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=steps)
    if framework:
        p.add_argument("--out", required=True)
        p.add_argument("--callback", action="store_true")
    else:
        p.add_argument("--truth-dir", type=Path, default=None)
    return p


def regression_batch(i: int, samples: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch ``i`` of a synthetic regression: ``samples`` x 16 features and ``samples`` x 1
    targets, the same for a given ``i`` on every rank and run."""
    g = torch.Generator().manual_seed(i)
    return torch.randn(samples, 16, generator=g), torch.randn(samples, 1, generator=g)


class SlowBatches(Dataset):
    """``n`` whole batches (``DataLoader(batch_size=None)``) of :func:`regression_batch`, each
    made in at least ``sleep_ms``; with ``truth``, the time each took (ns) is appended to it."""

    def __init__(self, n: int, sleep_ms: float, truth: list | None = None) -> None:
        self.n, self.sleep_ms, self.truth = n, sleep_ms, truth

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        start = time.perf_counter_ns()
        time.sleep(self.sleep_ms / 1000)
        batch = regression_batch(i)
        if self.truth is not None:
            self.truth.append(time.perf_counter_ns() - start)
        return batch
