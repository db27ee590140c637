"""Benchmark (a): what ``trace_step`` with automatic phases adds to one training step (µs).

The SDK streams to a real aggregator, so its sender thread's work (conversion, gRPC) competes
for the GIL as it does in training. Two measurements:

1. **Per component** — each piece of work the SDK adds to a step, called ``--calls`` times
   and timed call by call (``perf_counter_ns``, the timer's own cost subtracted): the step
   context (``trace_step()``, open, close, the step record, the buffer append), the forward
   timer (the traced model's call, against an identical model that is never traced), the
   backward wrapper, the optimizer step hooks, the DataLoader ``__next__`` wrapper. Their
   sum is the µs added per step: the sum of the medians, and the sum of the p99s (an upper
   bound of the p99 of the sum). The same with no step open gives what the installed hooks
   cost a step that is not traced.
2. **End to end** — a tiny model (``Linear(16, 16)``, batch 8, SGD) fed by a real DataLoader,
   iterations alternating step by step between ``with trace_step(model):`` and no
   ``trace_step`` (hooks passing through): per-step medians and p99s, and the median of the
   paired differences. On a busy machine this one is noisy (tens of µs), the per-component
   one much less so.

Target: <= 15 µs. Usage: ``python benchmarks/hot_path.py [--calls 20000] [--steps 10000]``.
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
import time
from pathlib import Path

import torch
from _common import LiveAggregator, median, p99
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import traceml
from traceml.sdk import instrumentation, rank_state

_now = time.perf_counter_ns


def per_call_ns(fn, calls: int, baseline=None) -> list[float]:
    """Wall ns of each of ``calls`` calls of ``fn`` minus, call by call, that of ``baseline``
    (alternating with it, so a busy moment hits both; an empty function by default)."""

    def empty():
        pass

    baseline = baseline or empty
    out = []
    for i in range(2 * calls):  # the first half warms up
        start = _now()
        fn()
        middle = _now()
        baseline()
        end = _now()
        if i >= calls:
            out.append((middle - start) - (end - middle))
    return out


def components(model: nn.Module, calls: int, in_step: bool) -> dict[str, list[float]]:
    """Per-call ns of each piece of SDK work, with a step open (``in_step``) or not."""
    x = torch.randn(8, 16)
    bare = nn.Linear(16, 16)  # the same module, never traced
    bare.load_state_dict(model.state_dict())

    def noop(*args, **kwargs):
        return None

    backward = instrumentation._timed_backward(noop)
    next_ = instrumentation._timed_next(noop)

    def traced_forward():
        model(x)

    def bare_forward():
        bare(x)

    def optimizer_hooks():  # what torch's Optimizer.step calls for the global hooks
        instrumentation._optimizer_pre(None, (), {})
        instrumentation._optimizer_post(None, (), {})

    out: dict[str, list[float]] = {}
    if in_step:

        def step_context():
            with traceml.trace_step(model):
                pass

        out["step context"] = per_call_ns(step_context, calls)
        rank_state.current().client.flush(60)  # the sender is idle again: no GIL contention
    step = traceml.trace_step(model) if in_step else contextlib.nullcontext()
    with step, torch.no_grad():
        out["forward timer"] = per_call_ns(traced_forward, calls, baseline=bare_forward)
        out["backward wrapper"] = per_call_ns(backward, calls)
        out["optimizer hooks"] = per_call_ns(optimizer_hooks, calls)
    out["DataLoader next"] = per_call_ns(lambda: next_(None), calls)
    return out


class Loop:
    """The tiny training loop of the end-to-end measurement."""

    def __init__(self) -> None:
        data = TensorDataset(torch.randn(4096, 16), torch.randn(4096, 16))
        self.loader = DataLoader(data, batch_size=8, shuffle=True)
        self.model = nn.Linear(16, 16)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01)
        self.it = iter(self.loader)

    def step(self, traced: bool) -> int:
        start = _now()
        try:
            x, y = next(self.it)
        except StopIteration:
            self.it = iter(self.loader)
            x, y = next(self.it)
        if traced:
            with traceml.trace_step(self.model):
                self._body(x, y)
        else:
            self._body(x, y)
        return _now() - start

    def _body(self, x, y) -> None:
        loss = nn.functional.mse_loss(self.model(x), y)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()


def us(ns: float) -> float:
    return ns / 1000.0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--steps", type=int, default=10000)
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp, LiveAggregator(Path(tmp) / "run", "hot") as agg:
        assert traceml.init(aggregator=agg.target, run_name=agg.run_name)
        loop = Loop()
        for _ in range(1000):  # warm-up: hooks installed, first batches sent
            loop.step(traced=True)
        client = rank_state.current().client
        client.flush(60)
        sender_clock = time.pthread_getcpuclockid(client._thread.ident)  # benchmark only
        sender_cpu, acked = time.clock_gettime_ns(sender_clock), client.stats.acked
        traced_parts = components(loop.model, args.calls, in_step=True)
        idle_parts = components(loop.model, args.calls, in_step=False)
        traced, untraced = [], []
        for i in range(args.steps):
            for traced_first in (True, False) if i % 2 else (False, True):
                (traced if traced_first else untraced).append(loop.step(traced_first))
        client.flush(60)
        sender_ns = (time.clock_gettime_ns(sender_clock) - sender_cpu) / (
            client.stats.acked - acked
        )
        traceml.shutdown()
        agg.stop()

    print("(a) trace_step hot path (target <= 15 µs added per step)")
    print(
        f"  per component, {args.calls} calls each (µs):   traced step: median    p99"
        "   | untraced step: median    p99"
    )
    for name in traced_parts:
        idle = idle_parts.get(name)
        idle_text = f"{us(median(idle)):>8.2f} {us(p99(idle)):>6.2f}" if idle else "       -      -"
        print(
            f"    {name:<38} {us(median(traced_parts[name])):>8.2f} "
            f"{us(p99(traced_parts[name])):>6.2f}   | {idle_text}"
        )
    print(f"    {'sender thread, per record (CPU)':<38} {us(sender_ns):>8.2f}")
    print(
        f"  added per traced step, training thread: median "
        f"{us(sum(median(v) for v in traced_parts.values())):.1f} µs, p99 <= "
        f"{us(sum(p99(v) for v in traced_parts.values())):.1f} µs; plus the sender thread's "
        f"{us(sender_ns):.1f} µs of CPU (under the same GIL)"
    )
    print(
        f"  per untraced step (hooks passing through): "
        f"{us(sum(median(v) for v in idle_parts.values())):.1f} µs"
    )
    diffs = [a - b for a, b in zip(traced, untraced, strict=True)]
    print(
        f"  end to end, tiny model, {args.steps} steps each, interleaved: traced median "
        f"{us(median(traced)):.1f} µs p99 {us(p99(traced)):.1f} µs; untraced median "
        f"{us(median(untraced)):.1f} µs p99 {us(p99(untraced)):.1f} µs; "
        f"median of differences {us(median(diffs)):.1f} µs"
    )


if __name__ == "__main__":
    main()
