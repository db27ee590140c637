"""The GPU clock, step memory and the GPU verification script.

Without CUDA (this machine, CI): the CPU-side logic of :mod:`traceml.sdk.timing` runs against a
stand-in GPU clock (CUDA cannot run here), through the real step tracer, telemetry client,
aggregator and SQLite store; and the pure logic of ``benchmarks/gpu_check.py`` (calibration,
A/B interleaving, the checks) is exercised. With CUDA, the GPU tests run the real thing:
``gpu_check.py --quick`` end to end, and a rank on device 1 that must leave device 0 alone.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from conftest import ROOT
from live_aggregator import LiveAggregator
from traceml import wire
from traceml.sdk import client as client_mod
from traceml.sdk.device import RankDevice
from traceml.sdk.memory import StepMemory
from traceml.sdk.step import StepMeasurement, StepTracer
from traceml.sdk.timing import BACKWARD, FORWARD, H2D, OPTIMIZER, PHASE_FIELDS, GpuTimer

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _load_gpu_check():
    sys.path.insert(0, str(ROOT / "benchmarks"))  # as when it runs: its helpers are beside it
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module
    spec.loader.exec_module(module)
    return module


gpu_check = _load_gpu_check()


# --- a stand-in GPU clock ----------------------------------------------------------------------
class FakeGpu:
    """A GPU whose clock the test sets (``now_ms``) and whose work completes when told
    (``done_ms``): an event recorded at time t has completed once ``done_ms >= t``."""

    def __init__(self) -> None:
        self.now_ms = 0.0
        self.done_ms = -1.0
        self.capturing = False
        self.records = 0


class FakeEvent:
    def __init__(self, gpu: FakeGpu) -> None:
        self.gpu = gpu
        self.t = None

    def record(self, stream) -> None:
        self.t = self.gpu.now_ms
        self.gpu.records += 1

    def query(self) -> bool:
        return self.t is not None and self.t <= self.gpu.done_ms

    def elapsed_time(self, end: "FakeEvent") -> float:
        assert self.query() and end.query(), "elapsed_time() on a pending event"
        return end.t - self.t


class FakeCuda:
    """The :class:`traceml.sdk.timing.TorchCuda` interface over a :class:`FakeGpu`."""

    def __init__(self, gpu: FakeGpu) -> None:
        self.gpu = gpu

    def new_event(self) -> FakeEvent:
        return FakeEvent(self.gpu)

    def current_stream(self):
        return None

    def capturing(self) -> bool:
        return self.gpu.capturing

    def device_guard(self):
        return contextlib.nullcontext()


def fake_timer(gpu: FakeGpu, every_n: int, **kwargs) -> GpuTimer:
    device = RankDevice()
    device.index = 0  # as if the training thread had found cuda:0
    return GpuTimer(device, every_n, cuda=lambda index: FakeCuda(gpu), **kwargs)


def at(gpu: FakeGpu, ms: float) -> FakeGpu:
    gpu.now_ms = ms
    return gpu


# --- timing ------------------------------------------------------------------------------------
def test_one_step_in_n_is_gpu_timed():
    gpu = FakeGpu()
    timer = fake_timer(gpu, 4)
    assert [timer(step) is not None for step in range(9)] == [
        True, False, False, False, True, False, False, False, True
    ]
    assert gpu.records == 3  # one start event per timed step, nothing on the others


def test_device_callback_once_when_found():
    calls = []
    device = RankDevice()  # not found yet: no CUDA state in this process
    timer = GpuTimer(
        device, 1, on_device=lambda: calls.append(1), cuda=lambda i: FakeCuda(FakeGpu())
    )
    assert timer(0) is None and calls == []
    device.index = 0
    assert timer(1) is not None and timer(2) is not None
    assert calls == [1]


def test_phases_summed_per_step_in_microseconds():
    gpu = FakeGpu()
    timer = fake_timer(gpu, 1)
    step = timer(0)  # opens at t=0
    at(gpu, 1.0), step.begin(H2D), at(gpu, 1.25), step.end(H2D)
    at(gpu, 2.0), step.begin(FORWARD), at(gpu, 5.5), step.end(FORWARD)
    at(gpu, 6.0), step.begin(FORWARD), at(gpu, 6.5), step.end(FORWARD)  # a second forward call
    at(gpu, 7.0), step.begin(BACKWARD), at(gpu, 9.0), step.end(BACKWARD)
    at(gpu, 9.5), step.begin(OPTIMIZER), at(gpu, 10.0), step.end(OPTIMIZER)
    at(gpu, 10.2), step.close()
    gpu.done_ms = 10.1
    assert not step.ready()  # the end event is still pending: nothing is read, nothing waits
    gpu.done_ms = 10.2
    assert step.ready()
    fields = {}
    step.fill(fields)
    assert fields == {"gpu_step_us": 10_200, "gpu_h2d_us": 250, "gpu_forward_us": 4_000,
                      "gpu_backward_us": 2_000, "gpu_optimizer_us": 500}
    assert len(timer.pool._free) == 2 + 2 * 5  # every event back in the pool once read
    assert timer.pool.take() is not None and gpu.records == 12


def test_cancelled_phase_unused_phase_and_graph_capture():
    gpu = FakeGpu()
    timer = fake_timer(gpu, 1)
    step = timer(0)
    step.begin(H2D)
    step.cancel(H2D)  # a .to() that was not a host-to-device copy
    step.end(H2D)  # an end without a begin records nothing
    at(gpu, 3.0), step.close()
    gpu.done_ms = 3.0
    fields = {}
    assert step.ready()
    step.fill(fields)
    assert fields == {"gpu_step_us": 3_000}  # phases that did not happen are absent, never 0
    gpu.capturing = True  # events must not be recorded into a CUDA graph capture
    assert timer(1) is None


def test_a_step_converted_before_its_events_completed_has_no_gpu_fields():
    gpu = FakeGpu()
    step = fake_timer(gpu, 1)(0)
    at(gpu, 1.0), step.close()
    assert not step.ready()
    fields = {}
    step.fill(fields)
    assert fields == {}
    gpu.done_ms = 5.0  # completing later changes nothing: the client counted it unresolved
    step.fill(fields)
    assert fields == {}


def test_finish_wait_is_bounded_and_ends_when_events_complete():
    gpu = FakeGpu()
    timer = fake_timer(gpu, 1, finish_wait_s=0.3)
    step = timer(0)
    at(gpu, 1.0), step.close()
    t0 = time.monotonic()
    timer.close()  # never completes: gives up after the bound
    assert 0.3 <= time.monotonic() - t0 < 2.0
    gpu.done_ms = 1.0
    t0 = time.monotonic()
    timer.close()
    assert time.monotonic() - t0 < 0.1 and step.ready()


@pytest.mark.slow
def test_unresolved_steps_are_counted_and_sent_without_gpu_fields(tmp_path):
    """Through the real tracer, client, aggregator and store: steps 0, 2, 4 are GPU-timed;
    the GPU finishes steps 0 and 2 only; at the end step 4 is sent without GPU fields and
    counted in RankFinish.steps_gpu_unresolved."""
    aggregator = LiveAggregator(tmp_path / "run", "gpu-unit", world_size=1).start()
    try:
        client = client_mod.TelemetryClient(
            aggregator.target, "gpu-unit", rank=0,
            config=client_mod.ClientConfig(flush_interval_s=0.05),
        )
        gpu = FakeGpu()
        tracer = StepTracer(lambda m: client.submit(client_mod.STEPS, m), time.perf_counter_ns())
        tracer.gpu_step_factory = fake_timer(gpu, 2)
        for step in range(6):
            at(gpu, 10.0 * step)
            tracer.begin()
            at(gpu, 10.0 * step + 4.0)
            tracer.end()
            if step == 2:
                gpu.done_ms = 24.0  # the GPU has finished step 2
        time.sleep(0.3)  # the sender sends steps 0-3 and waits at step 4 (pending)
        finish = wire.RankFinish(steps_completed=6, end_state=wire.EndState.END_STATE_COMPLETED)
        assert client.close(finish, timeout_s=10)
    finally:
        aggregator.stop()
    rows = aggregator.query("SELECT step, gpu_step_us FROM steps ORDER BY step")
    assert rows == [(0, 4000), (1, None), (2, 4000), (3, None), (4, None), (5, None)]
    assert aggregator.query("SELECT steps_gpu_unresolved FROM rank_finish") == [(1,)]


def test_step_memory_fails_open_once(capsys):
    """An allocator that cannot be read costs one warning, not the step."""

    def broken(index: int) -> dict:
        raise RuntimeError("CUDA error: unspecified launch failure")

    device = RankDevice()
    device.index = 0
    reader = StepMemory(device, 1, stats=broken)
    measurement = StepMeasurement()
    for step in range(3):
        measurement.step = step
        reader(measurement)
    assert measurement.peak_allocated_bytes is None
    assert capsys.readouterr().err.count("reading step memory peaks failed") == 1


def nested_stats(allocated_peak: int, reserved_peak: int) -> dict:
    """The part of ``torch.cuda.memory_stats_as_nested_dict`` that StepMemory reads."""
    return {
        "allocated_bytes": {"all": {"peak": allocated_peak, "current": 1}},
        "reserved_bytes": {"all": {"peak": reserved_peak, "current": 1}},
    }


def test_step_memory_reads_the_running_peaks_and_never_resets_them(monkeypatch):
    """Every N-th step carries the allocator's own peaks as they stand; the user's
    ``max_memory_allocated()`` is never reset (before the fix: at the first step and on every
    read). A user's own reset shows as a drop."""

    def no_reset(*args, **kwargs):
        raise AssertionError("TraceML reset the user's peak memory statistics")

    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", no_reset)
    peaks = iter([(100, 200), (150, 260), (90, 260)])  # the user reset the peaks before step 20
    reads: list[int] = []

    def stats(index: int) -> dict:
        reads.append(index)
        return nested_stats(*next(peaks))

    device = RankDevice()
    device.index = 3
    reader = StepMemory(device, 10, stats=stats)
    got = {}
    for step in range(25):
        m = StepMeasurement()
        m.step = step
        reader(m)
        if m.peak_allocated_bytes is not None:
            got[step] = (m.peak_allocated_bytes, m.peak_reserved_bytes)
    assert got == {0: (100, 200), 10: (150, 260), 20: (90, 260)}
    assert reads == [3, 3, 3]


