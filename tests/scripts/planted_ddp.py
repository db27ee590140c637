"""A small real DDP job (gloo, CPU) with one planted bottleneck, for the diagnosis tests.

Every scenario sleeps BASE_FORWARD_MS inside the model's forward on every rank, so the step has
a stable compute part that CPU contention cannot blur. Then, by ``--scenario``:

* ``balanced`` — nothing else (the control: no bottleneck);
* ``input`` — the dataset sleeps ``--delay-ms`` per batch on every rank;
* ``input_straggler`` — the dataset sleeps ``--delay-ms`` per batch on ``--slow-rank`` only;
* ``compute_straggler`` — the forward sleeps ``--delay-ms`` more on ``--slow-rank`` only;
* ``residual`` — every rank sleeps ``--delay-ms`` inside the step, outside every phase;
* ``comm`` — the model holds COMM_PARAMS more parameters, each with a gradient every step (of
  a cheap use in forward), so the gradient all-reduce moves 32 MiB a step (the communication
  dominates the step).

With ``--summary-out PATH``, at the end the other ranks shut TraceML down (their last steps
delivered), every rank meets at a barrier, and rank 0 writes ``traceml.summary()`` there as
JSON and logs it through TensorBoard's SummaryWriter into ``--tensorboard-dir`` when given.
"""

import argparse
import json
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset

import traceml

#: 20 ms, not 10: the balanced control's one small gradient all-reduce (8.7 KB, ~0.6 ms on a
#: quiet host) is a chain of cross-process wake-ups that a busy 2-core host stretches to 3-9 ms
#: on many steps, on both ranks at once (no peer wait: the transfer itself); with a 10 ms
#: forward its median reached 24 % of the step against COMM_BOUND_PCT = 25 %, and CI once read
#: the control COMM_BOUND. At 20 ms it stays at 2-5 % under the same load; the ``comm``
#: scenario keeps 34-35 % quiet (its test's wait check was steadier than at 48 MiB a step).
BASE_FORWARD_MS = 20.0
SCENARIOS = ("balanced", "input", "input_straggler", "compute_straggler", "residual", "comm")
#: The ``comm`` scenario's extra parameters (float32: 32 MiB of gradients a step).
COMM_PARAMS = 8 * 1024 * 1024


class Batches(Dataset):
    """Whole batches (DataLoader batch_size=None); ``delay_s`` of sleep per batch."""

    def __init__(self, n: int, delay_s: float) -> None:
        self.n, self.delay_s = n, delay_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if self.delay_s:
            time.sleep(self.delay_s)
        g = torch.Generator().manual_seed(i)
        return torch.randn(16, 32, generator=g), torch.randn(16, 1, generator=g)


class Model(nn.Module):
    def __init__(self, sleep_s: float, extra_params: int = 0) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
        self.sleep_s = sleep_s
        self.extra = nn.Parameter(torch.zeros(extra_params)) if extra_params else None

    def forward(self, x):
        time.sleep(self.sleep_s)
        if self.extra is not None:  # one element read: a whole (mostly zero) gradient, the
            x = x + self.extra[0]  # last one backward makes, so its all-reduce is exposed
        return self.net(x)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--scenario", choices=SCENARIOS, required=True)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--delay-ms", type=float, default=20.0)
    p.add_argument("--slow-rank", type=int, default=1)
    p.add_argument("--summary-out", default="")
    p.add_argument("--tensorboard-dir", default="")
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    traceml.init()
    delay = args.delay_ms / 1000.0
    slow = rank == args.slow_rank
    input_s = (
        delay if args.scenario == "input" or (args.scenario == "input_straggler" and slow) else 0.0
    )
    forward_s = BASE_FORWARD_MS / 1000.0 + (
        delay if args.scenario == "compute_straggler" and slow else 0.0
    )
    residual_s = delay if args.scenario == "residual" else 0.0

    torch.manual_seed(0)
    loader = DataLoader(Batches(args.steps, input_s), batch_size=None, shuffle=False)
    model = DDP(Model(forward_s, COMM_PARAMS if args.scenario == "comm" else 0))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = nn.MSELoss()
    for x, y in loader:
        with traceml.trace_step(model):
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(model(x), y)
            loss.backward()
            optimizer.step()
            if residual_s:
                time.sleep(residual_s)

    if args.summary_out:
        # docs/trackers.md's end-of-run order: the other ranks deliver their last steps before
        # rank 0 asks (rank 0's summary() flushes its own only; the verdict covers what is
        # stored, and on a loaded machine rank 1's last batches could still be on their way).
        if rank != 0:
            traceml.shutdown()
        dist.barrier()
        flat = traceml.summary()
        if rank == 0:
            with open(args.summary_out, "w") as f:
                json.dump(flat, f)
            if args.tensorboard_dir:
                from torch.utils.tensorboard import SummaryWriter

                with SummaryWriter(args.tensorboard_dir) as writer:
                    for name, value in flat.items():
                        if isinstance(value, (int, float)):
                            writer.add_scalar(name, value, global_step=args.steps)
                        else:
                            writer.add_text(name, value, global_step=args.steps)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
