"""A small real DDP job (gloo, CPU) with patterns real jobs have, for the diagnosis-truth tests.

Every rank sleeps ``--forward-ms`` inside the model's forward (stable compute). Then, by
``--scenario``:

* ``eval`` — every EVAL_EVERY steps, every rank runs an evaluation pass between two steps
  (outside ``trace_step``): a validation DataLoader of EVAL_BATCHES batches, each sleeping
  EVAL_BATCH_MS in the model;
* ``checkpoint`` — every CKPT_EVERY steps rank 0 saves a checkpoint inside the step
  (``torch.save`` plus a CKPT_MS sleep standing for a slow filesystem);
* ``late_straggler`` — from step ``--onset`` on, rank 1's forward sleeps LATE_MS more;
* ``grad_accum`` — one step is one optimizer step over ACCUM micro-batches, each fetched from
  the DataLoader inside the step and sleeping ACCUM_FETCH_MS in the dataset;
* ``warmup`` — the first WARMUP_SLOW steps are slow: WARMUP_FORWARD_MS more in forward and
  WARMUP_FETCH_MS more per batch in the dataset. ``--slowdown-pct P`` (a planted regression
  for ``traceml compare``) makes every step after the warm-up P % slower than this run's own
  median step so far (measured with the script's clock), by a sleep inside the step.

Each rank writes what it timed with its own clock (ms) to ``--clock-out``/rank<r>.json.
"""

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset

import traceml

SCENARIOS = ("eval", "checkpoint", "late_straggler", "grad_accum", "warmup")
EVAL_EVERY, EVAL_BATCHES, EVAL_BATCH_MS = 10, 4, 200.0
CKPT_EVERY, CKPT_MS = 10, 300.0
LATE_MS = 60.0
ACCUM, ACCUM_FETCH_MS = 4, 20.0
WARMUP_SLOW, WARMUP_FORWARD_MS, WARMUP_FETCH_MS = 10, 400.0, 200.0


class Batches(Dataset):
    """Whole batches (DataLoader batch_size=None); ``delay_ms(i)`` of sleep for batch i."""

    def __init__(self, n: int, delay_ms) -> None:
        self.n, self.delay_ms = n, delay_ms

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        delay = self.delay_ms(i)
        if delay:
            time.sleep(delay / 1000.0)
        g = torch.Generator().manual_seed(i)
        return torch.randn(16, 32, generator=g), torch.randn(16, 1, generator=g)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
        self.sleep_ms = 0.0

    def forward(self, x):
        time.sleep(self.sleep_ms / 1000.0)
        return self.net(x)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--scenario", choices=SCENARIOS, required=True)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--forward-ms", type=float, default=40.0)
    p.add_argument("--onset", type=int, default=25)
    p.add_argument("--slowdown-pct", type=float, default=0.0)
    p.add_argument("--clock-out", required=True)
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    traceml.init()
    sc = args.scenario
    micro = ACCUM if sc == "grad_accum" else 1

    def fetch_ms(i: int) -> float:
        if sc == "grad_accum":
            return ACCUM_FETCH_MS
        if sc == "warmup" and i < WARMUP_SLOW:
            return WARMUP_FETCH_MS
        return 0.0

    torch.manual_seed(0)
    loader = DataLoader(Batches(args.steps * micro, fetch_ms), batch_size=None, shuffle=False)
    val_loader = DataLoader(Batches(EVAL_BATCHES, lambda i: 0.0), batch_size=None)
    net = Model()
    model = DDP(net)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = nn.MSELoss()
    clock = {"eval_ms": [], "checkpoint_ms": [], "fetch_ms": [], "step_ms": [], "steps": 0}
    # under the test's directory, removed with it
    ckpt_path = os.path.join(args.clock_out, f"ckpt{rank}.pt")
    it = iter(loader)
    for step in range(args.steps):
        base = args.forward_ms
        extra_ms = 0.0
        if args.slowdown_pct and step > WARMUP_SLOW:
            own = sorted(clock["step_ms"][WARMUP_SLOW:])
            extra_ms = own[len(own) // 2] * args.slowdown_pct / 100.0
        if sc == "warmup" and step < WARMUP_SLOW:
            base += WARMUP_FORWARD_MS
        if sc == "late_straggler" and rank == 1 and step >= args.onset:
            base += LATE_MS
        net.sleep_ms = base
        t_step = time.perf_counter()
        with traceml.trace_step(model):
            optimizer.zero_grad(set_to_none=True)
            for k in range(micro):
                t0 = time.perf_counter()
                x, y = next(it)
                clock["fetch_ms"].append((time.perf_counter() - t0) * 1000.0)
                if k < micro - 1:
                    with model.no_sync():
                        loss_fn(model(x), y).backward()
                else:
                    loss_fn(model(x), y).backward()
            optimizer.step()
            if sc == "checkpoint" and rank == 0 and step % CKPT_EVERY == CKPT_EVERY - 1:
                t0 = time.perf_counter()
                torch.save(net.state_dict(), ckpt_path)
                time.sleep(CKPT_MS / 1000.0)
                clock["checkpoint_ms"].append((time.perf_counter() - t0) * 1000.0)
            if extra_ms:
                time.sleep(extra_ms / 1000.0)
        # the step as planted, without the planted slowdown
        clock["step_ms"].append((time.perf_counter() - t_step) * 1000.0 - extra_ms)
        clock["steps"] += 1
        if sc == "eval" and step % EVAL_EVERY == EVAL_EVERY - 1:
            t0 = time.perf_counter()
            net.sleep_ms = EVAL_BATCH_MS
            with torch.no_grad():
                for x, _ in val_loader:
                    net(x)
            clock["eval_ms"].append((time.perf_counter() - t0) * 1000.0)
    with open(os.path.join(args.clock_out, f"rank{rank}.json"), "w") as f:
        json.dump(clock, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