@needs_cuda
def test_the_users_max_memory_allocated_survives_traced_steps(tmp_path):
    """On a real GPU: a 256 MiB tensor allocated and freed before training sets the user's
    peak; 25 traced steps of a small model later, ``max_memory_allocated()`` still says so,
    and the steps' readings carry that running peak."""
    script = textwrap.dedent(
        """
        import torch, traceml
        big = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
        del big
        before = torch.cuda.max_memory_allocated()
        traceml.init()
        model = torch.nn.Linear(64, 64).cuda()
        for _ in range(25):
            with traceml.trace_step(model):
                model(torch.randn(8, 64, device="cuda")).sum().backward()
        torch.cuda.synchronize()
        print("peaks", before, torch.cuda.max_memory_allocated())
        """
    )
    with LiveAggregator(tmp_path / "run", "gpu-peaks") as agg:
        env = {**os.environ, "TRACEML_AGGREGATOR": agg.target, "TRACEML_RUN_NAME": "gpu-peaks"}
        result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                                text=True, timeout=300)
        assert result.returncode == 0, result.stderr
        before, after = map(int, result.stdout.split("peaks")[1].split())
        assert before >= 256 << 20 and after == before
        assert agg.stop() == 0
        readings = agg.query(
            "SELECT step, peak_allocated_bytes FROM steps WHERE peak_allocated_bytes IS NOT NULL"
            " ORDER BY step"
        )
    assert [s for s, _ in readings] == [0, 10, 20]
    assert all(b == before for _, b in readings)


