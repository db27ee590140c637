"""A small gloo DDP job whose one rank fails on purpose, for the crash and hang tests.

Runs under ``traceml run`` or plain torchrun. Every rank trains ``--steps`` steps of a tiny
model (one all-reduce per step). Rank ``--fail-rank`` ends itself at the start of step
``--fail-step`` (so it and its peers completed exactly ``--fail-step`` steps), the way
``--fail`` says:

    segv      SIGSEGV sent to itself (a native crash)
    exit3     os._exit(3) (no Python shutdown, no atexit)
    sysexit7  sys.exit(7) (normal Python shutdown, exit code 7)
    raise     an uncaught RuntimeError
    hang      after all steps, sleeps forever instead of exiting (its peers exit normally)
    stall     in the forward of step ``--fail-step``, sleeps forever (its peers then wait in
              backward's all-reduce of that step: a hang inside training)
    outside   before step ``--fail-step`` (outside any step), sleeps forever; with
              ``--explicit-collective`` its peers then wait inside that step, in the
              all-reduce it never joins
    collective  with ``--collective-after-step``: after its ``--fail-step``-th step, sleeps
              forever (at the line marked ``# stopped before the collective``) instead of
              entering the all-reduce its peers then wait in
    none      no failure

``--step-sleep`` adds a planted sleep to every step (s), to make a run last without CPU work.
``--explicit-collective`` adds an all-reduce of one number at the start of every step, inside
the traced step and outside its phases (a metric synchronised by hand).
``--collective-after-step`` adds an all-reduce of one number after every step, outside the
traced step (between steps: a metric synchronised by hand).
``--ignore-sigterm`` makes every rank ignore SIGTERM (a rank stuck in I/O that torchrun cannot
stop in its grace period).
Rank 0 prints ``faulty_ddp: training`` once its first step begins. ``--step-log DIR`` makes
every rank append one line per completed step to ``DIR/rank<R>.log`` (``step <i> <end, Unix s>
<step body, s>``, by the script's own clock), written unbuffered as the last statement of the
step's ``with`` block: the script's own count of the steps it completed, whatever signal ends it.

Before a failure it waits ``--settle-sec`` (default 1.5 s) so that every rank's telemetry of
the completed steps is flushed (tests set ``TRACEML_FLUSH_INTERVAL_SEC`` well below that), then
writes the wall time of its death (Unix s) to ``--mark`` when given: the tests measure how long
the launcher takes to return after it.
"""

import argparse
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import traceml


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--fail-rank", type=int, default=1)
    p.add_argument("--fail-step", type=int, default=5)
    p.add_argument(
        "--fail",
        choices=(
            "segv",
            "exit3",
            "sysexit7",
            "raise",
            "hang",
            "stall",
            "outside",
            "collective",
            "none",
        ),
        default="none",
    )
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--settle-sec", type=float, default=1.5)
    p.add_argument("--mark", default="")
    p.add_argument("--ignore-sigterm", action="store_true")
    p.add_argument("--explicit-collective", action="store_true")
    p.add_argument("--collective-after-step", action="store_true")
    p.add_argument("--step-log", default="")
    return p.parse_args()


def die(rank: int, how: str, settle_s: float, mark: str) -> None:
    time.sleep(settle_s)
    if mark:
        with open(mark, "w") as f:
            f.write(f"{time.time():.3f}\n")
    print(f"faulty_ddp: rank {rank} fails now ({how})", file=sys.stderr, flush=True)
    if how == "segv":
        os.kill(os.getpid(), signal.SIGSEGV)
    elif how == "exit3":
        os._exit(3)
    elif how == "sysexit7":
        sys.exit(7)
    elif how == "raise":
        raise RuntimeError("injected failure")
    elif how == "hang":
        while True:
            time.sleep(3600)


class Stallable(nn.Linear):
    """A linear layer whose forward sleeps forever once ``stall`` is set."""

    stall = False

    def forward(self, x):
        while self.stall:
            time.sleep(3600)  # stalled in forward
        return super().forward(x)


def main() -> None:
    args = parse_args()
    if args.ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    traceml.init()
    failing = rank == args.fail_rank and args.fail != "none"

    torch.manual_seed(rank)
    layer = Stallable(16, 1)
    model = DDP(layer)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    step_log = None
    if args.step_log:
        step_log = os.open(
            os.path.join(args.step_log, f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND
        )
    for step in range(args.steps):
        if (
            failing
            and args.fail not in ("hang", "stall", "outside", "collective")
            and step == args.fail_step
        ):
            die(rank, args.fail, args.settle_sec, args.mark)
        if failing and args.fail == "stall" and step == args.fail_step:
            print(f"faulty_ddp: rank {rank} stalls in forward now", file=sys.stderr, flush=True)
            layer.stall = True
        if failing and args.fail == "outside" and step == args.fail_step:
            print(
                f"faulty_ddp: rank {rank} stops outside its step now", file=sys.stderr, flush=True
            )
            while True:
                time.sleep(3600)  # stopped outside its step
        if rank == 0 and step == 0:
            print("faulty_ddp: training", flush=True)
        began = time.perf_counter()
        with traceml.trace_step(model):
            time.sleep(args.step_sleep)
            if args.explicit_collective:
                dist.all_reduce(torch.ones(1))
            x = torch.randn(8, 16)
            optimizer.zero_grad()
            model(x).pow(2).mean().backward()
            optimizer.step()
            if step_log is not None:
                took = time.perf_counter() - began
                os.write(step_log, f"step {step} {time.time():.6f} {took:.6f}\n".encode())
        if failing and args.fail == "collective" and step + 1 == args.fail_step:
            print(
                f"faulty_ddp: rank {rank} stops before the collective now",
                file=sys.stderr,
                flush=True,
            )
            while True:
                time.sleep(3600)  # stopped before the collective
        if args.collective_after_step:
            dist.all_reduce(torch.ones(1))
    dist.destroy_process_group()
    if failing and args.fail == "hang":
        die(rank, "hang", args.settle_sec, args.mark)
    print(f"faulty_ddp: rank {rank} trained {args.steps} steps", flush=True)


if __name__ == "__main__":
    main()
