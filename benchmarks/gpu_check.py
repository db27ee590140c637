"""GPU verification of TraceML's telemetry on one CUDA GPU, in one prepared run (< 3 min).

    python benchmarks/gpu_check.py [--out DIR] [--quick]

What it does:

1. ``traceml run`` of this very script (``--child``) as one real rank: launcher, aggregator,
   node sampler with NVML, SDK. The child trains an MLP whose batches come from pinned host
   memory through ``.cuda(non_blocking=True)`` and ``.to(device, non_blocking=True)``, and
   logs ``loss.item()`` every step (a sync per step: the most conservative case for overhead,
   since nothing the SDK adds on the CPU can hide behind queued GPU work). It

   * measures the SDK's primitives on this GPU (µs per call): ``Event.record``, the SDK's
     pooled record, ``Event.query``, ``elapsed_time``, ``max_memory_allocated`` (what the SDK
     avoids) and the nested-stats read + peak reset it does instead, ``Tensor.to`` through
     the H2D hook, and an empty ``trace_step``;
   * calibrates the batch size to a ~2 ms and a ~6 ms step (no telemetry);
   * measures ``trace_step`` overhead A/B interleaved: blocks of steps with and without
     ``trace_step``, alternating ABBA, per-step wall time; the medians' ratio is the overhead.
     Both variants run in the same process with TraceML initialised (outside a step its hooks
     pass through; that cost is among the primitives). ``torch.cuda.synchronize``,
     ``Event.synchronize`` and ``Stream.synchronize`` calls are counted while traced blocks
     run (the SDK must make none);
   * runs a block of traced steps of the ~6 ms workload for the phase comparison.

2. Reads the run's SQLite store and the child's report and checks: one step in N GPU-timed and
   every one resolved; GPU phases present; H2D seen on the CPU and the GPU clock; memory
   peaks on exactly one step in M; the rank's own GPU found among NVML's samples by UUID, with
   utilisation, memory, temperature and power; allocator bytes in process samples; overhead
   within target (≤ 3 % at ~2 ms, ≤ 1 % at ~6 ms). Prints phase medians on both clocks,
   every figure and a PASS/FAIL line per check; writes them to ``DIR/gpu_check.json``.

Exit code: 0 when every check passes; 1 otherwise. ``--quick`` (CI) runs shorter blocks and
reports the overhead without holding it to the targets (shared CI GPUs are noisy).
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
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from _common import free_port

#: Overhead targets of ``trace_step`` (%), by nominal step time (ms).
TARGETS_PCT = {2.0: 3.0, 6.0: 1.0}
RUN_NAME = "gpu-check"


# --- pure logic (tested on CPU by tests/test_gpu.py) -----------------------------------------
@dataclass
class Check:
    """One verdict: its name, whether it holds, and the figures behind it."""

    name: str
    ok: bool
    detail: str


def calibrate(measure: Callable[[int], float], target_ms: float, start: int = 64,
              limit: int = 1 << 16) -> int:
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


def interleave_ab(block: Callable[[bool, int], list[float]], rounds: int,
                  steps: int) -> tuple[list[float], list[float]]:
    """Per-step times of the traced (A) and untraced (B) variants, run in alternating blocks
    (AB, BA, AB, ...) so that drift (clocks, temperature, other load) hits both alike.

    ``block(traced, steps)`` runs ``steps`` steps and returns their times.
    """
    traced_times: list[float] = []
    plain_times: list[float] = []
    for r in range(rounds):
        for traced in ((True, False) if r % 2 == 0 else (False, True)):
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
        pairs.append((phase, [s[f"{phase}_us"] for s in timed],
                      [s[f"gpu_{phase}_us"] for s in timed]))
    for name, cpu, gpu in pairs:
        cpu_ms, gpu_ms = _median(cpu), _median(gpu)
        table[name] = {
            "cpu_ms": None if cpu_ms is None else cpu_ms / 1000,
            "gpu_ms": None if gpu_ms is None else gpu_ms / 1000,
            "gpu_over_cpu": None if not cpu_ms or gpu_ms is None else gpu_ms / cpu_ms,
        }
    return table


def evaluate(run: dict, child: dict, enforce_overhead: bool = True) -> list[Check]:
    """Every check of the run (see the module docstring).

    Args:
        run: rows of the store: ``steps`` (dicts with the StepRecord fields), ``finish``,
            ``ranks``, ``process`` and ``gpus`` (lists of dicts).
        child: the child's report (``every_n``, ``memory_every_n``, ``block``, ``sync_calls``,
            ``param_bytes``, ``overhead``).
        enforce_overhead: hold the overhead to :data:`TARGETS_PCT` (else reported as passing).
    """
    checks = []
    steps = run["steps"]
    n, m = child["every_n"], child["memory_every_n"]
    first, last = child["block"]
    block = [s for s in steps if first <= s["step"] < last]
    timed_block = [s for s in block if s["gpu_step_us"] is not None]

    def add(name, ok, detail):
        checks.append(Check(name, bool(ok), detail))

    add("sdk never synchronizes", child["sync_calls"] == 0,
        f"{child['sync_calls']} synchronize calls during traced steps")
    timed = {s["step"] for s in steps if s["gpu_step_us"] is not None}
    expected = {s["step"] for s in steps if s["step"] % n == 0}
    add("one step in N GPU-timed", timed == expected and timed,
        f"N={n}: {len(timed)} timed, {len(expected)} expected, "
        f"{len(timed ^ expected)} differ")
    unresolved = sum(f["steps_gpu_unresolved"] for f in run["finish"])
    add("GPU events all resolved", run["finish"] and unresolved == 0,
        f"steps_gpu_unresolved={unresolved} over {len(run['finish'])} finish markers")
    missing = [s["step"] for s in timed_block
               if any(s[f] is None for f in ("gpu_h2d_us", "gpu_forward_us", "gpu_backward_us",
                                              "gpu_optimizer_us"))]
    add("GPU phases on every timed step", timed_block and not missing,
        f"{len(timed_block)} timed steps in the block, {len(missing)} missing a phase")
    over = [s["step"] for s in timed_block
            if s["gpu_step_us"] > 1.02 * (s["step_us"] - (s["input_wait_us"] or 0)) + 50]
    add("GPU step body within the CPU step", timed_block and not over,
        f"{len(over)} of {len(timed_block)} timed steps longer on the GPU clock")
    h2d = [s["h2d_us"] for s in block]
    add("H2D seen on the CPU clock", block and None not in h2d and _median(h2d) > 0,
        f"median h2d_us={_median(h2d)} over {len(block)} steps")
    gpu_h2d = [s["gpu_h2d_us"] for s in timed_block]
    add("H2D seen on the GPU clock", timed_block and None not in gpu_h2d and min(gpu_h2d) > 0,
        f"median gpu_h2d_us={_median(gpu_h2d)}")
    peaks = {s["step"] for s in steps if s["peak_allocated_bytes"] is not None}
    want = {s["step"] for s in steps if s["step"] % m == 0 and s["step"] > 0}
    allocated = [s["peak_allocated_bytes"] for s in steps if s["step"] in peaks]
    reserved = [s["peak_reserved_bytes"] for s in steps if s["step"] in peaks]
    add("memory peaks on one step in M", peaks == want and peaks
        and min(allocated) >= 3 * child["param_bytes"]
        and all(r >= a for a, r in zip(allocated, reserved)),
        f"M={m}: {len(peaks)} steps with peaks ({len(want)} expected); max allocated "
        f"{max(allocated, default=0) / 2**20:.0f} MiB, "
        f"params {child['param_bytes'] / 2**20:.0f} MiB")
    alloc = [p["gpu_allocated_bytes"] for p in run["process"]
             if p["gpu_allocated_bytes"] is not None]
    add("allocator bytes in process samples", alloc and max(alloc) > 0,
        f"{len(alloc)} samples, max {max(alloc, default=0) / 2**20:.0f} MiB")
    uuid = run["ranks"][0]["gpu_uuid"] if run["ranks"] else ""
    own = [g for g in run["gpus"] if uuid and g["uuid"] == uuid]

    def seen(field):
        return [g[field] for g in own if g[field] is not None]

    add("NVML reports the rank's own GPU",
        own and seen("util_percent") and max(seen("util_percent")) > 0
        and seen("memory_used_bytes") and seen("temperature_c") and seen("power_w")
        and max(seen("power_w")) > 0,
        f"uuid {uuid or '-'}: {len(own)} samples; "
        f"util max {max(seen('util_percent'), default=None)} %, "
        f"mem max {max(seen('memory_used_bytes'), default=0) / 2**30:.1f} GiB, "
        f"temp max {max(seen('temperature_c'), default=None)} °C, "
        f"power max {max(seen('power_w'), default=None)} W")
    for label, result in child["overhead"].items():
        target = TARGETS_PCT[result["nominal_ms"]]
        ok = result["overhead_pct"] <= target or not enforce_overhead
        add(f"trace_step overhead at {label}", ok,
            f"{result['overhead_pct']:+.2f} % (target ≤ {target:g} %): median "
            f"{result['traced_ms']:.3f} ms traced vs {result['plain_ms']:.3f} ms, "
            f"{result['steps']} steps each, batch {result['batch']}")
    return checks


# --- the child: one rank under `traceml run` (needs CUDA) ------------------------------------
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
        for owner, name in ((torch.cuda, "synchronize"), (torch.cuda.Event, "synchronize"),
                            (torch.cuda.Stream, "synchronize")):
            setattr(owner, name, self._wrap(getattr(owner, name)))

    def _wrap(self, original):
        def counted(*args, **kwargs):
            if self.armed:
                self.calls += 1
            return original(*args, **kwargs)

        return counted


def child(args) -> None:
    import torch
    from torch import nn

    import traceml
    from traceml import settings
    from traceml.sdk import session as session_mod

    if not torch.cuda.is_available():
        sys.exit("gpu_check: this needs a CUDA GPU (torch.cuda.is_available() is False)")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
    torch.manual_seed(0)
    torch.empty(1, device=device)  # the context exists before init(): the device is found at once
    traceml.init()
    session = session_mod.current()
    assert session is not None, "traceml.init() did not start a session"
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

    # 1. primitives
    probe = Workload(64)
    probe.block(True, 1)  # step 0: the SDK finds the device and starts its GPU clock
    timer = session.tracer.gpu_step_factory
    assert timer.record() is not None, "the SDK's GPU clock did not start"
    ev = torch.cuda.Event(enable_timing=True)
    ev2 = torch.cuda.Event(enable_timing=True)
    ev.record()
    ev2.record()
    torch.cuda.synchronize()
    on_gpu = torch.zeros(4, device=device)
    plain_to = torch.Tensor.to.__traceml_original__
    index = device.index
    micro = {
        "event_record_public_us": _per_call_us(
            lambda: torch.cuda.Event(enable_timing=True).record(), 200),
        "event_record_sdk_pooled_us": _per_call_us(lambda: timer.pool.give([timer.record()])),
        "event_query_us": _per_call_us(ev.query),
        "event_elapsed_time_us": _per_call_us(lambda: ev.elapsed_time(ev2)),
        "max_memory_allocated_us": _per_call_us(torch.cuda.max_memory_allocated, 200),
        "sdk_memory_read_and_reset_us": _per_call_us(
            lambda: (torch.cuda.memory_stats_as_nested_dict(index),
                     torch.cuda.reset_peak_memory_stats(index)), 200),
        "tensor_to_cuda_tensor_hooked_us": _per_call_us(lambda: on_gpu.to(device)),
        "tensor_to_cuda_tensor_plain_us": _per_call_us(lambda: plain_to(on_gpu, device)),
    }
    model = probe.model

    def empty_step():
        with traceml.trace_step(model):
            pass

    def empty_plain():
        with contextlib.nullcontext():
            pass

    micro["empty_trace_step_us"] = _per_call_us(empty_step, 500) - _per_call_us(empty_plain, 500)
    del probe

    # 2. overhead, A/B interleaved
    rounds, steps = (10, 20) if args.quick else (60, 25)
    overhead = {}
    for nominal in TARGETS_PCT:
        batch = calibrate(measure, nominal)
        w = Workload(batch)
        w.block(True, 10)
        w.block(False, 10)
        traced, plain = interleave_ab(w.block, rounds, steps)
        overhead[f"{nominal:g} ms"] = {
            "nominal_ms": nominal,
            "batch": batch,
            "steps": len(traced),
            "traced_ms": statistics.median(traced),
            "plain_ms": statistics.median(plain),
            "overhead_pct": overhead_pct(traced, plain),
            "overhead_mean_pct": (statistics.fmean(traced) / statistics.fmean(plain) - 1) * 100,
        }
        last = w
    # 3. the phase block, on the ~6 ms workload
    first = session.tracer.steps_completed
    last.block(True, 100 if args.quick else 300)
    report = {
        "every_n": settings.env_int(settings.GPU_TIMING_EVERY_N_STEPS),
        "memory_every_n": settings.env_int(settings.MEMORY_EVERY_N_STEPS),
        "block": [first, session.tracer.steps_completed],
        "sync_calls": counter.calls,
        "param_bytes": sum(p.numel() * p.element_size() for p in last.model.parameters()),
        "overhead": overhead,
        "micro_us": micro,
        "device": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
    }
    Path(args.report).write_text(json.dumps(report, indent=1))


# --- the parent -------------------------------------------------------------------------------
def _rows(db: sqlite3.Connection, sql: str) -> list[dict]:
    cur = db.execute(sql)
    names = [c[0] for c in cur.description]
    return [dict(zip(names, row)) for row in cur.fetchall()]


def load_run(run_dir: Path) -> dict:
    """The store's rows the checks need (the aggregator must have stopped)."""
    with sqlite3.connect(run_dir / "telemetry.sqlite") as db:
        return {
            "steps": _rows(db, "SELECT * FROM steps WHERE rank = 0 ORDER BY step"),
            "finish": _rows(db, "SELECT * FROM rank_finish"),
            "ranks": _rows(db, "SELECT * FROM ranks WHERE rank = 0"),
            "process": _rows(db, "SELECT * FROM process_samples WHERE rank = 0"),
            "gpus": _rows(db, "SELECT * FROM gpu_samples"),
        }


