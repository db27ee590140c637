"""The first thing a GPU session runs: TraceML's riskiest CUDA paths on real GPUs, < 10 min.

    python benchmarks/gpu_check.py [--out DIR] [--quick]

One line per check, ``a)`` to ``i)``, each PASS, FAIL or SKIP with its figures (detail lines
under it); what each proves: docs/telemetry.md, "The GPU check". Every run is a real
``traceml run`` of this script (``--child NAME``): launcher, aggregator, node sampler with
NVML, SDK; the checks read the run's SQLite store, its ``final_summary.json`` and the child's
own report.

* a) one rank, the SDK's defaults (an MLP fed from pinned memory, ``loss.item()`` every step):
  one step in N GPU-timed and every one resolved, GPU phases and H2D on both clocks, memory
  peaks on exactly the steps whose index is a multiple of M (step 0 included), allocator bytes
  in process samples, the rank's own GPU among NVML's samples by UUID, no synchronize call;
  plus the primitives' cost per call (µs);
* b) accuracy without a per-step sync: ``torch.cuda._sleep`` of known lengths in forward,
  backward and optimizer, every step GPU-timed, nothing synchronising: each GPU phase's median
  within ±10 % of its sleep;
* c) no hidden sync: ~1 s of GPU work queued, then empty ``trace_step`` blocks over a GPU-timed
  and a memory step must take ≪ 1 s of CPU, the GPU still busy at their end;
* d) reentrant activation checkpointing (``use_reentrant=True``): backward on the GPU clock is
  the recompute plus the backward, once (±10 %), and CPU phases never exceed the step;
* e) CUDA graph captures in global mode (``torch.cuda.graph`` and a manual capture on a side
  stream, inside and between timed steps) while timed steps are pending and the sender polls
  every millisecond: every capture and replay succeeds, every timed step resolves;
* f) world-size-1 FSDP2 with a bf16 ``MixedPrecisionPolicy``: the FLOPs dtype is bf16 and the
  MFU at most 100 %;
* g) two GPUs or more: two ranks that never call ``set_device`` each report their own device
  and UUID, and neither has a context on the other's GPU (else SKIP);
* i) collectives on NCCL, unit by unit on one GPU (a world-size-1 NCCL group: NCCL takes one
  GPU per rank): every explicit collective of ``traceml.sdk.collectives.OPS``, sync and async,
  recorded once in call order with its op, group, sequence number and bytes, and completed
  (the async ones through their CUDA future's callback), its result equal to the untraced
  call's; a DDP model's gradient buckets recorded through the communication hook; every traced
  step with ``comm`` and its arrival (the default group's CRC-32, the step's last bucket's
  sequence number); no synchronize call. With two GPUs or more, also a 2-rank NCCL DDP job
  whose rank 1 sleeps ``NCCL_LATE_MS`` more on the host in each step (``loss.item()`` every
  step): ``analysis.skew`` has rank 1 last by that much (±20 %), and LATE_ARRIVAL is withheld
  on NCCL, saying why (else that part is SKIP). NCCL's ``comm`` ends at
  enqueue (docs/telemetry.md): its GPU-clock completion is not timed yet, so neither is
  checked here;
* h) overhead of ``trace_step`` on a ~2 ms step, with and without TraceML in one run, A/B
  interleaved: at most 3 %.

Exit code: 0 when no line FAILs (SKIPs allowed); 1 when one does; 3 (:data:`EXIT_NO_CUDA`)
without a CUDA device, after one line that says so (a CPU-only machine, CI). ``--quick``
(the GPU test of tests/test_gpu.py) runs shorter blocks and reports the overhead without
holding it to the target (shared CI GPUs are noisy).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from _common import free_port

#: Overhead target of ``trace_step`` (%) at the nominal step time (ms) of line h).
TARGETS_PCT = {2.0: 3.0}
#: How far a GPU phase's median may be from the GPU time it is known to take (b, d).
ACCURACY_TOLERANCE = 0.10
#: GPU work queued ahead of the empty steps of line c), ms; their CPU time must stay below
#: :data:`NO_SYNC_CPU_MS` (a sync would cost about the queued time).
QUEUED_GPU_MS = 1000.0
NO_SYNC_CPU_MS = 100.0
#: Exit code without a CUDA device.
EXIT_NO_CUDA = 3
#: Wall-clock budget of all the traced runs together, s: the check fits a 10-minute device
#: slot with time to print; a run that would start with less than :data:`MIN_RUN_S` left is
#: not started (its lines FAIL saying so).
BUDGET_S = 570.0
MIN_RUN_S = 30.0
RUN_NAME = "gpu-check"
#: GPU sleeps (ms) of line b)'s phases, and of line d)'s checkpointed block.
SLEEP_MS = {"forward": 4.0, "backward": 8.0, "optimizer": 2.0}
#: Line i)'s 2-rank job: rank 1's extra host sleep per forward, ms, and its steps.
NCCL_LATE_MS = 30.0
NCCL_STEPS = 40
CHECKPOINT_MS = {"forward": 3.0, "backward": 5.0, "optimizer": 2.0}


# --- pure logic (tested on CPU by tests/test_gpu.py) -----------------------------------------
@dataclass
class Check:
    """One verdict: its name, whether it holds, and the figures behind it."""

    name: str
    ok: bool
    detail: str


@dataclass
class Line:
    """One line of the check (``a)`` to ``i)``): PASS when every check holds, SKIP with
    ``skip`` as the reason."""

    label: str
    title: str
    checks: list[Check] = field(default_factory=list)
    skip: str = ""
    info: list[str] = field(default_factory=list)

    @property
    def verdict(self) -> str:
        """PASS, FAIL or SKIP."""
        if self.skip:
            return "SKIP"
        return "PASS" if self.checks and all(c.ok for c in self.checks) else "FAIL"

    def text(self) -> str:
        """The line and its detail lines, as printed."""
        head = f"{self.label}) {self.verdict} {self.title}"
        if self.skip:
            return f"{head}: {self.skip}"
        out = (
            [head]
            + [f"     {'PASS' if c.ok else 'FAIL'} {c.name}: {c.detail}" for c in self.checks]
            + [f"     {i}" for i in self.info]
        )
        return "\n".join(out)


def calibrate(
    measure: Callable[[int], float], target_ms: float, start: int = 64, limit: int = 1 << 16
) -> int:
    """The smallest batch size whose step takes at least ``target_ms``, found by doubling from
    ``start`` and then bisecting (``measure(batch)`` -> median step, ms). Returns ``start``
    when even that is slower than the target, ``limit`` when nothing reaches it."""
    if measure(start) >= target_ms:
        return start
    lo, hi = start, min(start * 2, limit)
    while measure(hi) < target_ms:
        if hi >= limit:
            return limit
        lo, hi = hi, min(hi * 2, limit)
    while hi - lo > max(1, hi // 32):  # within ~3 % of the batch size
        mid = (lo + hi) // 2
        if measure(mid) < target_ms:
            lo = mid
        else:
            hi = mid
    return hi


def interleave_ab(
    block: Callable[[bool, int], list[float]], rounds: int, steps: int
) -> tuple[list[float], list[float]]:
    """Per-step times of the traced (A) and untraced (B) variants, run in alternating blocks
    (AB, BA, AB, ...) so that drift (clocks, temperature, other load) hits both alike.

    ``block(traced, steps)`` runs ``steps`` steps and returns their times.
    """
    traced_times: list[float] = []
    plain_times: list[float] = []
    for r in range(rounds):
        for traced in (True, False) if r % 2 == 0 else (False, True):
            (traced_times if traced else plain_times).extend(block(traced, steps))
    return traced_times, plain_times


def overhead_pct(traced: list[float], plain: list[float]) -> float:
    """Overhead of the traced variant, % of the untraced median step time."""
    return (statistics.median(traced) / statistics.median(plain) - 1.0) * 100.0


def _median(values) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def phase_table(steps: list[dict]) -> dict:
    """Medians (ms) of each phase on the CPU and the GPU clock over GPU-timed steps."""
    timed = [s for s in steps if s["gpu_step_us"] is not None]
    table = {}
    body = [s["step_us"] - (s["input_wait_us"] or 0) for s in timed]
    pairs = [("step body", body, [s["gpu_step_us"] for s in timed])]
    for phase in ("h2d", "forward", "backward", "optimizer"):
        pairs.append(
            (phase, [s[f"{phase}_us"] for s in timed], [s[f"gpu_{phase}_us"] for s in timed])
        )
    for name, cpu, gpu in pairs:
        cpu_ms, gpu_ms = _median(cpu), _median(gpu)
        table[name] = {
            "cpu_ms": None if cpu_ms is None else cpu_ms / 1000,
            "gpu_ms": None if gpu_ms is None else gpu_ms / 1000,
            "gpu_over_cpu": None if not cpu_ms or gpu_ms is None else gpu_ms / cpu_ms,
        }
    return table


def evaluate(run: dict, child: dict) -> list[Check]:
    """The checks of line a).

    Args:
        run: rows of the store: ``steps`` (dicts with the StepRecord fields), ``finish``,
            ``ranks``, ``process`` and ``gpus`` (lists of dicts).
        child: the child's report (``every_n``, ``memory_every_n``, ``block``, ``sync_calls``,
            ``param_bytes``).
    """
    checks = []
    steps = run["steps"]
    n, m = child["every_n"], child["memory_every_n"]
    first, last = child["block"]
    block = [s for s in steps if first <= s["step"] < last]
    timed_block = [s for s in block if s["gpu_step_us"] is not None]

    def add(name, ok, detail):
        checks.append(Check(name, bool(ok), detail))

    add(
        "sdk never synchronizes",
        child["sync_calls"] == 0,
        f"{child['sync_calls']} synchronize calls during traced steps",
    )
    timed = {s["step"] for s in steps if s["gpu_step_us"] is not None}
    expected = {s["step"] for s in steps if s["step"] % n == 0}
    add(
        "one step in N GPU-timed",
        timed == expected and timed,
        f"N={n}: {len(timed)} timed, {len(expected)} expected, {len(timed ^ expected)} differ",
    )
    unresolved = sum(f["steps_gpu_unresolved"] for f in run["finish"])
    add(
        "GPU events all resolved",
        run["finish"] and unresolved == 0,
        f"steps_gpu_unresolved={unresolved} over {len(run['finish'])} finish markers",
    )
    missing = [
        s["step"]
        for s in timed_block
        if any(
            s[f] is None
            for f in ("gpu_h2d_us", "gpu_forward_us", "gpu_backward_us", "gpu_optimizer_us")
        )
    ]
    add(
        "GPU phases on every timed step",
        timed_block and not missing,
        f"{len(timed_block)} timed steps in the block, {len(missing)} missing a phase",
    )
    over = [
        s["step"]
        for s in timed_block
        if s["gpu_step_us"] > 1.02 * (s["step_us"] - (s["input_wait_us"] or 0)) + 50
    ]
    add(
        "GPU step body within the CPU step",
        timed_block and not over,
        f"{len(over)} of {len(timed_block)} timed steps longer on the GPU clock",
    )
    h2d = [s["h2d_us"] for s in block]
    add(
        "H2D seen on the CPU clock",
        block and None not in h2d and _median(h2d) > 0,
        f"median h2d_us={_median(h2d)} over {len(block)} steps",
    )
    gpu_h2d = [s["gpu_h2d_us"] for s in timed_block]
    add(
        "H2D seen on the GPU clock",
        timed_block and None not in gpu_h2d and min(gpu_h2d) > 0,
        f"median gpu_h2d_us={_median(gpu_h2d)}",
    )
    peaks = {s["step"] for s in steps if s["peak_allocated_bytes"] is not None}
    want = {s["step"] for s in steps if s["step"] % m == 0}
    allocated = [s["peak_allocated_bytes"] for s in steps if s["step"] in peaks]
    reserved = [s["peak_reserved_bytes"] for s in steps if s["step"] in peaks]
    add(
        "memory peaks on one step in M",
        peaks == want
        and peaks
        and min(allocated) >= 3 * child["param_bytes"]
        and all(r >= a for a, r in zip(allocated, reserved, strict=True)),
        f"M={m}: {len(peaks)} steps with peaks ({len(want)} expected, step 0 included); max "
        f"allocated {max(allocated, default=0) / 2**20:.0f} MiB, "
        f"params {child['param_bytes'] / 2**20:.0f} MiB",
    )
    alloc = [
        p["gpu_allocated_bytes"] for p in run["process"] if p["gpu_allocated_bytes"] is not None
    ]
    add(
        "allocator bytes in process samples",
        alloc and max(alloc) > 0,
        f"{len(alloc)} samples, max {max(alloc, default=0) / 2**20:.0f} MiB",
    )
    uuid = run["ranks"][0]["gpu_uuid"] if run["ranks"] else ""
    own = [g for g in run["gpus"] if uuid and g["uuid"] == uuid]

    def seen(name):
        return [g[name] for g in own if g[name] is not None]

    add(
        "NVML reports the rank's own GPU",
        own
        and seen("util_percent")
        and max(seen("util_percent")) > 0
        and seen("memory_used_bytes")
        and seen("temperature_c")
        and seen("power_w")
        and max(seen("power_w")) > 0,
        f"uuid {uuid or '-'}: {len(own)} samples; "
        f"util max {max(seen('util_percent'), default=None)} %, "
        f"mem max {max(seen('memory_used_bytes'), default=0) / 2**30:.1f} GiB, "
        f"temp max {max(seen('temperature_c'), default=None)} °C, "
        f"power max {max(seen('power_w'), default=None)} W",
    )
    return checks


def overhead_checks(child: dict, enforce: bool = True) -> list[Check]:
    """Line h): the A/B overhead at each nominal step time, held to :data:`TARGETS_PCT`
    unless ``enforce`` is False (then reported as passing)."""
    checks = []
    for label, result in child["overhead"].items():
        target = TARGETS_PCT[result["nominal_ms"]]
        checks.append(
            Check(
                f"trace_step overhead at {label}",
                result["overhead_pct"] <= target or not enforce,
                f"{result['overhead_pct']:+.2f} % (target ≤ {target:g} %"
                f"{'' if enforce else ', informational under --quick'}): median "
                f"{result['traced_ms']:.3f} ms traced vs {result['plain_ms']:.3f} ms, "
                f"{result['steps']} steps each, batch {result['batch']}",
            )
        )
    return checks


def accuracy_checks(
    steps: list[dict], expected_ms: dict[str, float], tolerance: float = ACCURACY_TOLERANCE
) -> list[Check]:
    """Lines b) and d): every step of ``steps`` GPU-timed, each phase's GPU median within
    ``tolerance`` of ``expected_ms[phase]``, and the CPU phases within the step."""
    checks = []
    untimed = [s["step"] for s in steps if s["gpu_step_us"] is None]
    checks.append(
        Check(
            "every step GPU-timed",
            steps and not untimed,
            f"{len(steps) - len(untimed)} of {len(steps)} steps",
        )
    )
    for phase, ms in expected_ms.items():
        got = _median(s[f"gpu_{phase}_us"] for s in steps)
        ok = got is not None and abs(got / 1000 - ms) <= tolerance * ms
        checks.append(
            Check(
                f"GPU {phase} within ±{tolerance:.0%}",
                ok,
                f"median {'-' if got is None else f'{got / 1000:.3f}'} ms, known {ms:.3f} ms",
            )
        )
    over = [
        s["step"]
        for s in steps
        if sum(s[f"{p}_us"] or 0 for p in ("h2d", "forward", "backward", "optimizer"))
        > s["step_us"]
    ]
    checks.append(
        Check(
            "CPU phases never exceed the step",
            steps and not over,
            f"{len(over)} of {len(steps)} steps over",
        )
    )
    return checks


def no_sync_checks(result: dict) -> list[Check]:
    """Line c), from the child's figures (``queued_gpu_ms``, ``steps``, ``cpu_ms``,
    ``gpu_still_busy``)."""
    return [
        Check(
            "empty steps take no GPU time to return",
            result["cpu_ms"] < NO_SYNC_CPU_MS,
            f"{result['steps']} empty trace_step blocks took {result['cpu_ms']:.2f} ms of "
            f"CPU with {result['queued_gpu_ms']:.0f} ms of GPU work queued "
            f"(bound {NO_SYNC_CPU_MS:g} ms)",
        ),
        Check(
            "the queued work was still running after them",
            result["gpu_still_busy"],
            "yes" if result["gpu_still_busy"] else "no: the GPU had finished, nothing proven",
        ),
    ]


def capture_checks(result: dict, steps: list[dict], finish: list[dict]) -> list[Check]:
    """Line e), from the child's figures (``captures``, ``failed``, ``replay_ok``) and the
    store's rows of the capture block."""
    unresolved = sum(f["steps_gpu_unresolved"] for f in finish)
    untimed = [s["step"] for s in steps if s["gpu_step_us"] is None]
    return [
        Check(
            "every capture succeeded",
            result["captures"] and not result["failed"],
            f"{result['captures']} captures in global mode, {len(result['failed'])} failed"
            + (f": {result['failed'][0]}" if result["failed"] else ""),
        ),
        Check("the graphs replay right", result["replay_ok"], f"replay_ok={result['replay_ok']}"),
        Check(
            "timed steps resolved around the captures",
            steps and not untimed and unresolved == 0,
            f"{len(steps) - len(untimed)} of {len(steps)} steps with GPU fields, "
            f"steps_gpu_unresolved={unresolved}",
        ),
    ]


