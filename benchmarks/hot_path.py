"""Benchmark (a): what ``trace_step`` with automatic phases adds to one training step (µs).

A tiny model (``Linear(16, 16)``, batch 8, SGD) fed by a real DataLoader, so every automatic
hook runs: DataLoader ``__next__``, forward (module hooks), backward, optimizer step. The SDK
streams to a real aggregator on the side, so its sender thread's work (conversion, gRPC)
competes for the GIL as it does in training.

Three variants of the same iteration (next batch + step), interleaved step by step in
rotating order, so that machine noise and drift hit them alike:

* ``plain``: TraceML's hooks taken out (as before ``traceml.init()``);
* ``hooks``: hooks in place but no step open (they pass through);
* ``traced``: ``with traceml.trace_step(model):`` around the step.

Each iteration is timed on the wall clock (``perf_counter_ns``) and on the training thread's
CPU clock (``thread_time_ns``, which a busy machine disturbs less). µs added = traced − plain:
the median of the per-triplet differences, and the difference of the p99s. An empty step body
isolates the context manager, the step record and the buffer append.
Target: <= 15 µs. Usage: ``python benchmarks/hot_path.py [--steps 20000]``.
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
import time
from pathlib import Path

import torch
import torch.optim.optimizer as torch_optimizer
from _common import LiveAggregator, median, p99
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.dataloader import _BaseDataLoaderIter

import traceml
from traceml.sdk import instrumentation

VARIANTS = ("plain", "hooks", "traced")


class Loop:
    """The training loop under test; :meth:`step` runs and times one iteration."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        torch.set_num_threads(1)
        data = TensorDataset(torch.randn(4096, 16), torch.randn(4096, 16))
        self.loader = DataLoader(data, batch_size=8, shuffle=True)
        self.model = nn.Linear(16, 16)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01)
        self.it = iter(self.loader)

    def _next(self):
        try:
            return next(self.it)
        except StopIteration:
            self.it = iter(self.loader)
            return next(self.it)

    def _body(self, x, y) -> None:
        loss = nn.functional.mse_loss(self.model(x), y)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()

    def step(self, traced: bool) -> tuple[int, int]:
        """(wall ns, thread CPU ns) of one iteration."""
        wall, cpu = time.perf_counter_ns(), time.thread_time_ns()
        x, y = self._next()
        if traced:
            with traceml.trace_step(self.model):
                self._body(x, y)
        else:
            self._body(x, y)
        return time.perf_counter_ns() - wall, time.thread_time_ns() - cpu


@contextlib.contextmanager
def hooks_removed(model: nn.Module):
    """Take TraceML's hooks out of torch for the block (benchmark only: private torch state)."""
    saved_backward = torch.autograd.backward
    saved_next = _BaseDataLoaderIter.__next__
    torch.autograd.backward = saved_backward.__traceml_original__
    _BaseDataLoaderIter.__next__ = saved_next.__traceml_original__
    stores = (
        (torch_optimizer._global_optimizer_pre_hooks, instrumentation._optimizer_pre),
        (torch_optimizer._global_optimizer_post_hooks, instrumentation._optimizer_post),
        (model._forward_pre_hooks, instrumentation._forward_pre),
        (model._forward_hooks, instrumentation._forward_post),
    )
    taken = [
        (store, {k: v for k, v in store.items() if v is fn}) for store, fn in stores
    ]
    for store, items in taken:
        for k in items:
            del store[k]
    try:
        yield
    finally:
        torch.autograd.backward = saved_backward
        _BaseDataLoaderIter.__next__ = saved_next
        for store, items in taken:
            store.update(items)


def run(loop: Loop, steps: int) -> dict[str, list[tuple[int, int]]]:
    """``steps`` triplets, each variant once per triplet, order rotating."""
    out: dict[str, list[tuple[int, int]]] = {v: [] for v in VARIANTS}
    for i in range(steps):
        for k in range(3):
            variant = VARIANTS[(i + k) % 3]
            if variant == "plain":
                with hooks_removed(loop.model):
                    out[variant].append(loop.step(traced=False))
            else:
                out[variant].append(loop.step(traced=variant == "traced"))
    return out


def empty_steps(steps: int) -> list[int]:
    """Per-iteration wall ns of ``with trace_step(model): pass`` (the SDK's fixed cost)."""
    model = nn.Linear(1, 1)
    times = []
    for _ in range(steps):
        start = time.perf_counter_ns()
        with traceml.trace_step(model):
            pass
        times.append(time.perf_counter_ns() - start)
    return times


def us(ns: float) -> float:
    return ns / 1000.0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20000, help="triplets")
    args = parser.parse_args()
    loop = Loop()
    with tempfile.TemporaryDirectory() as tmp:
        agg = LiveAggregator(Path(tmp) / "run", "hot-path").start()
        assert traceml.init(aggregator=agg.target, run_name=agg.run_name)
        run(loop, 1000)  # warm-up: first batches sent, grpc imported
        result = run(loop, args.steps)
        empty = empty_steps(args.steps)
        traceml.shutdown()
        agg.stop()
        stored = agg.query("SELECT COUNT(*) FROM steps")[0][0]

    print(f"(a) trace_step hot path, tiny model, {args.steps} interleaved steps per variant "
          "(target <= 15 µs)")
    print("    variant     wall median   wall p99   cpu median   cpu p99   (µs)")
    for v in VARIANTS:
        wall = [w for w, _ in result[v]]
        cpu = [c for _, c in result[v]]
        print(f"    {v:<10} {us(median(wall)):>12.1f} {us(p99(wall)):>10.1f} "
              f"{us(median(cpu)):>12.1f} {us(p99(cpu)):>9.1f}")
    for label, clock in (("wall", 0), ("cpu", 1)):
        plain = [s[clock] for s in result["plain"]]
        for other in ("hooks", "traced"):
            series = [s[clock] for s in result[other]]
            diffs = [a - b for a, b in zip(series, plain)]
            print(f"  {other} - plain ({label}): median of differences {us(median(diffs)):.1f} µs, "
                  f"p99 difference {us(p99(series) - p99(plain)):.1f} µs")
    print(f"  empty step body (context + record + buffer): median {us(median(empty)):.2f} µs, "
          f"p99 {us(p99(empty)):.2f} µs")
    print(f"  steps stored by the aggregator: {stored}")


if __name__ == "__main__":
    main()