# --- gpu_check's logic ---------------------------------------------------------------------------
def test_calibrate_finds_the_smallest_batch_reaching_the_target():
    probes = []

    def measure(batch):  # a 0.5 ms floor plus 10 µs per sample
        probes.append(batch)
        return 0.5 + 0.01 * batch

    batch = gpu_check.calibrate(measure, 2.0)
    assert 150 <= batch <= 155 and len(probes) < 15
    assert gpu_check.calibrate(lambda b: 9.0, 2.0) == 64  # already slower than the target
    assert gpu_check.calibrate(lambda b: 0.1, 2.0, limit=1024) == 1024


def test_interleave_alternates_the_variants_and_measures_overhead():
    order = []

    def block(traced, steps):
        order.append(traced)
        return [1.03 if traced else 1.0] * steps

    traced, plain = gpu_check.interleave_ab(block, rounds=4, steps=5)
    assert order == [True, False, False, True, True, False, False, True]
    assert len(traced) == len(plain) == 20
    assert gpu_check.overhead_pct(traced, plain) == pytest.approx(3.0)


def _good_run(n=2, m=2, steps=8):
    rows = []
    for s in range(steps):
        timed = s % n == 0
        rows.append({
            "step": s, "step_us": 6000, "input_wait_us": 100 if s else None, "h2d_us": 20,
            "forward_us": 500, "backward_us": 900, "optimizer_us": 300,
            "gpu_step_us": 5500 if timed else None, "gpu_h2d_us": 150 if timed else None,
            "gpu_forward_us": 1500 if timed else None, "gpu_backward_us": 3000 if timed else None,
            "gpu_optimizer_us": 500 if timed else None,
            "peak_allocated_bytes": 4000 if s % m == 0 and s else None,
            "peak_reserved_bytes": 8000 if s % m == 0 and s else None,
        })
    uuid = "GPU-0a1b"
    run = {
        "steps": rows,
        "finish": [{"steps_gpu_unresolved": 0}],
        "ranks": [{"gpu_uuid": uuid}],
        "process": [{"gpu_allocated_bytes": 4000}],
        "gpus": [{"uuid": uuid, "util_percent": 87.0, "memory_used_bytes": 9000,
                  "temperature_c": 51.0, "power_w": 420.0}],
    }
    child = {
        "every_n": n, "memory_every_n": m, "block": [0, steps], "sync_calls": 0,
        "param_bytes": 1000,
        "overhead": {"2 ms": {"nominal_ms": 2.0, "overhead_pct": 1.2, "traced_ms": 2.02,
                              "plain_ms": 2.0, "steps": 100, "batch": 512}},
    }
    return run, child


