"""Work done by a step: samples and tokens of its batches, and model FLOPs counted once.

Throughput (the ``samples`` and ``tokens`` step fields). Each batch a DataLoader iterator
yields is looked at by :func:`batch_counts` in the SDK's ``__next__`` hook
(:mod:`traceml.sdk.instrumentation`), after the clock of the call stopped: only shapes and
dtypes are read, nothing is copied, synchronised or moved. A step's samples and tokens are
those of the batches its input wait and body fetched (the batches the DataLoader-next figure
covers: :mod:`traceml.sdk.step`), so with gradient accumulation a step counts every
micro-batch.

* samples: the leading dimension of the batch's *lead tensor*: the tensor itself; for a
  mapping (a dict, HF's ``BatchEncoding``), its ``input_ids`` entry, else its first tensor
  value; for a tuple or list (``(inputs, labels)``), its first tensor element, looked for one
  level deep. A batch without a tensor there has no count (absent, never 0).
* tokens: the lead tensor's elements (batch × sequence length) when it holds token ids: an
  integer tensor of two or more dimensions. Padding is counted (reading ``attention_mask``
  would read data, not a shape).

Model FLOPs (the ``flops`` step field and one :class:`~traceml.wire.FlopsCount` per rank).
:class:`FlopsCounter` runs ``torch.utils.flop_counter.FlopCounterMode`` around **one** call of
the traced (root) model's forward: the first training forward (autograd on) of step
:data:`COUNT_STEP`. Every later step's model FLOPs are ``3 ×`` that forward's FLOPs × the
step's training forwards (:data:`traceml.sdk.step.FWD_BWD_FACTOR`: backward costs twice the
forward, the convention of model FLOPs utilisation, Chowdhery et al. 2022, "PaLM",
appendix B; activation recomputation is not counted, so the figure is MFU, not hardware
FLOPs utilisation). Why the
forward alone: the backward runs partly in autograd's own threads and over engine-made ops
(its count would depend on which inputs need gradients and on recomputation), while the
forward is one call on the training thread that the forward hook already wraps. Forwards under
``torch.no_grad`` (evaluation) add no FLOPs.

Cost: the counted forward runs with a Python dispatch mode on every op (and torch's module
tracker on every module): on the loaded 2-core test machine, one thread, +20 ms for an MLP
256-1024-256 on 64 samples (47 against 27 ms) and +232 ms for a 2-layer BERT on 8 x 64
tokens (423 against 191 ms; ``benchmarks/flop_count.py``, counter already warm). A rank's one
count also pays the first use of the dispatch machinery in its process: ``count_ms`` was
30-550 ms in the 2-rank test runs of tests/test_frameworks.py (an MLP of 8.7 kFLOPs: 30-320
ms; a 1-layer GPT-2: 260-550 ms). Paid once per rank, in step 1,
which the analysis leaves out as warm-up (5 steps) on any run of 15 steps or more; its wall
time is sent (``count_us``) and shown in the summary (``count_ms``).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Mapping

import torch

from traceml.sdk.failopen import fail_open

_now_ns = time.perf_counter_ns

#: ``Batch`` field the rank's FLOPs count travels in (a record kind of the telemetry client).
FLOPS_COUNTS = "flops_counts"
#: The step whose first training forward is counted (0-based): step 0 often holds lazy
#: initialisation and compilation, and a zero-code rank's step 0 may not see its forward.
COUNT_STEP = 1
#: Mapping keys whose value is the lead tensor (token ids, HF's name).
LEAD_KEYS = ("input_ids",)

_DTYPES = {
    torch.float32: "fp32",
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float64: "fp64",
}


def batch_counts(batch) -> tuple[int | None, int | None]:
    """``(samples, tokens)`` of one DataLoader batch, from shapes alone (see the module
    docstring); None for what cannot be told. Never raises on an unknown batch type."""
    lead = _lead_tensor(batch, 2)
    if lead is None or lead.dim() == 0:
        return None, None
    samples = lead.shape[0]
    if (
        lead.dim() >= 2
        and not lead.is_floating_point()
        and not lead.is_complex()
        and (lead.dtype is not torch.bool)
    ):
        return samples, lead.numel()
    return samples, None


def _lead_tensor(batch, depth: int):
    if isinstance(batch, torch.Tensor):
        return batch
    if depth == 0:
        return None
    if isinstance(batch, Mapping):
        for key in LEAD_KEYS:
            value = batch.get(key)
            if isinstance(value, torch.Tensor):
                return value
        values = batch.values()
    elif isinstance(batch, (tuple, list)):
        values = batch
    else:
        return None
    for value in values:
        lead = _lead_tensor(value, depth - 1)
        if lead is not None:
            return lead
    return None


def fsdp_param_dtype(model):
    """The dtype FSDP computes ``model``'s forward in, where FSDP states one: the
    ``param_dtype`` of FSDP1's ``MixedPrecision`` or FSDP2's ``MixedPrecisionPolicy``, of
    ``model`` or its first FSDP submodule; None without FSDP mixed precision. Under it the
    parameters read fp32 between forwards and no autocast is active, so neither tells the
    compute dtype. Walks the modules once (the count runs once per rank); a script that never
    imported FSDP has none, and FSDP is not imported for it."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    if fsdp is None:
        return None
    fsdp1 = getattr(fsdp, "FullyShardedDataParallel", None)
    fsdp2 = getattr(fsdp, "FSDPModule", None)
    for module in model.modules():
        if fsdp1 is not None and isinstance(module, fsdp1):
            policy = getattr(module, "mixed_precision", None)
        elif fsdp2 is not None and isinstance(module, fsdp2):
            policy = getattr(module._get_fsdp_state(), "_mp_policy", None)
        else:
            continue
        return getattr(policy, "param_dtype", None)
    return None