def mfu_checks(mfu: dict | None) -> list[Check]:
    """Line f), from ``ranks[0].throughput.mfu`` of the summary."""
    if mfu is None:
        return [Check("the summary has the rank's MFU", False, "no ranks[0].throughput.mfu")]
    pct = mfu.get("mfu_pct")
    return [
        Check(
            "FLOPs dtype is FSDP's param_dtype",
            mfu.get("dtype") == "bf16",
            f"dtype {mfu.get('dtype')!r}, device {mfu.get('device_name')!r}",
        ),
        Check(
            "MFU at most 100 %",
            pct is not None and 0 < pct <= 100,
            f"MFU {pct} % = {mfu.get('achieved_tflops')} of {mfu.get('peak_tflops')} TFLOPS "
            f"({mfu.get('unavailable_reason') or mfu.get('peak_source')})",
        ),
    ]


def device_checks(ranks: list[dict], reports: list[dict], gpu_steps: dict[int, int]) -> list[Check]:
    """Line g): each rank (store rows ``ranks``: rank, device, gpu_uuid) reports ``cuda:<local
    rank>`` and the UUID of that device (the children's ``reports``: rank, uuid,
    other_contexts), the UUIDs differ, no rank has a context on another's GPU, and each rank's
    GPU clock ran (``gpu_steps``: rank -> steps with ``gpu_forward_us``)."""
    by_rank = {r["rank"]: r for r in ranks}
    wrong = []
    for rep in reports:
        row = by_rank.get(rep["rank"], {})
        if row.get("device") != f"cuda:{rep['rank']}" or not (row.get("gpu_uuid") or "").endswith(
            rep["uuid"]
        ):
            wrong.append(f"rank {rep['rank']}: {row.get('device')} {row.get('gpu_uuid')}")
    uuids = [r.get("gpu_uuid") for r in ranks]
    contexts = [
        f"rank {rep['rank']} on {rep['other_contexts']}" for rep in reports if rep["other_contexts"]
    ]
    return [
        Check(
            "each rank reports its own device and UUID",
            len(reports) >= 2 and not wrong and len(set(uuids)) == len(uuids),
            "; ".join(wrong)
            or ", ".join(f"rank {r['rank']} {r['device']} {r['gpu_uuid']}" for r in ranks),
        ),
        Check(
            "no rank has a context on another's GPU",
            reports and not contexts,
            "; ".join(contexts) or "none",
        ),
        Check(
            "each rank's GPU clock ran",
            reports and all(gpu_steps.get(r["rank"]) for r in reports),
            ", ".join(f"rank {r}: {c} steps" for r, c in sorted(gpu_steps.items())),
        ),
    ]