def test_gpu_check_passes_a_correct_run():
    run, child = _good_run()
    checks = gpu_check.evaluate(run, child)
    assert [c.name for c in checks if not c.ok] == []
    table = gpu_check.phase_table(run["steps"])
    assert table["forward"] == {"cpu_ms": 0.5, "gpu_ms": 1.5, "gpu_over_cpu": 3.0}


BREAKAGES = {
    "sdk never synchronizes": lambda run, child: child.update(sync_calls=3),
    "one step in N GPU-timed": lambda run, child: run["steps"][2].update(gpu_step_us=None),
    "GPU events all resolved":
        lambda run, child: run["finish"][0].update(steps_gpu_unresolved=2),
    "GPU phases on every timed step, H2D seen on the GPU clock":
        lambda run, child: run["steps"][4].update(gpu_h2d_us=None),
    "H2D seen on the CPU clock": lambda run, child: run["steps"][3].update(h2d_us=None),
    "memory peaks on one step in M":
        lambda run, child: run["steps"][3].update(peak_allocated_bytes=5),
    "NVML reports the rank's own GPU":
        lambda run, child: run["ranks"][0].update(gpu_uuid="GPU-other"),
    "trace_step overhead at 2 ms":
        lambda run, child: child["overhead"]["2 ms"].update(overhead_pct=3.5),
}


@pytest.mark.parametrize("failing", BREAKAGES)
def test_gpu_check_catches_each_breakage(failing):
    run, child = _good_run()
    BREAKAGES[failing](run, child)
    assert [c.name for c in gpu_check.evaluate(run, child) if not c.ok] == failing.split(", ")


# --- on a GPU --------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.slow
@needs_cuda
def test_gpu_check_quick_passes(tmp_path):
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--quick", "--out",
         str(tmp_path)],
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_a_rank_on_device_1_never_creates_a_context_on_device_0(tmp_path):
    code = textwrap.dedent(
        """
        import sys, time, torch, traceml
        torch.cuda.set_device(1)
        model = torch.nn.Linear(64, 64).cuda()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        assert traceml.init(sys.argv[1], "ctx")
        for _ in range(30):
            with traceml.trace_step(model):
                model(torch.randn(32, 64).cuda(non_blocking=True)).sum().backward()
                opt.step()
        time.sleep(2.5)  # samplers tick, the sender resolves events
        traceml.shutdown()
        print("context on device 0:", torch._C._cuda_hasPrimaryContext(0))
        """
    )
    aggregator = LiveAggregator(tmp_path / "run", "ctx", world_size=1).start()
    try:
        env = dict(
            os.environ, TRACEML_SAMPLE_INTERVAL_SEC="0.2", TRACEML_GPU_TIMING_EVERY_N_STEPS="1"
        )
        env.pop("TRACEML_LAUNCHED", None)
        result = subprocess.run([sys.executable, "-c", code, aggregator.target], env=env,
                                capture_output=True, text=True, timeout=300)
    finally:
        aggregator.stop()
    assert result.returncode == 0, result.stderr
    assert "context on device 0: False" in result.stdout
    assert aggregator.query("SELECT device FROM ranks") == [("cuda:1",)]
    assert aggregator.query("SELECT COUNT(gpu_forward_us) FROM steps") == [(30,)]

