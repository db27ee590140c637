"""Benchmark (a): what ``trace_step`` with automatic phases adds to one training step (µs).

A tiny model (``Linear(16, 16)``, batch 8, SGD) fed by a real DataLoader, so every automatic
hook runs: DataLoader ``__next__``, forward (module hooks), backward, optimizer step. With the
SDK on, it streams to a real aggregator, so its sender thread's work (conversion, gRPC)
competes for the GIL as it does in training.

Variants of the same iteration (next batch + step):

* ``plain``: a process that never calls ``traceml.init()`` (no hook anywhere);
* ``hooks``: after ``init()``, without ``trace_step`` (the hooks pass through);
* ``traced``: ``with traceml.trace_step(model):`` around the step.

``plain`` and the SDK process alternate (``--rounds`` each); inside the SDK process ``hooks``
and ``traced`` alternate in blocks. Each iteration is timed on the wall clock and on the
training thread's CPU clock (``thread_time_ns``). A busy machine only ever adds time, so each
variant's figure is the minimum over its blocks of the block median (the least disturbed
block), and the p99 is that of the least disturbed round. µs added = traced − plain.
An empty step body isolates the context manager, the step record and the buffer append.

Target: <= 15 µs. Usage: ``python benchmarks/hot_path.py [--rounds 3] [--blocks 20]``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import LiveAggregator, median, p99

BLOCK_STEPS = 250


class Loop:
    """The training loop under test."""

    def __init__(self) -> None:
        import torch
        from torch import nn
        from torch.utils.data import DataLoader, TensorDataset

        torch.manual_seed(0)
        torch.set_num_threads(1)
        data = TensorDataset(torch.randn(4096, 16), torch.randn(4096, 16))
        self.loader = DataLoader(data, batch_size=8, shuffle=True)
        self.model = nn.Linear(16, 16)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01)
        self.loss = nn.functional.mse_loss
        self.it = iter(self.loader)

    def _next(self):
        try:
            return next(self.it)
        except StopIteration:
            self.it = iter(self.loader)
            return next(self.it)

    def _body(self, x, y) -> None:
        loss = self.loss(self.model(x), y)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()

    def block(self, traced: bool) -> tuple[list[int], list[int]]:
        """Wall ns and thread-CPU ns of each of BLOCK_STEPS iterations."""
        import traceml

        wall, cpu = [], []
        for _ in range(BLOCK_STEPS):
            w, c = time.perf_counter_ns(), time.thread_time_ns()
            x, y = self._next()
            if traced:
                with traceml.trace_step(self.model):
                    self._body(x, y)
            else:
                self._body(x, y)
            wall.append(time.perf_counter_ns() - w)
            cpu.append(time.thread_time_ns() - c)
        return wall, cpu


def empty_steps(steps: int) -> list[int]:
    """Per-iteration wall ns of ``with trace_step(model): pass`` (the SDK's fixed cost)."""
    from torch import nn

    import traceml

    model = nn.Linear(1, 1)
    times = []
    for _ in range(steps):
        start = time.perf_counter_ns()
        with traceml.trace_step(model):
            pass
        times.append(time.perf_counter_ns() - start)
    return times


def measure(mode: str, blocks: int) -> dict:
    """One round in this process: ``mode`` is "plain" or "sdk"; figures in ns."""
    loop = Loop()
    for _ in range(4):
        loop.block(traced=False)  # warm-up
    variants = ("plain",) if mode == "plain" else ("hooks", "traced")
    out: dict = {v: {"block_wall": [], "block_cpu": [], "wall": [], "cpu": []} for v in variants}
    agg = None
    if mode == "sdk":
        import traceml

        agg = LiveAggregator(Path(tempfile.mkdtemp()) / "run", "hot-path").start()
        assert traceml.init(aggregator=agg.target, run_name=agg.run_name)
        for _ in range(4):
            loop.block(traced=True)  # warm-up: first batches sent, grpc imported
    for _ in range(blocks):
        for v in variants:
            wall, cpu = loop.block(traced=v == "traced")
            out[v]["block_wall"].append(median(wall))
            out[v]["block_cpu"].append(median(cpu))
            out[v]["wall"] += wall
            out[v]["cpu"] += cpu
    for v in variants:
        out[v]["p99_wall"] = p99(out[v].pop("wall"))
        out[v]["p99_cpu"] = p99(out[v].pop("cpu"))
    if agg is not None:
        out["empty"] = empty_steps(blocks * BLOCK_STEPS)
        traceml.shutdown()
        agg.stop()
        out["stored"] = agg.query("SELECT COUNT(*) FROM steps")[0][0]
    return out


def us(ns: float) -> float:
    return ns / 1000.0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3, help="plain and SDK processes, each")
    parser.add_argument("--blocks", type=int, default=20, help=f"blocks of {BLOCK_STEPS} steps")
    parser.add_argument("--child", choices=("plain", "sdk"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        json.dump(measure(args.child, args.blocks), sys.stdout)
        return

    rounds: dict[str, list[dict]] = {"plain": [], "sdk": []}
    for _ in range(args.rounds):
        for mode in ("plain", "sdk"):
            out = subprocess.run(
                [sys.executable, __file__, "--child", mode, "--blocks", str(args.blocks)],
                capture_output=True, text=True, check=True,
            ).stdout
            rounds[mode].append(json.loads(out))
    per_variant = {
        "plain": [r["plain"] for r in rounds["plain"]],
        "hooks": [r["hooks"] for r in rounds["sdk"]],
        "traced": [r["traced"] for r in rounds["sdk"]],
    }

    def best(variant: str, key: str) -> float:
        """The least disturbed block median of ``variant`` (ns)."""
        return min(min(r[key]) for r in per_variant[variant])

    def best_p99(variant: str, key: str) -> float:
        """The p99 of ``variant``'s least disturbed round (ns)."""
        return min(r[key] for r in per_variant[variant])

    steps = args.rounds * args.blocks * BLOCK_STEPS
    print(f"(a) trace_step hot path, tiny model, {steps} steps per variant in {args.rounds} rounds "
          "(target <= 15 µs)")
    print("    variant   wall median   wall p99   cpu median   cpu p99   (µs; least disturbed)")
    for v in ("plain", "hooks", "traced"):
        print(f"    {v:<8} {us(best(v, 'block_wall')):>12.1f} {us(best_p99(v, 'p99_wall')):>10.1f} "
              f"{us(best(v, 'block_cpu')):>12.1f} {us(best_p99(v, 'p99_cpu')):>9.1f}")
    for clock, key, pkey in (("wall", "block_wall", "p99_wall"), ("cpu", "block_cpu", "p99_cpu")):
        added = best("traced", key) - best("plain", key)
        passthrough = best("hooks", key) - best("plain", key)
        print(f"  added by trace_step ({clock}): median {us(added):.1f} µs, p99 "
              f"{us(best_p99('traced', pkey) - best_p99('plain', pkey)):.1f} µs "
              f"(hooks passing through: {us(passthrough):.1f} µs)")
    empty = [t for r in rounds["sdk"] for t in r["empty"]]
    print(f"  empty step body (context + record + buffer): median {us(median(empty)):.2f} µs, "
          f"p99 {us(p99(empty)):.2f} µs")
    print(f"  steps stored by the aggregator per SDK round: {[r['stored'] for r in rounds['sdk']]}")


if __name__ == "__main__":
    main()
