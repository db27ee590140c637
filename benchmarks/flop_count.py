"""Benchmark: what counting a step's FLOPs once costs, and what reading batch shapes costs.

1. **FLOPs count** — the one forward :class:`traceml.sdk.workload.FlopsCounter` runs under
   ``torch.utils.flop_counter.FlopCounterMode`` (step 1 of a rank), against the same forward
   uncounted, side by side, ``--repeats`` times each on fresh counters: the median of each
   (ms) and the added cost. The first count of a process also pays the first use of the
   dispatch machinery, which the medians leave out: a rank's ``count_ms`` shows it. Models: the
   3-layer MLP of tests/test_workload.py scaled up
   (``Linear(256, 1024)``, ``ReLU``, ``Linear(1024, 256)``, batch 64) and, when transformers is
   installed, a 2-layer BERT built from a config (hidden 128, 4 heads, batch 8 x 64 tokens).
2. **Batch shapes** — :func:`traceml.sdk.workload.batch_counts` on the batch kinds the
   DataLoader hook sees (a tensor, an ``(inputs, labels)`` tuple, an HF-style dict), µs per
   call (paid once per DataLoader batch, after the call's clock stopped).

Torch runs on one thread here (``torch.set_num_threads(1)``): on a shared machine its
intra-op threads fight over the cores and the forward's own time swamps what counting adds.
Usage: ``python benchmarks/flop_count.py [--repeats 15] [--calls 20000]``.
"""

from __future__ import annotations

import argparse
import time

import torch
from _common import median
from torch import nn

from traceml.sdk import workload
from traceml.sdk.step import StepTracer

_now = time.perf_counter_ns


def _models() -> list[tuple[str, nn.Module, tuple]]:
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256))
    out = [("mlp 256-1024-256, batch 64", mlp, (torch.randn(64, 256),))]
    try:
        from transformers import BertConfig, BertModel
    except ImportError:
        return out
    config = BertConfig(
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=512,
        vocab_size=1000,
    )
    out.append(
        (
            "bert 2 layers, hidden 128, 8 x 64 tokens",
            BertModel(config),
            (torch.randint(0, 1000, (8, 64)),),
        )
    )
    return out


def _counted_ms(model: nn.Module, args: tuple) -> tuple[float, int]:
    sent = []
    tracer = StepTracer(lambda m: None, _now())
    tracer.steps_completed = workload.COUNT_STEP
    tracer.flops_counter = workload.FlopsCounter(sent.append, None)
    start = _now()
    tracer.flops_counter.count(tracer, model, model.forward, args, {})
    return (_now() - start) / 1e6, sent[0].forward_flops


def _plain_ms(model: nn.Module, args: tuple) -> float:
    start = _now()
    model(*args)
    return (_now() - start) / 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--calls", type=int, default=20000)
    args = p.parse_args()
    torch.set_num_threads(1)
    print("FLOPs count (one forward under FlopCounterMode vs the same forward), ms medians")
    for name, model, inputs in _models():
        model(*inputs)  # warm-up: first-call costs are not the counter's
        counted, plain, flops = [], [], 0
        for _ in range(args.repeats):
            ms, flops = _counted_ms(model, inputs)
            counted.append(ms)
            plain.append(_plain_ms(model, inputs))
        c, u = median(counted), median(plain)
        print(
            f"  {name}: counted {c:.2f} ms, uncounted {u:.2f} ms, added {c - u:.2f} ms "
            f"once per rank; forward {flops:,} FLOPs"
        )
    batches = {
        "tensor (64, 256)": torch.randn(64, 256),
        "(inputs, labels)": (torch.randn(64, 256), torch.randn(64)),
        "dict input_ids (8, 64)": {
            "input_ids": torch.zeros(8, 64, dtype=torch.long),
            "attention_mask": torch.ones(8, 64),
        },
    }
    print("batch_counts per DataLoader batch, µs medians")
    for name, batch in batches.items():
        times = []
        for _ in range(args.calls):
            start = _now()
            workload.batch_counts(batch)
            times.append((_now() - start) / 1e3)
        print(f"  {name}: {median(times):.2f} µs")


if __name__ == "__main__":
    main()