def parent(args) -> int:
    out = Path(args.out or tempfile.mkdtemp(prefix="gpu-check-")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    report_path = out / "child.json"
    argv = [
        sys.executable, "-m", "traceml", "run", str(Path(__file__).resolve()),
        "--aggregator-port", str(free_port()), "--logs-dir", str(out / "logs"),
        "--run-name", RUN_NAME, "--", "--child", "--report", str(report_path),
    ] + (["--quick"] if args.quick else [])
    env = dict(os.environ, TRACEML_SAMPLE_INTERVAL_SEC="0.5")
    t0 = time.monotonic()
    proc = subprocess.run(argv, env=env, timeout=args.timeout)
    print(f"gpu_check: traceml run exited {proc.returncode} after {time.monotonic() - t0:.0f} s")
    if proc.returncode != 0 or not report_path.exists():
        print("gpu_check: FAIL: the traced run did not complete; see", out / "logs")
        return 1
    child_report = json.loads(report_path.read_text())
    run = load_run(out / "logs" / RUN_NAME)
    first, last = child_report["block"]
    block = [s for s in run["steps"] if first <= s["step"] < last]
    phases = phase_table(block)
    checks = evaluate(run, child_report, enforce_overhead=not args.quick)

    print(f"\ndevice {child_report['device']}, torch {child_report['torch']}")
    print("\nprimitives (µs per call):")
    for name, us in child_report["micro_us"].items():
        print(f"  {name:36s} {us:8.2f}")
    print(f"\nphase medians over {sum(1 for s in block if s['gpu_step_us'] is not None)} "
          "GPU-timed steps of the ~6 ms block (ms):")
    print(f"  {'phase':10s} {'cpu':>8s} {'gpu':>8s} {'gpu/cpu':>8s}")
    for name, row in phases.items():
        fmt = [f"{v:8.3f}" if v is not None else f"{'-':>8s}"
               for v in (row["cpu_ms"], row["gpu_ms"], row["gpu_over_cpu"])]
        print(f"  {name:10s} {' '.join(fmt)}")
    print("\noverhead of trace_step, A/B interleaved:")
    for label, r in child_report["overhead"].items():
        print(f"  {label}: traced {r['traced_ms']:.3f} ms, plain {r['plain_ms']:.3f} ms, "
              f"ratio {r['traced_ms'] / r['plain_ms']:.4f} ({r['overhead_pct']:+.2f} % median, "
              f"{r['overhead_mean_pct']:+.2f} % mean), batch {r['batch']}")
    print("\nchecks:")
    for c in checks:
        print(f"  {'PASS' if c.ok else 'FAIL'}  {c.name}: {c.detail}")
    (out / "gpu_check.json").write_text(json.dumps(
        {"child": child_report, "phases": phases, "checks": [asdict(c) for c in checks]},
        indent=1))
    print(f"\ngpu_check: figures in {out / 'gpu_check.json'}")
    return 0 if all(c.ok for c in checks) else 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", help="directory for the run and the figures (default: a temp dir)")
    p.add_argument("--quick", action="store_true", help="shorter blocks; overhead informational")
    p.add_argument("--timeout", type=float, default=480.0, help="bound of the traced run, s")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--report", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args)
        return 0
    return parent(args)


if __name__ == "__main__":
    sys.exit(main())