# --- the children: ranks under `traceml run` (need CUDA) --------------------------------------
def _per_call_us(fn, calls: int = 1000) -> float:
    """Median over 5 repeats of the mean cost of ``fn()``, µs."""
    runs = []
    for _ in range(5):
        t0 = time.perf_counter_ns()
        for _ in range(calls):
            fn()
        runs.append((time.perf_counter_ns() - t0) / calls / 1000)
    return statistics.median(runs)


class _SyncCounter:
    """Counts synchronize calls (device, event, stream) while :attr:`armed`."""

    def __init__(self, torch) -> None:
        self.calls = 0
        self.armed = False
        for owner, name in (
            (torch.cuda, "synchronize"),
            (torch.cuda.Event, "synchronize"),
            (torch.cuda.Stream, "synchronize"),
        ):
            setattr(owner, name, self._wrap(getattr(owner, name)))

    def _wrap(self, original):
        def counted(*args, **kwargs):
            if self.armed:
                self.calls += 1
            return original(*args, **kwargs)

        return counted


def _cycles_per_ms(torch) -> float:
    """``torch.cuda._sleep`` cycles per ms on this GPU now (a 50 ms sleep, timed by events)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1_000_000)  # warm: clocks up
    cycles = 100_000_000
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    per_ms = cycles / start.elapsed_time(end)
    cycles = int(50 * per_ms)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return cycles / start.elapsed_time(end)


def _start(torch, set_device: bool = True):
    """The rank's device (``cuda:<LOCAL_RANK>``) and its state, after ``traceml.init()``."""
    import traceml
    from traceml.sdk import rank_state

    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    if set_device:
        torch.cuda.set_device(device)
    traceml.init()
    state = rank_state.current()
    assert state is not None, "traceml.init() did not start a rank state"
    return device, state