def compute_dtype(model) -> tuple[str, str]:
    """``(dtype, device name)`` of a forward of ``model`` starting now: the autocast dtype
    when autocast is on for the model's device, else FSDP's mixed-precision ``param_dtype``
    (:func:`fsdp_param_dtype`), else its first floating-point parameter's (fp32 reads ``tf32``
    on CUDA when float32 matmul precision allows TensorFloat-32); the device name is
    ``torch.cuda.get_device_name()`` for a CUDA model, else its device type (``cpu``).
    ``("", "")`` for a model without parameters."""
    param = next((p for p in model.parameters() if p.is_floating_point()), None)
    if param is None:
        return "", ""
    device = param.device
    if torch.is_autocast_enabled(device.type):
        dtype = torch.get_autocast_dtype(device.type)
    else:
        dtype = fsdp_param_dtype(model) or param.dtype
    name = _DTYPES.get(dtype, str(dtype).removeprefix("torch."))
    if device.type == "cuda":
        if name == "fp32" and torch.get_float32_matmul_precision() != "highest":
            name = "tf32"
        return name, torch.cuda.get_device_name(device)
    return name, device.type


class FlopsCounter:
    """Counts one training forward's FLOPs, once per rank (the tracer's ``flops_counter``).

    Args:
        submit: called once with the :class:`~traceml.wire.FlopsCount` (the client's submit
            of :data:`FLOPS_COUNTS`).
        peak_tflops: the user's peak (``--peak-tflops``), None when not given.
    """

    __slots__ = ("_submit", "_peak_tflops")

    def __init__(self, submit: Callable[[object], None], peak_tflops: float | None) -> None:
        self._submit = submit
        self._peak_tflops = peak_tflops

    def count(self, tracer, model, forward, args, kwargs):
        """Call ``forward(*args, **kwargs)`` under ``FlopCounterMode`` and return its result;
        the tracer's ``flops_counter`` is cleared first, so this runs once, and its
        ``forward_flops`` is set (the FLOPs of every later training forward). An error of the
        counting is one warning (the forward runs uncounted or its result stands); an error of
        the forward is the script's, raised as it is."""
        tracer.flops_counter = None
        step = tracer.steps_completed
        try:
            from torch.utils.flop_counter import FlopCounterMode

            dtype, device_name = compute_dtype(model)
            mode = FlopCounterMode(display=False)
            mode.__enter__()
        except Exception as exc:
            fail_open("FLOPs count", exc)
            return forward(*args, **kwargs)
        start = _now_ns()
        done = False
        try:
            out = forward(*args, **kwargs)
            done = True
            return out
        finally:
            elapsed_ns = _now_ns() - start
            try:
                mode.__exit__(None, None, None)
                if done:
                    self._counted(
                        tracer, int(mode.get_total_flops()), step, elapsed_ns, dtype, device_name
                    )
            except Exception as exc:
                fail_open("FLOPs count", exc)

    def _counted(
        self, tracer, flops: int, step: int, elapsed_ns: int, dtype: str, device_name: str
    ) -> None:
        from traceml import wire

        if flops <= 0:  # no matmul or convolution FlopCounterMode knows: nothing to report
            return
        tracer.forward_flops = flops
        self._submit(
            wire.FlopsCount(
                step=step,
                forward_flops=flops,
                count_us=elapsed_ns // 1000,
                dtype=dtype,
                device_name=device_name,
                peak_tflops=self._peak_tflops or 0.0,
            )
        )
