"""Benchmark: what recording one collective costs the calling thread (µs per event).

A one-process gloo group (world size 1, so the collective itself is as cheap as it gets) calls
``dist.all_reduce`` on a one-element tensor ``--calls`` times per round, alternating rounds
between the original function and the recording wrapper (:mod:`traceml.sdk.collectives`, a
recorder installed on a step tracer, a step open so the call is a step's sync collective).
Each call is timed alone (``perf_counter_ns``); the printed figure is the median recorded
call minus the median original call, side by side with both medians and p99s.

Target: <= 5 µs per event (issue 27). Usage:
``python benchmarks/collective_events.py [--calls 20000] [--rounds 5]``.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from _common import free_port, median, p99

from traceml.sdk import collectives
from traceml.sdk.step import StepTracer

TARGET_US = 5.0
_now = time.perf_counter_ns


def _timed(fn, tensor, calls: int) -> list[int]:
    out = []
    for _ in range(calls):
        t0 = _now()
        fn(tensor)
        out.append(_now() - t0)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(free_port())
    dist.init_process_group("gloo", rank=0, world_size=1)
    original = dist.all_reduce
    tracer = StepTracer(lambda m: None, _now())
    collectives.install(tracer)
    recorded = dist.all_reduce
    tracer.open(_now())
    tensor = torch.ones(1)
    plain: list[int] = []
    traced: list[int] = []
    for _ in range(args.rounds):
        plain += _timed(original, tensor, args.calls)
        traced += _timed(recorded, tensor, args.calls)
        tracer.end()
        tracer.open(_now())
    print(f"all_reduce, world 1, {args.calls * args.rounds} calls each:")
    print(f"  original   median {median(plain) / 1e3:7.2f} µs   p99 {p99(plain) / 1e3:7.2f} µs")
    print(f"  recorded   median {median(traced) / 1e3:7.2f} µs   p99 {p99(traced) / 1e3:7.2f} µs")
    cost = (median(traced) - median(plain)) / 1e3
    print(f"cost per event: median {cost:.2f} µs (target <= {TARGET_US} µs)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