def child_main(args) -> dict:
    """Lines a), c), h): the SDK's defaults on an MLP fed from pinned memory."""
    import torch
    from torch import nn

    import traceml
    from traceml import settings

    device, state = _start(torch)
    counter = _SyncCounter(torch)
    width, depth = 2048, 8

    class Workload:
        def __init__(self, batch: int) -> None:
            layers = []
            for _ in range(depth):
                layers += [nn.Linear(width, width), nn.GELU()]
            self.model = nn.Sequential(*layers).to(device)
            self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
            self.x = torch.randn(batch, width).pin_memory()
            self.y = torch.randn(batch, width).pin_memory()
            self.batch = batch

        def step(self, traced: bool) -> float:
            ctx = traceml.trace_step(self.model) if traced else contextlib.nullcontext()
            t0 = time.perf_counter()
            with ctx:
                x = self.x.cuda(non_blocking=True)
                y = self.y.to(device, non_blocking=True)
                self.opt.zero_grad(set_to_none=True)
                loss = nn.functional.mse_loss(self.model(x), y)
                loss.backward()
                self.opt.step()
                loss.item()  # logging: one sync per step
            return (time.perf_counter() - t0) * 1000

        def block(self, traced: bool, steps: int) -> list[float]:
            counter.armed = traced
            try:
                return [self.step(traced) for _ in range(steps)]
            finally:
                counter.armed = False

    def measure(batch: int) -> float:
        w = Workload(batch)
        w.block(False, 5)
        return statistics.median(w.block(False, 20))

    # the primitives (the SDK's GPU clock starts at step 0: the model is on the device)
    probe = Workload(64)
    probe.block(True, 1)
    timer = state.tracer.gpu_step_factory
    assert timer.record() is not None, "the SDK's GPU clock did not start"
    ev, ev2 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ev.record()
    ev2.record()
    torch.cuda.synchronize()
    on_gpu = torch.zeros(4, device=device)
    plain_to = torch.Tensor.to.__traceml_original__
    index = device.index
    model = probe.model

    def empty_step():
        with traceml.trace_step(model):
            pass

    def empty_plain():
        with contextlib.nullcontext():
            pass

    micro = {
        "event_record_public_us": _per_call_us(
            lambda: torch.cuda.Event(enable_timing=True).record(), 200
        ),
        "event_record_sdk_pooled_us": _per_call_us(lambda: timer.pool.give([timer.record()])),
        "event_query_us": _per_call_us(ev.query),
        "event_elapsed_time_us": _per_call_us(lambda: ev.elapsed_time(ev2)),
        "max_memory_allocated_us": _per_call_us(torch.cuda.max_memory_allocated, 200),
        "sdk_memory_read_us": _per_call_us(
            lambda: torch.cuda.memory_stats_as_nested_dict(index), 200
        ),
        "tensor_to_cuda_tensor_hooked_us": _per_call_us(lambda: on_gpu.to(device)),
        "tensor_to_cuda_tensor_plain_us": _per_call_us(lambda: plain_to(on_gpu, device)),
        "empty_trace_step_us": _per_call_us(empty_step, 500) - _per_call_us(empty_plain, 500),
    }

    # c) no hidden sync: ~1 s of GPU work queued, then empty steps over a GPU-timed step and
    # a memory step
    every_n = settings.read(settings.GPU_TIMING_EVERY_N_STEPS)
    memory_n = settings.read(settings.MEMORY_EVERY_N_STEPS)
    per_ms = _cycles_per_ms(torch)
    done = torch.cuda.Event()
    torch.cuda._sleep(int(QUEUED_GPU_MS * per_ms))
    done.record()
    steps = max(every_n, memory_n)
    counter.armed = True
    t0 = time.perf_counter()
    for _ in range(steps):
        empty_step()
    cpu_ms = (time.perf_counter() - t0) * 1000
    counter.armed = False
    no_sync = {
        "queued_gpu_ms": QUEUED_GPU_MS,
        "steps": steps,
        "cpu_ms": cpu_ms,
        "gpu_still_busy": not done.query(),
    }
    torch.cuda.synchronize()
    del probe

    # h) overhead, A/B interleaved
    rounds, block_steps = (10, 20) if args.quick else (60, 25)
    overhead = {}
    for nominal in TARGETS_PCT:
        batch = calibrate(measure, nominal)
        w = Workload(batch)
        w.block(True, 10)
        w.block(False, 10)
        traced, plain = interleave_ab(w.block, rounds, block_steps)
        overhead[f"{nominal:g} ms"] = {
            "nominal_ms": nominal,
            "batch": batch,
            "steps": len(traced),
            "traced_ms": statistics.median(traced),
            "plain_ms": statistics.median(plain),
            "overhead_pct": overhead_pct(traced, plain),
            "overhead_mean_pct": (statistics.fmean(traced) / statistics.fmean(plain) - 1) * 100,
        }
    # a) the phase block
    first = state.tracer.steps_completed
    w.block(True, 100 if args.quick else 300)
    return {
        "every_n": every_n,
        "memory_every_n": memory_n,
        "block": [first, state.tracer.steps_completed],
        "sync_calls": counter.calls,
        "param_bytes": sum(p.numel() * p.element_size() for p in w.model.parameters()),
        "overhead": overhead,
        "no_sync": no_sync,
        "micro_us": micro,
        "device": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
    }


