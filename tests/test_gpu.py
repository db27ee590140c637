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
import threading
import time
import zlib

import pytest
import torch
from conftest import ROOT
from live_aggregator import LiveAggregator

from traceml import wire
from traceml.sdk import client as client_mod
from traceml.sdk import timing
from traceml.sdk.device import RankDevice
from traceml.sdk.memory import StepMemory
from traceml.sdk.step import StepMeasurement, StepTracer
from traceml.sdk.timing import BACKWARD, FORWARD, H2D, OPTIMIZER, GpuTimer

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


GPU_CHECK = ROOT / "benchmarks" / "gpu_check.py"


def _load_gpu_check():
    sys.path.insert(0, str(ROOT / "benchmarks"))  # as when it runs: its helpers are beside it
    spec = importlib.util.spec_from_file_location("gpu_check", GPU_CHECK)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module
    spec.loader.exec_module(module)
    return module


gpu_check = _load_gpu_check()


def _gpu_check_quick(out_dir, timeout_s: float) -> subprocess.CompletedProcess:
    """``benchmarks/gpu_check.py --quick --out OUT_DIR`` run to its end (at most ``timeout_s``
    seconds); the CompletedProcess (text, captured)."""
    return subprocess.run(
        [sys.executable, str(GPU_CHECK), "--quick", "--out", str(out_dir)],
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


# --- a stand-in GPU clock ----------------------------------------------------------------------
class FakeGpu:
    """A GPU whose clock the test sets (``now_ms``) and whose work completes when told
    (``done_ms``): an event recorded at time t has completed once ``done_ms >= t``."""

    def __init__(self) -> None:
        self.now_ms = 0.0
        self.done_ms = -1.0
        self.capturing = False
        self.records = 0
        self.queries = 0
        self.stream = "main"  # the training thread's current stream
        self.lagging: set[str] = set()  # streams whose work has not completed at all


class FakeEvent:
    def __init__(self, gpu: FakeGpu) -> None:
        self.gpu = gpu
        self.t = None
        self.stream = None

    def record(self, stream) -> None:
        self.t = self.gpu.now_ms
        self.stream = stream
        self.gpu.records += 1

    def query(self) -> bool:
        self.gpu.queries += 1
        return (
            self.t is not None
            and self.t <= self.gpu.done_ms
            and self.stream not in self.gpu.lagging
        )

    def elapsed_time(self, end: FakeEvent) -> float:
        assert self.query() and end.query(), "elapsed_time() on a pending event"
        return end.t - self.t


class FakeCuda:
    """The :class:`traceml.sdk.timing.TorchCuda` interface over a :class:`FakeGpu`."""

    def __init__(self, gpu: FakeGpu) -> None:
        self.gpu = gpu

    def new_event(self) -> FakeEvent:
        return FakeEvent(self.gpu)

    def current_stream(self):
        return self.gpu.stream

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
        True,
        False,
        False,
        False,
        True,
        False,
        False,
        False,
        True,
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
    assert fields == {
        "gpu_step_us": 10_200,
        "gpu_h2d_us": 250,
        "gpu_forward_us": 4_000,
        "gpu_backward_us": 2_000,
        "gpu_optimizer_us": 500,
    }
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


def test_finish_waits_for_every_pending_step_not_only_the_last():
    """Step 0's phases ran on a side stream that is still busy while step 2 (the last) has
    completed: the exit path waits for step 0 too (before the fix: it returned at once and
    step 0 went out without GPU fields)."""
    gpu = FakeGpu()
    timer = fake_timer(gpu, 2, finish_wait_s=5.0)
    gpu.stream = "side"
    first = timer(0)
    at(gpu, 1.0), first.close()
    gpu.stream = "main"
    timer(1)
    last = timer(2)
    at(gpu, 3.0), last.close()
    gpu.done_ms, gpu.lagging = 3.0, {"side"}
    assert last.ready() and not first.ready()
    threading.Timer(0.2, gpu.lagging.clear).start()
    t0 = time.monotonic()
    timer.close()
    assert 0.15 <= time.monotonic() - t0 < 4.0
    fields = {}
    first.fill(fields)
    assert fields == {"gpu_step_us": 1000}


def test_a_cancelled_phase_gives_its_event_back():
    """A host ``.to(dtype)`` on a timed step begins an H2D phase and cancels it: its start
    event goes back to the pool (before the fix: one event lost per such call)."""
    gpu = FakeGpu()
    timer = fake_timer(gpu, 1)
    step = timer(0)
    for _ in range(3):
        step.begin(H2D)
        step.cancel(H2D)
    assert len(timer.pool._free) == 1 and gpu.records == 1 + 3


class StandInGraph:
    """``capture_begin``/``capture_end`` as ``torch.cuda.CUDAGraph`` has them; ``began``
    notes the count of captures :data:`traceml.sdk.timing.CAPTURES` saw as its capture began."""

    def __init__(self) -> None:
        self.began = None

    def capture_begin(self, pool=None, capture_error_mode="global"):
        if capture_error_mode == "bad":
            raise RuntimeError("capture could not begin")
        self.began = timing.CAPTURES.active

    def capture_end(self):
        pass


@pytest.fixture
def graph_class(monkeypatch):
    """StandInGraph with the capture guard installed; the process's count restored after."""
    monkeypatch.setattr(timing, "CAPTURES", timing.CaptureGuard())

    class Graph(StandInGraph):
        pass

    timing.install_capture_guard(Graph)
    return Graph


def test_no_event_is_queried_or_recorded_while_any_capture_is_under_way(graph_class):
    """A capture begun on another thread (its stream is not the training thread's current
    one): while it runs, the sender's ready() makes no query and the training thread records
    nothing; once it ends, the pending step resolves."""
    gpu = FakeGpu()
    timer = fake_timer(gpu, 1)
    step = timer(0)
    at(gpu, 2.0), step.close()
    gpu.done_ms = 2.0
    graph = graph_class()
    capturing = threading.Thread(target=graph.capture_begin)
    capturing.start()
    capturing.join()
    assert graph.began == 1 and timing.CAPTURES.active == 1
    queries, records = gpu.queries, gpu.records
    assert not step.ready() and timer(1) is None
    assert (gpu.queries, gpu.records) == (queries, records)
    graph.capture_end()
    assert timing.CAPTURES.active == 0 and step.ready()
    with pytest.raises(RuntimeError):
        graph.capture_begin(capture_error_mode="bad")  # a failed begin is no capture
    assert timing.CAPTURES.active == 0
    timing.install_capture_guard(graph_class)  # idempotent: wrapped once
    assert graph_class.capture_begin.__traceml_original__ is StandInGraph.capture_begin


def test_a_capture_waits_for_queries_in_flight(graph_class):
    """The sender is half-way through its queries when a capture begins: the capture begins
    only after the last query returned (the race the stream check cannot close)."""
    gpu = FakeGpu()
    timer = fake_timer(gpu, 1)
    step = timer(0)
    at(gpu, 1.0), step.close()
    gpu.done_ms = 1.0
    order = []
    in_query, release = threading.Event(), threading.Event()
    query = step._stop.query

    def slow_query():
        in_query.set()
        release.wait(5)
        order.append("query")
        return query()

    step._stop.query = slow_query
    sender = threading.Thread(target=step.ready)
    sender.start()
    assert in_query.wait(5)
    graph = graph_class()
    capture = threading.Thread(target=lambda: (graph.capture_begin(), order.append("begin")))
    capture.start()
    time.sleep(0.05)
    assert order == []  # the capture is held back while the query is in flight
    release.set()
    sender.join(5)
    capture.join(5)
    assert len(order) >= 2 and order == ["query"] * (len(order) - 1) + ["begin"]


def test_the_capture_guard_wraps_torch_cuda_graph(monkeypatch):
    """On the real class (a CPU build: its capture cannot begin, and the count stays 0)."""
    graph = torch.cuda.CUDAGraph
    monkeypatch.setattr(timing, "CAPTURES", timing.CaptureGuard())
    monkeypatch.setattr(graph, "capture_begin", graph.capture_begin)  # restored after
    monkeypatch.setattr(graph, "capture_end", graph.capture_end)
    original = graph.capture_begin
    timing.install_capture_guard()
    assert graph.capture_begin.__traceml_original__ is original
    with pytest.raises(AttributeError):  # object() is no CUDAGraph: torch's method refuses it
        graph.capture_begin(object())
    assert timing.CAPTURES.active == 0


@pytest.mark.aggregator
@pytest.mark.slow
def test_unresolved_steps_are_counted_and_sent_without_gpu_fields(tmp_path):
    """Through the real tracer, client, aggregator and store: steps 0, 2, 4 are GPU-timed;
    the GPU finishes steps 0 and 2 only; at the end step 4 is sent without GPU fields and
    counted in RankFinish.steps_gpu_unresolved."""
    aggregator = LiveAggregator(tmp_path / "run", "gpu-unit", world_size=1).start()
    try:
        client = client_mod.TelemetryClient(
            aggregator.target,
            "gpu-unit",
            rank=0,
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


@pytest.mark.aggregator
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
        result = subprocess.run(
            [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
        )
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
        rows.append(
            {
                "step": s,
                "step_us": 6000,
                "input_wait_us": 100 if s else None,
                "h2d_us": 20,
                "forward_us": 500,
                "backward_us": 900,
                "optimizer_us": 300,
                "gpu_step_us": 5500 if timed else None,
                "gpu_h2d_us": 150 if timed else None,
                "gpu_forward_us": 1500 if timed else None,
                "gpu_backward_us": 3000 if timed else None,
                "gpu_optimizer_us": 500 if timed else None,
                "peak_allocated_bytes": 4000 if s % m == 0 else None,
                "peak_reserved_bytes": 8000 if s % m == 0 else None,
            }
        )
    uuid = "GPU-0a1b"
    run = {
        "steps": rows,
        "finish": [{"steps_gpu_unresolved": 0}],
        "ranks": [{"gpu_uuid": uuid}],
        "process": [{"gpu_allocated_bytes": 4000}],
        "gpus": [
            {
                "uuid": uuid,
                "util_percent": 87.0,
                "memory_used_bytes": 9000,
                "temperature_c": 51.0,
                "power_w": 420.0,
            }
        ],
    }
    child = {
        "every_n": n,
        "memory_every_n": m,
        "block": [0, steps],
        "sync_calls": 0,
        "param_bytes": 1000,
        "overhead": {
            "2 ms": {
                "nominal_ms": 2.0,
                "overhead_pct": 1.2,
                "traced_ms": 2.02,
                "plain_ms": 2.0,
                "steps": 100,
                "batch": 512,
            }
        },
    }
    return run, child


def test_gpu_check_passes_a_correct_run():
    run, child = _good_run()
    checks = gpu_check.evaluate(run, child)
    assert [c.name for c in checks if not c.ok] == []
    assert [c.ok for c in gpu_check.overhead_checks(child)] == [True]
    table = gpu_check.phase_table(run["steps"])
    assert table["forward"] == {"cpu_ms": 0.5, "gpu_ms": 1.5, "gpu_over_cpu": 3.0}


def test_gpu_check_expects_the_memory_reading_of_step_0():
    """The SDK reads the peaks on step 0 too (before the fix the check wanted none there, so
    its first run on a GPU would have failed a correct SDK)."""
    run, child = _good_run()
    assert run["steps"][0]["peak_allocated_bytes"] == 4000
    run["steps"][0].update(peak_allocated_bytes=None, peak_reserved_bytes=None)
    failing = [c.name for c in gpu_check.evaluate(run, child) if not c.ok]
    assert failing == ["memory peaks on one step in M"]


def test_gpu_check_overhead_is_informational_under_quick():
    run, child = _good_run()
    child["overhead"]["2 ms"].update(overhead_pct=3.5)
    assert [c.ok for c in gpu_check.overhead_checks(child)] == [False]
    assert [c.ok for c in gpu_check.overhead_checks(child, enforce=False)] == [True]


def _sleep_steps(forward_ms=4.0, backward_ms=8.0, optimizer_ms=2.0, n=5):
    return [
        {
            "step": i,
            "step_us": 20_000,
            "h2d_us": None,
            "forward_us": 300,
            "backward_us": 500,
            "optimizer_us": 100,
            "gpu_step_us": 15_000,
            "gpu_forward_us": int(forward_ms * 1000),
            "gpu_backward_us": int(backward_ms * 1000),
            "gpu_optimizer_us": int(optimizer_ms * 1000),
        }
        for i in range(n)
    ]


def test_gpu_check_accuracy_holds_phases_to_ten_percent():
    known = gpu_check.SLEEP_MS
    assert all(c.ok for c in gpu_check.accuracy_checks(_sleep_steps(), known))
    off = gpu_check.accuracy_checks(_sleep_steps(backward_ms=16.0), known)  # counted twice
    assert [c.name for c in off if not c.ok] == ["GPU backward within ±10%"]
    over = _sleep_steps()
    over[2]["backward_us"] = 30_000  # a phase longer than its step
    untimed = _sleep_steps()
    untimed[1]["gpu_step_us"] = None
    assert [c.name for c in gpu_check.accuracy_checks(over, known) if not c.ok] == [
        "CPU phases never exceed the step"
    ]
    assert [c.name for c in gpu_check.accuracy_checks(untimed, known) if not c.ok] == [
        "every step GPU-timed"
    ]


def test_gpu_check_devices_line():
    ranks = [
        {"rank": 0, "device": "cuda:0", "gpu_uuid": "GPU-aa"},
        {"rank": 1, "device": "cuda:1", "gpu_uuid": "GPU-bb"},
    ]
    reports = [
        {"rank": 0, "uuid": "aa", "other_contexts": []},
        {"rank": 1, "uuid": "bb", "other_contexts": []},
    ]
    assert all(c.ok for c in gpu_check.device_checks(ranks, reports, {0: 3, 1: 3}))
    ranks[1].update(device="cuda:0", gpu_uuid="GPU-aa")  # every rank on GPU 0 (the old bug)
    reports[1]["other_contexts"] = [0]
    assert [c.ok for c in gpu_check.device_checks(ranks, reports, {0: 3, 1: 0})] == [
        False,
        False,
        False,
    ]


def _nccl_report(**over) -> dict:
    """Line i)'s child report as a correct run writes it (``over`` replaces keys)."""
    from traceml.sdk.collectives import OPS

    calls = list(OPS) * 2  # sync, then async
    report = {
        "calls": calls,
        "explicit": [
            {
                "op": n,
                "group": "default",
                "seq": i + 1,
                "nbytes": 0 if n == "barrier" else 4096,
                "done": True,
            }
            for i, n in enumerate(calls)
        ],
        "equal": [True] * len(calls),
        "buckets": 10,
        "buckets_done": 10,
        "sync_calls": 0,
        "steps": 10,
    }
    return report | over


def _ddp_steps(**over) -> list[dict]:
    crc = zlib.crc32(b"default")
    return [
        {"step": i, "comm_us": 40, "arrive_group": crc, "arrive_seq": i + 1} | over
        for i in range(10)
    ]


def test_gpu_check_nccl_line():
    assert all(c.ok for c in gpu_check.nccl_checks(_nccl_report(), _ddp_steps()))
    report = _nccl_report()
    report["explicit"][3]["done"] = False  # an async completion never seen
    report["explicit"][5]["nbytes"] = 8192
    report["equal"][0] = False
    assert [c.name for c in gpu_check.nccl_checks(report, _ddp_steps()) if not c.ok] == [
        "bytes: the rank's input (4 KiB; a barrier 0)",
        "every explicit collective completed (async: the CUDA future's callback)",
        "results equal the untraced calls'",
    ]
    twice = _nccl_report()
    twice["explicit"].append(dict(twice["explicit"][0], seq=17))  # one call recorded twice
    fails = [c.name for c in gpu_check.nccl_checks(twice, _ddp_steps(comm_us=None)) if not c.ok]
    assert fails == [
        "every explicit collective recorded once, in call order",
        "bytes: the rank's input (4 KiB; a barrier 0)",
        "every traced DDP step has comm and its arrival at the default group",
    ]
    synced = _nccl_report(sync_calls=2, buckets_done=9)
    assert [c.ok for c in gpu_check.nccl_checks(synced, _ddp_steps())] == [True] * 4 + [
        False,
        True,
        False,
    ]
    withheld = "NCCL: an arrival is when the host enqueued the collective"
    skew = {"last_pct": {"0": 0.0, "1": 100.0}, "late_ms": {"1": 31.0}, "withheld": withheld}
    summary = {"analysis": {"skew": skew}, "findings": {"step_time": []}}
    assert [c.ok for c in gpu_check.skew_checks(summary)] == [True, True]
    skew["late_ms"]["1"] = 15.0  # half the planted delay
    summary["findings"]["step_time"].append({"kind": "LATE_ARRIVAL"})
    assert [c.ok for c in gpu_check.skew_checks(summary)] == [False, False]
    none = {"analysis": {"skew": None}, "findings": {"step_time": []}}
    assert [c.ok for c in gpu_check.skew_checks(none)] == [False, False]


def test_gpu_check_lines_read_pass_fail_skip():
    line = gpu_check.Line("b", "accuracy", [gpu_check.Check("x", True, "1 ms")])
    assert line.text().splitlines() == ["b) PASS accuracy", "     PASS x: 1 ms"]
    line.checks.append(gpu_check.Check("y", False, "2 ms"))
    assert line.verdict == "FAIL"
    skipped = gpu_check.Line("g", "two ranks", skip="needs 2 GPUs or more, 1 visible")
    assert skipped.text() == "g) SKIP two ranks: needs 2 GPUs or more, 1 visible"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the exit without a GPU")
def test_gpu_check_without_cuda_says_so_and_exits_3(tmp_path):
    result = _gpu_check_quick(tmp_path, 300)
    assert result.returncode == gpu_check.EXIT_NO_CUDA == 3, result.stderr
    assert result.stdout.splitlines() == [
        "gpu_check: no CUDA device (a CPU build of torch); nothing checked, exit 3"
    ]


BREAKAGES = {
    "sdk never synchronizes": lambda run, child: child.update(sync_calls=3),
    "one step in N GPU-timed": lambda run, child: run["steps"][2].update(gpu_step_us=None),
    "GPU events all resolved": lambda run, child: run["finish"][0].update(steps_gpu_unresolved=2),
    "GPU phases on every timed step, H2D seen on the GPU clock": lambda run, child: run["steps"][
        4
    ].update(gpu_h2d_us=None),
    "H2D seen on the CPU clock": lambda run, child: run["steps"][3].update(h2d_us=None),
    "memory peaks on one step in M": lambda run, child: run["steps"][3].update(
        peak_allocated_bytes=5
    ),
    "NVML reports the rank's own GPU": lambda run, child: run["ranks"][0].update(
        gpu_uuid="GPU-other"
    ),
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
    result = _gpu_check_quick(tmp_path, 600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]


@pytest.mark.aggregator
@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
@pytest.mark.parametrize("set_device", [True, False])
def test_a_rank_on_device_1_never_creates_a_context_on_device_0(tmp_path, set_device):
    """With ``set_device(1)``, and without it (``.to("cuda:1")`` only: the current device
    stays 0, where the rank must still create no context)."""
    code = textwrap.dedent(
        """
        import sys, time, torch, traceml
        if sys.argv[2] == "True":
            torch.cuda.set_device(1)
        assert traceml.init(sys.argv[1], "ctx")  # before any CUDA work: nothing to find yet
        model = torch.nn.Linear(64, 64).to("cuda:1")
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(30):
            with traceml.trace_step(model):
                model(torch.randn(32, 64).to("cuda:1", non_blocking=True)).sum().backward()
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
        argv = [sys.executable, "-c", code, aggregator.target, str(set_device)]
        result = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    finally:
        aggregator.stop()
    assert result.returncode == 0, result.stderr
    assert "context on device 0: False" in result.stdout
    assert aggregator.query("SELECT device FROM ranks") == [("cuda:1",)]
    assert aggregator.query("SELECT COUNT(gpu_forward_us) FROM steps") == [(30,)]
