"""Peak dense TFLOPS of a GPU model for a matmul dtype: the denominator of MFU.

Every figure is the vendor's **dense** peak (no structured sparsity): NVIDIA's datasheets print
the tensor-core figures "with sparsity", twice the dense ones, and say so in a footnote; the
numbers here are those halved, or the dense figure where the datasheet gives it. Sources
(docs/reading-output.md, "MFU", lists them with links): NVIDIA V100, T4, A100, A10, L4, L40S,
H100 and H200 datasheets. A GPU or dtype not listed, a MIG slice (a share of the GPU whose
peak the table cannot know) and a CPU have no peak: MFU is then ``null`` unless the user
gives one (``traceml run --peak-tflops``, ``TRACEML_PEAK_TFLOPS``).

Neutral code, no imports beyond the standard library: the analysis looks peaks up with
:func:`lookup` (the user's peak is the knob :data:`traceml.settings.PEAK_TFLOPS`).
"""

from __future__ import annotations

#: ``(model, name patterns, {dtype: dense peak TFLOPS})``. A device name (as
#: ``torch.cuda.get_device_name()`` gives it, e.g. "NVIDIA H100 80GB HBM3") matches a row when
#: it contains every pattern of one of the row's pattern tuples (case-insensitive); the first
#: row that matches wins, so the specific rows (PCIe, NVL) come before the general ones.
TABLE: tuple[tuple[str, tuple[tuple[str, ...], ...], dict[str, float]], ...] = (
    (
        "H100 NVL",
        (("h100", "nvl"),),
        {"fp32": 60.0, "tf32": 417.5, "bf16": 835.5, "fp16": 835.5, "fp8": 1670.5},
    ),
    (
        "H100 PCIe",
        (("h100", "pcie"),),
        {"fp32": 51.0, "tf32": 378.0, "bf16": 756.5, "fp16": 756.5, "fp8": 1513.0},
    ),
    (
        "H100 SXM",
        (("h100",),),
        {"fp32": 67.0, "tf32": 494.5, "bf16": 989.5, "fp16": 989.5, "fp8": 1979.0},
    ),
    (
        "H200 NVL",
        (("h200", "nvl"),),
        {"fp32": 60.0, "tf32": 417.5, "bf16": 835.5, "fp16": 835.5, "fp8": 1670.5},
    ),
    (
        "GH200",
        (("gh200",),),
        {"fp32": 67.0, "tf32": 494.5, "bf16": 989.5, "fp16": 989.5, "fp8": 1979.0},
    ),
    (
        "H200 SXM",
        (("h200",),),
        {"fp32": 67.0, "tf32": 494.5, "bf16": 989.5, "fp16": 989.5, "fp8": 1979.0},
    ),
    ("A100", (("a100",),), {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0}),
    ("A10", (("a10",),), {"fp32": 31.2, "tf32": 62.5, "bf16": 125.0, "fp16": 125.0}),
    (
        "L40S",
        (("l40s",),),
        {"fp32": 91.6, "tf32": 183.0, "bf16": 362.05, "fp16": 362.05, "fp8": 733.0},
    ),
    ("L4", (("l4",),), {"fp32": 30.3, "tf32": 60.0, "bf16": 121.0, "fp16": 121.0, "fp8": 242.5}),
    ("V100 SXM2", (("v100", "sxm2"),), {"fp32": 15.7, "fp16": 125.0}),
    ("V100 PCIe", (("v100",),), {"fp32": 14.0, "fp16": 112.0}),
    ("T4", (("t4",),), {"fp32": 8.1, "fp16": 65.0}),
)


#: Device names the SDK reports for a model that is not on a CUDA device (its device type).
NOT_GPUS = ("cpu", "mps", "xpu", "meta")


def lookup(device_name: str | None, dtype: str | None) -> tuple[float | None, str]:
    """The dense peak of ``device_name`` for ``dtype`` from :data:`TABLE`.

    Args:
        device_name: ``torch.cuda.get_device_name()``, or ``cpu`` (or another device type).
        dtype: ``bf16``, ``fp16``, ``tf32``, ``fp32``, ``fp8``, ...

    Returns:
        ``(TFLOPS, "table: <model> <dtype> dense")``, or ``(None, why not)``.
    """
    if not device_name:
        return None, "the rank's device is unknown"
    if device_name in NOT_GPUS:
        return None, f"no peak for a {device_name} device in the table: give --peak-tflops"
    lowered = device_name.lower()
    if " mig " in f" {lowered} ":
        return (
            None,
            f"{device_name} is a MIG slice, whose share of the peak is not known: "
            "give --peak-tflops",
        )
    words = lowered.replace("-", " ").split()
    for model, patterns, peaks in TABLE:
        if any(all(_has(words, lowered, p) for p in pattern) for pattern in patterns):
            if dtype in peaks:
                return peaks[dtype], f"table: {model} {dtype} dense"
            return (
                None,
                f"no {dtype or 'unknown dtype'} peak for {model} in the table: give --peak-tflops",
            )
    return None, f"{device_name} is not in the peak table: give --peak-tflops"


def _has(words: list[str], lowered: str, pattern: str) -> bool:
    """A short pattern (``l4``, ``t4``, ``a10``) must be a whole word or a word's start
    followed by a non-letter (``a100`` is not ``a10``); a long one may appear anywhere."""
    if len(pattern) > 4:
        return pattern in lowered
    return any(
        w == pattern or (w.startswith(pattern) and not w[len(pattern)].isalnum()) for w in words
    )