def child_sleep(args) -> dict:
    """Lines b), d), e); run with every step GPU-timed and the sender polling every ms."""
    import torch
    from torch import nn
    from torch.utils.checkpoint import checkpoint

    import traceml

    device, state = _start(torch)
    per_ms = _cycles_per_ms(torch)

    def cycles(ms: float) -> int:
        return int(ms * per_ms)

    class Sleep(torch.autograd.Function):
        """Identity on the GPU clock: sleeps ``fwd`` cycles forward, ``bwd`` backward."""

        @staticmethod
        def forward(ctx, x, fwd, bwd):
            ctx.bwd = bwd
            torch.cuda._sleep(fwd)
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            torch.cuda._sleep(ctx.bwd)
            return grad, None, None

    class SleepModel(nn.Module):
        def __init__(self, ms: dict) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(256, device=device))
            self.fwd, self.bwd = cycles(ms["forward"]), cycles(ms["backward"])

        def forward(self, x):
            return Sleep.apply(x * self.w, self.fwd, self.bwd)

    class Checkpointed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = SleepModel(CHECKPOINT_MS)

        def forward(self, x):
            return checkpoint(self.inner, x, use_reentrant=True)

    def optimizer(model, ms: float):
        class SleepSGD(torch.optim.SGD):
            def step(self, closure=None):
                torch.cuda._sleep(cycles(ms))
                return super().step(closure)

        return SleepSGD(model.parameters(), lr=1e-3)

    def train(model, opt, steps: int, x, between=None, inside=None) -> list[int]:
        first = state.tracer.steps_completed
        for i in range(steps):
            with traceml.trace_step(model):
                loss = model(x).sum()
                if inside is not None:
                    inside(i)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            if between is not None:
                between(i)
        return [first, state.tracer.steps_completed]

    steps = 20 if args.quick else 40
    x = torch.randn(64, 256, device=device, requires_grad=True)
    model = SleepModel(SLEEP_MS)
    opt = optimizer(model, SLEEP_MS["optimizer"])
    train(model, opt, 5, x)  # warm-up
    accuracy = train(model, opt, steps, x)
    ckpt = Checkpointed()
    ckpt_opt = optimizer(ckpt, CHECKPOINT_MS["optimizer"])
    train(ckpt, ckpt_opt, 3, x)
    reentrant = train(ckpt, ckpt_opt, steps, x)
    torch.cuda.synchronize()

    # e) captures in global mode while timed steps are pending
    static = torch.zeros(1024, device=device)
    side = torch.cuda.Stream()
    graphs, failed = [], []

    def capture(i: int) -> None:
        graph = torch.cuda.CUDAGraph()
        try:
            if i % 2:
                with torch.cuda.graph(graph):  # capture_error_mode="global", the default
                    out = static * 2 + 1
            else:
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    graph.capture_begin()  # global mode, no synchronize first
                    out = static * 2 + 1
                    graph.capture_end()
                torch.cuda.current_stream().wait_stream(side)
            graphs.append((graph, out))
        except Exception as exc:
            failed.append(f"{type(exc).__name__}: {exc}"[:200])

    captures = train(
        model, opt, steps, x, between=capture, inside=lambda i: capture(i) if i % 3 == 0 else None
    )
    for graph, _ in graphs:
        graph.replay()
    torch.cuda.synchronize()
    replay_ok = bool(graphs) and all(bool((out == 1).all()) for _, out in graphs)
    time.sleep(1.0)  # the sender resolves the last steps before the exit's bounded wait
    return {
        "per_ms_cycles": per_ms,
        "accuracy_block": accuracy,
        "reentrant_block": reentrant,
        "capture_block": captures,
        "capture": {
            "captures": len(graphs) + len(failed),
            "failed": failed,
            "replay_ok": replay_ok,
        },
    }


