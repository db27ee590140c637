"""Planted phase durations, for the phase-timing tests (tests/test_phases.py).

Every step of every rank: the dataset sleeps DATASET_MS to produce the batch (DataLoader with
``num_workers=0``, so inside ``__next__``, between steps), the model's forward sleeps
FORWARD_MS, and the optimizer (an SGD subclass) sleeps OPTIMIZER_MS in ``step()``. Sleeps, not
CPU work, so the durations hold on a loaded machine. No process group: each rank trains alone.

The script also times each planted part itself (``perf_counter_ns`` around the dataset's
``__getitem__``, the model's ``forward`` and the optimizer's ``step``): on a loaded machine a
sleep ends late, and these are the durations that were really planted. With ``--truth-dir``
each rank writes them to ``truth_<rank>.json`` (``{"input": [ns per step], "forward": [...],
"optimizer": [...]}``).

Options: ``--steps N`` (default 25); ``--iterator-rank R``: rank R reads the same batches
through a plain Python generator instead of a DataLoader (default -1: none).
"""

import json
import os
import time

import torch
from synthetic import SlowBatches, arguments
from torch import nn
from torch.utils.data import DataLoader

import traceml

DATASET_MS = 30.0
FORWARD_MS = 20.0
OPTIMIZER_MS = 5.0

#: Durations of the planted parts as they happened, ns, one per step each.
TRUTH = {"input": [], "forward": [], "optimizer": []}


class SlowModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(16, 1)

    def forward(self, x):
        start = time.perf_counter_ns()
        time.sleep(FORWARD_MS / 1000)
        out = self.net(x)
        TRUTH["forward"].append(time.perf_counter_ns() - start)
        return out


class SlowSGD(torch.optim.SGD):
    """An optimizer wrapper: OPTIMIZER_MS of sleep, then SGD's step."""

    def step(self, closure=None):
        start = time.perf_counter_ns()
        time.sleep(OPTIMIZER_MS / 1000)
        loss = super().step(closure)
        TRUTH["optimizer"].append(time.perf_counter_ns() - start)
        return loss


def main() -> None:
    parser = arguments(25)
    parser.add_argument("--iterator-rank", type=int, default=-1)
    args = parser.parse_args()
    rank = int(os.environ.get("RANK", 0))
    traceml.init()
    model = SlowModel()
    optimizer = SlowSGD(model.parameters(), lr=0.01)
    batches = SlowBatches(args.steps, DATASET_MS, TRUTH["input"])
    if rank == args.iterator_rank:
        source = (batches[i] for i in range(len(batches)))
    else:
        source = DataLoader(batches, batch_size=None, num_workers=0)
    for x, y in source:
        with traceml.trace_step(model):
            optimizer.zero_grad(set_to_none=True)
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
    if args.truth_dir is not None:
        (args.truth_dir / f"truth_{rank}.json").write_text(json.dumps(TRUTH))


if __name__ == "__main__":
    main()
