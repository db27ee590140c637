"""A plain DDP loop (gloo, CPU) that never imports TraceML, with planted phase durations.

Every step: the dataset sleeps DATASET_MS per batch (DataLoader, ``num_workers=0``), the model's
forward sleeps FORWARD_MS, and the optimizer (an SGD subclass) sleeps OPTIMIZER_MS in
``step()``. The script times each part itself: around ``next()`` of the loader's iterator,
around the DDP model's call, and inside the optimizer's ``step()`` (its step call also runs
torch's step hooks, where TraceML's own step-end work happens), and, with ``--truth-dir``,
writes them per rank to ``truth_<rank>.json`` (``{"input": [ns per step], "forward": [...],
"optimizer": [...], "step_end": [perf_counter_ns after each optimizer step]}``). Every batch
is 8 samples of 16 features. ``--steps N`` optimizer steps (default 20).
"""

import json
import time

import torch
import torch.distributed as dist
from synthetic import SlowBatches, arguments
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader

DATASET_MS = 10.0
FORWARD_MS = 20.0
OPTIMIZER_MS = 5.0


class SlowModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(16, 1)

    def forward(self, x):
        time.sleep(FORWARD_MS / 1000)
        return self.net(x)


class SlowSGD(torch.optim.SGD):
    def __init__(self, params, truth: list, **kwargs) -> None:
        super().__init__(params, **kwargs)
        self.truth = truth

    def step(self, closure=None):
        start = time.perf_counter_ns()
        time.sleep(OPTIMIZER_MS / 1000)
        loss = super().step(closure)
        self.truth.append(time.perf_counter_ns() - start)
        return loss


def timed(truth: list, call, *args):
    start = time.perf_counter_ns()
    out = call(*args)
    truth.append(time.perf_counter_ns() - start)
    return out


def main() -> None:
    args = arguments(20).parse_args()
    dist.init_process_group("gloo")
    truth = {"input": [], "forward": [], "optimizer": [], "step_end": []}
    model = DDP(SlowModel())
    optimizer = SlowSGD(model.parameters(), truth["optimizer"], lr=0.01)
    batches = iter(DataLoader(SlowBatches(args.steps, DATASET_MS), batch_size=None, num_workers=0))
    for _ in range(args.steps):
        x, y = timed(truth["input"], next, batches)
        optimizer.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(timed(truth["forward"], model, x), y)
        loss.backward()
        optimizer.step()
        truth["step_end"].append(time.perf_counter_ns())
    if args.truth_dir is not None:
        (args.truth_dir / f"truth_{dist.get_rank()}.json").write_text(json.dumps(truth))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