def child_fsdp(args) -> dict:
    """Line f): world-size-1 FSDP2 with a bf16 MixedPrecisionPolicy."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import traceml

    device, state = _start(torch)
    dist.init_process_group("nccl", device_id=device)
    width = 4096
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(4)]).to(device)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(1024, width, device=device)
    for _ in range(20 if args.quick else 40):
        with traceml.trace_step(model):
            loss = model(x).float().pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    dist.destroy_process_group()
    return {"param_dtype": "bf16", "steps": state.tracer.steps_completed}


def child_devices(args) -> dict:
    """Line g): a rank that never calls ``set_device`` and moves its work to
    ``cuda:<LOCAL_RANK>`` (pageable copies: pinning memory would touch device 0 itself)."""
    import torch
    from torch import nn

    import traceml

    device, state = _start(torch, set_device=False)
    model = nn.Linear(1024, 1024).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    host = torch.randn(64, 1024)
    for _ in range(30):
        with traceml.trace_step(model):
            model(host.to(device)).sum().backward()
            opt.step()
    model.weight.sum().item()
    time.sleep(2.0)  # the sender resolves the events, the samplers tick
    traceml.shutdown()
    others = [
        i
        for i in range(torch.cuda.device_count())
        if i != device.index and torch._C._cuda_hasPrimaryContext(i)
    ]
    return {
        "rank": state.info.rank,
        "uuid": str(torch.cuda.get_device_properties(device).uuid),
        "other_contexts": others,
        "current_device": torch.cuda.current_device(),
    }


def child_nccl(args) -> dict:
    """Line i), unit by unit: a world-size-1 NCCL group, every explicit collective sync and
    async against its untraced original, then a DDP model's steps."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    import traceml
    from traceml.sdk import collectives

    device, state = _start(torch)
    dist.init_process_group("nccl", device_id=device)
    rec = collectives.recorder()
    sync = _SyncCounter(torch)
    x = torch.arange(1024, dtype=torch.float32, device=device)
    calls = [(name, a) for a in (False, True) for name in collectives.OPS]
    sync.armed = True
    first = len(rec.events)
    equal = []
    for name, async_op in calls:
        traced = getattr(dist, name)
        ours = _collective(name, traced, x, async_op)
        equal.append(
            bool(torch.equal(ours, _collective(name, traced.__traceml_original__, x, async_op)))
        )
    explicit = [
        {
            "op": e.op,
            "group": e.group,
            "seq": e.seq,
            "nbytes": e.nbytes,
            "done": e.done_ns is not None,
        }
        for e in list(rec.events)[first:]
    ]
    model = DDP(nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1)).to(device))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    first = len(rec.events)
    for _ in range(10):
        with traceml.trace_step(model):
            model(x.view(1, -1)).sum().backward()
            opt.step()
    buckets = [e for e in list(rec.events)[first:] if e.op == collectives.DDP_BUCKET]
    sync.armed = False
    torch.cuda.synchronize()
    traceml.shutdown()
    dist.destroy_process_group()
    return {
        "calls": [name for name, _ in calls],
        "explicit": explicit,
        "equal": equal,
        "buckets": len(buckets),
        "buckets_done": sum(e.done_ns is not None for e in buckets),
        "sync_calls": sync.calls,
        "steps": state.tracer.steps_completed,
    }


def _collective(name: str, fn, x, async_op: bool):
    """Collective ``name`` of ``collectives.OPS`` through ``fn`` (the traced function or its
    original) on a copy of ``x`` in a world of one, waited for; its result."""
    t = x.clone()
    out = t.new_empty(t.numel())
    if name in ("all_reduce", "broadcast"):
        work = fn(t, async_op=async_op) if name == "all_reduce" else fn(t, 0, async_op=async_op)
        out = t
    elif name == "all_gather":
        gathered = [out]
        work = fn(gathered, t, async_op=async_op)
    elif name == "reduce_scatter":
        work = fn(out, [t], async_op=async_op)
    elif name in ("all_gather_into_tensor", "reduce_scatter_tensor"):
        work = fn(out, t, async_op=async_op)
    else:  # barrier
        work = fn(async_op=async_op)
        out = t.new_zeros(1)
    if async_op:
        work.wait()
    return out


def child_nccl_skew(args) -> dict:
    """Line i), two ranks: NCCL DDP, rank 1 sleeping NCCL_LATE_MS more on the host each forward."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    import traceml

    device, state = _start(torch)
    dist.init_process_group("nccl", device_id=device)
    late_s = NCCL_LATE_MS / 1000.0 if dist.get_rank() == 1 else 0.0
    model = DDP(nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 1)).to(device))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(64, 1024, device=device)
    for _ in range(NCCL_STEPS):
        with traceml.trace_step(model):
            time.sleep(0.005 + late_s)
            loss = model(x).sum()
            loss.backward()
            opt.step()
            loss.item()  # the hosts meet the GPU every step: no host runs steps ahead
    torch.cuda.synchronize()
    dist.barrier()
    return {"rank": dist.get_rank(), "steps": state.tracer.steps_completed}


def nccl_checks(report: dict, steps: list[dict]) -> list[Check]:
    """Line i)'s unit-by-unit verdicts from the child's ``report`` and rank 0's stored
    ``steps`` (the traced DDP steps are its last 10)."""
    import zlib

    names = report["calls"]
    explicit = report["explicit"]
    expected = [(name, i + 1) for i, name in enumerate(names)]
    ddp = steps[-10:]
    arrivals = [(s["arrive_group"], s["arrive_seq"]) for s in ddp]
    return [
        Check(
            "every explicit collective recorded once, in call order",
            [(e["op"], e["seq"]) for e in explicit] == expected
            and all(e["group"] == "default" for e in explicit),
            f"{len(explicit)} events for {len(names)} calls",
        ),
        Check(
            "bytes: the rank's input (4 KiB; a barrier 0)",
            [e["nbytes"] for e in explicit] == [0 if n == "barrier" else 4096 for n in names],
            str(sorted({e["nbytes"] for e in explicit})),
        ),
        Check(
            "every explicit collective completed (async: the CUDA future's callback)",
            all(e["done"] for e in explicit),
            f"{sum(e['done'] for e in explicit)} of {len(explicit)}",
        ),
        Check(
            "results equal the untraced calls'",
            report["equal"] == [True] * len(names),
            f"{sum(report['equal'])} of {len(names)} equal",
        ),
        Check(
            "DDP buckets recorded through the hook, each completed",
            report["buckets"] >= 10 and report["buckets_done"] == report["buckets"],
            f"{report['buckets']} buckets over 10 steps, {report['buckets_done']} completed",
        ),
        Check(
            "every traced DDP step has comm and its arrival at the default group",
            len(ddp) == 10
            and all(s["comm_us"] is not None for s in ddp)
            and {g for g, _ in arrivals} == {zlib.crc32(b"default")}
            and [q for _, q in arrivals] == sorted({q for _, q in arrivals}),
            f"arrivals {arrivals[:3]}...",
        ),
        Check("no synchronize call", report["sync_calls"] == 0, f"{report['sync_calls']} calls"),
    ]


def skew_checks(summary: dict) -> list[Check]:
    """Line i)'s 2-rank verdicts: ``analysis.skew`` has rank 1 last, by NCCL_LATE_MS
    (±20 %), and LATE_ARRIVAL is withheld on NCCL (its arrivals are enqueue times:
    docs/reading-output.md)."""
    skew = summary["analysis"]["skew"] or {}
    late = skew.get("late_ms", {}).get("1")
    raised = [f for f in summary["findings"]["step_time"] if f["kind"] == "LATE_ARRIVAL"]
    return [
        Check(
            "rank 1 arrives last, by its host delay (±20 %)",
            skew.get("last_pct", {}).get("1", 0.0) >= 90.0
            and late is not None
            and 0.8 * NCCL_LATE_MS <= late <= 1.2 * NCCL_LATE_MS,
            f"last at {skew.get('last_pct')} %, late {late} ms (planted {NCCL_LATE_MS:g})",
        ),
        Check(
            "LATE_ARRIVAL withheld on NCCL, saying why",
            not raised and (skew.get("withheld") or "").startswith("NCCL"),
            f"{len(raised)} raised; withheld: {skew.get('withheld')!r}",
        ),
    ]


CHILDREN = {
    "main": child_main,
    "sleep": child_sleep,
    "fsdp": child_fsdp,
    "devices": child_devices,
    "nccl": child_nccl,
    "nccl_skew": child_nccl_skew,
}


# --- the parent -------------------------------------------------------------------------------
def _rows(db: sqlite3.Connection, sql: str) -> list[dict]:
    cur = db.execute(sql)
    names = [c[0] for c in cur.description]
    return [dict(zip(names, row, strict=True)) for row in cur.fetchall()]


def load_run(run_dir: Path, rank: int = 0) -> dict:
    """The store's rows the checks need, of ``rank`` (the aggregator must have stopped)."""
    with sqlite3.connect(run_dir / "telemetry.sqlite") as db:
        return {
            "steps": _rows(db, f"SELECT * FROM steps WHERE rank = {rank} ORDER BY step"),
            "finish": _rows(db, "SELECT * FROM rank_finish"),
            "ranks": _rows(db, f"SELECT * FROM ranks WHERE rank = {rank}"),
            "all_ranks": _rows(db, "SELECT * FROM ranks ORDER BY rank"),
            "process": _rows(db, f"SELECT * FROM process_samples WHERE rank = {rank}"),
            "gpus": _rows(db, "SELECT * FROM gpu_samples"),
            "gpu_steps": dict(
                db.execute("SELECT rank, COUNT(gpu_forward_us) FROM steps GROUP BY rank").fetchall()
            ),
        }


def _in(block: list[int], steps: list[dict]) -> list[dict]:
    return [s for s in steps if block[0] <= s["step"] < block[1]]


class Runner:
    """Runs the children under ``traceml run`` into ``out``, each within ``timeout`` s and all
    within :data:`BUDGET_S` from now."""

    def __init__(self, out: Path, quick: bool, timeout: float) -> None:
        self.out, self.quick, self.timeout = out, quick, timeout
        self.deadline = time.monotonic() + BUDGET_S

    def run(self, name: str, nproc: int = 1, env: dict | None = None):
        """``(run directory, [reports by local rank])``, or ``(None, reason)`` when the run
        failed."""
        run_name = f"{RUN_NAME}-{name}"
        report = self.out / f"{name}.json"
        argv = [
            sys.executable,
            "-m",
            "traceml",
            "run",
            str(Path(__file__).resolve()),
            "--aggregator-port",
            str(free_port()),
            "--logs-dir",
            str(self.out / "logs"),
            "--run-name",
            run_name,
            "--nproc-per-node",
            str(nproc),
            "--",
            "--child",
            name,
            "--report",
            str(report),
        ] + (["--quick"] if self.quick else [])
        t0 = time.monotonic()
        timeout = min(self.timeout, self.deadline - t0)
        if timeout < MIN_RUN_S:
            return None, f"not started: {timeout:.0f} s left of the {BUDGET_S:.0f} s budget"
        try:
            proc = subprocess.run(
                argv,
                env=dict(os.environ, TRACEML_SAMPLE_INTERVAL_SEC="0.5", **(env or {})),
                timeout=timeout,
                capture_output=True,
                text=True,
            )
        except subprocess.TimeoutExpired:
            return None, f"traceml run of {name} passed {timeout:.0f} s"
        print(
            f"   ({name}: traceml run exited {proc.returncode} after "
            f"{time.monotonic() - t0:.0f} s)",
            flush=True,
        )
        (self.out / f"{name}.log").write_text(proc.stdout + proc.stderr)
        paths = [report.with_suffix(f".{rank}.json") for rank in range(nproc)]
        if proc.returncode != 0 or not all(p.exists() for p in paths):
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            return None, f"the run failed (exit {proc.returncode}): {' | '.join(tail)}"
        return self.out / "logs" / run_name, [json.loads(p.read_text()) for p in paths]


def _failed(line: Line, reason: str) -> Line:
    line.checks.append(Check("the traced run completed", False, reason))
    return line


def line_main(runner: Runner) -> list[Line]:
    a = Line("a", "one rank, the SDK's defaults")
    c = Line("c", "no hidden sync")
    h = Line("h", "trace_step overhead at a ~2 ms step, with and without TraceML, one run")
    run_dir, reports = runner.run("main")
    if run_dir is None:
        return [_failed(a, reports), _failed(c, reports), _failed(h, reports)]
    child = reports[0]
    run = load_run(run_dir)
    a.checks = evaluate(run, child)
    a.info.append(f"device {child['device']}, torch {child['torch']}")
    a.info += [f"{name:34s} {us:8.2f} µs" for name, us in child["micro_us"].items()]
    for name, row in phase_table(_in(child["block"], run["steps"])).items():
        a.info.append(f"{name:10s} cpu {row['cpu_ms']} ms, gpu {row['gpu_ms']} ms")
    c.checks = no_sync_checks(child["no_sync"])
    h.checks = overhead_checks(child, enforce=not runner.quick)
    return [a, c, h]


def line_sleep(runner: Runner) -> list[Line]:
    b = Line("b", "GPU phases accurate without a per-step sync")
    d = Line("d", "reentrant activation checkpointing")
    e = Line("e", "CUDA graph captures in global mode while timed steps are pending")
    run_dir, reports = runner.run(
        "sleep",
        env={"TRACEML_GPU_TIMING_EVERY_N_STEPS": "1", "TRACEML_FLUSH_INTERVAL_SEC": "0.001"},
    )
    if run_dir is None:
        return [_failed(b, reports), _failed(d, reports), _failed(e, reports)]
    child = reports[0]
    run = load_run(run_dir)
    b.checks = accuracy_checks(_in(child["accuracy_block"], run["steps"]), SLEEP_MS)
    known = dict(CHECKPOINT_MS, backward=CHECKPOINT_MS["forward"] + CHECKPOINT_MS["backward"])
    d.checks = accuracy_checks(_in(child["reentrant_block"], run["steps"]), known)
    d.info.append("backward on the GPU clock: the recompute (forward's sleep) + the backward")
    e.checks = capture_checks(
        child["capture"], _in(child["capture_block"], run["steps"]), run["finish"]
    )
    return [b, d, e]


def line_fsdp(runner: Runner) -> Line:
    f = Line("f", "world-size-1 FSDP2, bf16 MixedPrecisionPolicy: FLOPs dtype and MFU")
    run_dir, reports = runner.run("fsdp")
    if run_dir is None:
        return _failed(f, reports)
    summary = json.loads((run_dir / "final_summary.json").read_text())
    rank0 = next((r for r in summary["ranks"] if r["rank"] == 0), None)
    f.checks = mfu_checks(rank0["throughput"]["mfu"] if rank0 else None)
    return f


def line_devices(runner: Runner, gpus: int) -> Line:
    g = Line("g", "two ranks that never call set_device: their own device, UUID and context")
    if gpus < 2:
        g.skip = f"needs 2 GPUs or more, {gpus} visible"
        return g
    run_dir, reports = runner.run("devices", nproc=2)
    if run_dir is None:
        return _failed(g, reports)
    run = load_run(run_dir)
    g.checks = device_checks(run["all_ranks"], reports, run["gpu_steps"])
    return g


def line_nccl(runner: Runner, gpus: int) -> Line:
    i = Line("i", "collectives on NCCL: recorded, completed, unchanged; arrivals")
    run_dir, reports = runner.run("nccl")
    if run_dir is None:
        return _failed(i, reports)
    i.checks = nccl_checks(reports[0], load_run(run_dir)["steps"])
    if gpus < 2:
        i.info.append(f"the 2-rank LATE_ARRIVAL job: SKIP (needs 2 GPUs or more, {gpus} visible)")
        return i
    run_dir, reports = runner.run("nccl_skew", nproc=2)
    if run_dir is None:
        return _failed(i, reports)
    i.checks += skew_checks(json.loads((run_dir / "final_summary.json").read_text()))
    return i


def parent(args) -> int:
    import torch

    if not torch.cuda.is_available():
        why = "a CPU build of torch" if not torch.backends.cuda.is_built() else "none visible"
        print(f"gpu_check: no CUDA device ({why}); nothing checked, exit {EXIT_NO_CUDA}")
        return EXIT_NO_CUDA
    gpus = torch.cuda.device_count()
    out = Path(args.out or tempfile.mkdtemp(prefix="gpu-check-")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    runner = Runner(out, args.quick, args.timeout)
    print(
        f"gpu_check: {gpus} GPU(s), {torch.cuda.get_device_name(0)}, torch {torch.__version__}"
        f"; runs and logs in {out}",
        flush=True,
    )
    t0 = time.monotonic()
    lines = []
    for produce in (
        line_main,
        line_sleep,
        line_fsdp,
        lambda r: line_devices(r, gpus),
        lambda r: line_nccl(r, gpus),
    ):
        got = produce(runner)
        for line in got if isinstance(got, list) else [got]:
            lines.append(line)
    for line in sorted(lines, key=lambda line: line.label):
        print(line.text())
    (out / "gpu_check.json").write_text(
        json.dumps([asdict(line) | {"verdict": line.verdict} for line in lines], indent=1)
    )
    failed = [line.label for line in lines if line.verdict == "FAIL"]
    print(
        f"gpu_check: {'FAIL ' + ', '.join(failed) if failed else 'PASS'} in "
        f"{time.monotonic() - t0:.0f} s; figures in {out / 'gpu_check.json'}"
    )
    return 1 if failed else 0


def child(args) -> None:
    """Run child ``args.child`` and write its report (``<report>.<local rank>.json``)."""
    report = CHILDREN[args.child](args)
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    Path(args.report).with_suffix(f".{rank}.json").write_text(json.dumps(report, indent=1))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", help="directory for the runs and the figures (default: a temp dir)")
    p.add_argument("--quick", action="store_true", help="shorter blocks; overhead informational")
    p.add_argument("--timeout", type=float, default=240.0, help="bound of each traced run, s")
    p.add_argument("--child", choices=sorted(CHILDREN), help=argparse.SUPPRESS)
    p.add_argument("--report", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args)
        return 0
    return parent(args)


if __name__ == "__main__":
    sys.exit(main())
