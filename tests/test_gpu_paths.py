"""The GPU paths' logic that runs without a GPU (issue 29): which device a rank reports,
reentrant backward and optimizer steps in backward, the FLOPs dtype under FSDP mixed
precision, the torch floor, NVML per device, MIG slices as devices of their own, and no CUDA
call at init nor in a forked child.

CUDA itself cannot run here (a CPU build of torch): the device choice is asked of a stand-in
for the few CUDA questions :class:`~traceml.sdk.device.RankDevice` makes, NVML of a stand-in
``pynvml`` whose one GPU refuses its handle, and the init and fork checks count the calls a
CUDA build would make. Everything else is real: autograd with ``checkpoint(use_reentrant=True)``,
world-size-1 FSDP1 and FSDP2 on gloo, forked processes, the analysis over sample rows.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from conftest import free_port
from test_forward_timer import traced_step
from torch import nn
from torch.utils.checkpoint import checkpoint

from traceml.analysis.system import node_system
from traceml.sdk import instrumentation, nvml, rank_state, workload
from traceml.sdk.device import RankDevice

MS = 1_000_000  # ns


# --- the rank's device ---------------------------------------------------------------------------
class Probe:
    """The CUDA questions RankDevice asks, answered from a stated machine: ``visible`` devices,
    primary contexts on ``contexts``, the training thread's current device ``current``."""

    def __init__(self, visible: int, contexts: set[int], current: int = 0) -> None:
        self.visible, self.contexts, self.current = visible, contexts, current

    def initialized(self) -> bool:
        return True

    def device_count(self) -> int:
        return self.visible

    def has_context(self, index: int) -> bool:
        return index in self.contexts

    def current_device(self) -> int:
        return self.current


class OnDevice:
    """A model whose first parameter is on ``cuda:<index>`` (only its device is read)."""

    def __init__(self, index: int) -> None:
        self.param = type("P", (), {"device": torch.device("cuda", index)})()

    def parameters(self):
        return iter([self.param])


def test_a_rank_that_never_set_its_device_reports_local_rank_not_a_stray_context_on_0():
    """Rank 3 of 8 moved its work to cuda:3 without set_device: its current device is 0, where
    a stray op made a context too. The rank is cuda:3 (before the fix: cuda:0)."""
    device = RankDevice(Probe(8, {0, 3}), {"LOCAL_RANK": "3"})
    assert device.poll() and device.index == 3


def test_local_rank_counts_the_devices_the_rank_sees():
    """A launcher that gives each rank one GPU (CUDA_VISIBLE_DEVICES=3): LOCAL_RANK 3 is
    device 0 of the one it sees; two per rank (CUDA_VISIBLE_DEVICES=2,3, LOCAL_RANK 3): 1."""
    one = RankDevice(Probe(1, {0}), {"LOCAL_RANK": "3"})
    assert one.poll() and one.index == 0
    two = RankDevice(Probe(2, {1}), {"LOCAL_RANK": "3"})
    assert two.poll() and two.index == 1


def test_no_device_until_the_rank_used_its_own():
    """Only a stray context on device 0 exists: rank 3 has no device yet (never binds to 0),
    and finds cuda:3 once its context is there."""
    probe = Probe(8, {0})
    device = RankDevice(probe, {"LOCAL_RANK": "3"})
    assert not device.poll() and device.index is None
    probe.contexts.add(3)
    assert device.poll() and device.index == 3


def test_the_models_device_then_the_copies_destination_win_over_the_environment():
    probe = Probe(8, {0, 2, 5, 6})
    device = RankDevice(probe, {"LOCAL_RANK": "2"})
    device.note_copy(6)
    model = OnDevice(5)
    device.note_model(model)
    assert device.poll() and device.index == 5  # the model's parameters
    copied = RankDevice(probe, {"LOCAL_RANK": "2"})
    copied.note_model(nn.Linear(2, 2))  # on the CPU: says nothing
    copied.note_copy(6)
    copied.note_copy(0)  # the first copy counts
    assert copied.poll() and copied.index == 6


def test_without_a_launcher_the_current_device_is_taken_once_used():
    probe = Probe(4, set(), current=1)
    device = RankDevice(probe, {})
    assert not device.poll()
    probe.contexts.add(1)
    assert device.poll() and device.index == 1


# --- reentrant backward, optimizer steps in backward -------------------------------------------
class SlowBackward(torch.autograd.Function):
    """Identity whose backward sleeps ``seconds``."""

    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.seconds)
        return grad, None


class Block(nn.Module):
    def __init__(self, forward_s: float = 0.0, backward_s: float = 0.0) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.forward_s, self.backward_s = forward_s, backward_s

    def forward(self, x):
        time.sleep(self.forward_s)
        return SlowBackward.apply(self.linear(x), self.backward_s)


def test_reentrant_checkpointing_times_backward_once(tracer):
    """``checkpoint(use_reentrant=True)`` calls torch.autograd.backward again inside the
    backward: an 80 ms backward is counted once (before the fix: twice, >= 160 ms, more than
    the step), and the traced model's forward recomputed there is backward time (counted
    twice, >= 80 ms, before). The upper bounds are the double counts: this machine is loaded."""
    tracer, steps = tracer
    model = Block(forward_s=0.04, backward_s=0.08)
    x = torch.randn(4, 8, requires_grad=True)

    def body():
        checkpoint(model, x, use_reentrant=True).sum().backward()

    traced_step(tracer, instrumentation.ForwardTimer(model), body)
    (m,) = steps
    assert 80 * MS <= m.backward_ns < 160 * MS
    assert 40 * MS <= m.forward_ns < 80 * MS  # once: the recompute is not a second forward
    assert m.forward_ns + m.backward_ns <= m.step_ns


def test_an_optimizer_step_in_a_backward_hook_is_backward_time(tracer):
    """The "optimizer step in backward" pattern: each parameter's optimizer steps from its
    post-accumulate-grad hook. Its 40 ms are backward time, never counted twice."""
    tracer, steps = tracer

    class SlowSGD(torch.optim.SGD):
        def step(self, closure=None):
            time.sleep(0.02)
            return super().step(closure)

    model = Block()
    optimizers = {p: SlowSGD([p], lr=0.1) for p in model.parameters()}  # weight, bias
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: optimizers[p].step())
    traced_step(
        tracer,
        instrumentation.ForwardTimer(model),
        lambda: model(torch.randn(4, 8)).sum().backward(),
    )
    (m,) = steps
    assert m.optimizer_ns is None
    assert 40 * MS <= m.backward_ns <= m.step_ns
    assert tracer.optimizer_depth == 0 and instrumentation._backward_depth == 0


def test_zero_code_steps_end_as_a_backward_that_stepped_the_optimizer_ends(tracer):
    """Zero-code steps end at the step optimizer's step; run from a backward hook, that step
    is inside the backward, and the boundary waits for the backward's end (before the fix:
    the step closed half-way through the backward, and the next step's backward counted
    time from before it opened, more than the step itself)."""
    from traceml.sdk.auto import AutoSteps

    tracer, steps = tracer
    tracer.auto = AutoSteps(tracer, lambda model: None)
    model = Block(backward_s=0.02)
    optimizers = {p: torch.optim.SGD([p], lr=0.1) for p in model.parameters()}
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: optimizers[p].step())
    try:
        for _ in range(3):
            model(torch.randn(4, 8)).sum().backward()
    finally:
        tracer.auto.stop()
    assert [m.step for m in steps] == [0, 1, 2]
    assert all(m.backward_ns <= m.step_ns and m.optimizer_ns is None for m in steps)
    assert all(20 * MS <= m.backward_ns for m in steps)


# --- FLOPs dtype under FSDP mixed precision ------------------------------------------------------
@pytest.fixture
def process_group():
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_fsdp_mixed_precision_is_the_flops_dtype(process_group):
    """World-size-1 FSDP1 (``MixedPrecision``) and FSDP2 (``MixedPrecisionPolicy``) with bf16
    parameters: the parameters read fp32 and no autocast is on, yet the forward computes in
    bf16, so the MFU peak is bf16's (before the fix: fp32, MFU inflated up to 15x)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import MixedPrecision, MixedPrecisionPolicy, fully_shard

    fsdp1 = FSDP(
        nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)),
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16),
        device_id=torch.device("cpu"),
    )
    assert next(fsdp1.parameters()).dtype == torch.float32
    assert workload.compute_dtype(fsdp1) == ("bf16", "cpu")
    fsdp2 = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    fully_shard(
        fsdp2,
        mesh=init_device_mesh("cpu", (1,)),
        mp_policy=MixedPrecisionPolicy(param_dtype=torch.float16),
    )
    assert workload.compute_dtype(fsdp2) == ("fp16", "cpu")
    plain = FSDP(nn.Linear(8, 8), device_id=torch.device("cpu"))  # no mixed precision
    assert workload.compute_dtype(plain) == ("fp32", "cpu")
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast, where on, is what runs
        assert workload.compute_dtype(fsdp2) == ("bf16", "cpu")


def test_fsdp2_root_pre_forward_is_forward_time(process_group, tracer):
    """FSDP2's root unshards in a forward pre-hook, before ``forward``: that time is forward,
    not residual. A 50 ms pre-hook stands for the unshard's all-gather wait (world size 1
    has none to speak of); the model's hooks are its own again after the step."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    tracer, steps = tracer
    model = nn.Sequential(nn.Linear(8, 8))
    fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
    model.register_forward_pre_hook(lambda module, args: time.sleep(0.05))
    hooks = list(model._forward_pre_hooks.values())
    traced_step(
        tracer,
        instrumentation.ForwardTimer(model),
        lambda: model(torch.randn(4, 8)).sum().backward(),
    )
    (m,) = steps
    assert 50 * MS <= m.forward_ns <= m.step_ns
    assert list(model._forward_pre_hooks.values()) == hooks


# --- the torch floor -----------------------------------------------------------------------------
def test_torch_below_the_floor_is_one_clear_line(monkeypatch, capsys):
    """torch 2.3 has no ``get_autocast_dtype``: init() says so in one line and is off (before:
    it went on, or failed deeper with an AttributeError)."""
    assert rank_state.torch_version_error("2.3.1+cu121") == (
        "TraceML needs torch >= 2.4, this process has torch 2.3.1+cu121; telemetry is off"
    )
    assert rank_state.torch_version_error("2.4.0") is None
    assert rank_state.torch_version_error(torch.__version__) is None
    monkeypatch.setattr(torch, "__version__", "2.2.2")
    monkeypatch.setattr(rank_state, "_state", None)
    assert rank_state.start("127.0.0.1:9", "floor") is None
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "traceml: TraceML needs torch >= 2.4, this process has torch 2.2.2; telemetry is off"
    ]


def test_pyproject_floor_is_the_sdks():
    from conftest import ROOT

    floor = ".".join(map(str, rank_state.MIN_TORCH))
    assert f'"torch>={floor}",' in (ROOT / "pyproject.toml").read_text()


# --- NVML: each device on its own ----------------------------------------------------------------
class FakePynvml:
    """A pynvml whose GPU ``refused`` raises NO_PERMISSION for its handle; GPU 1 is in MIG mode
    with two slices."""

    NVML_DEVICE_MIG_ENABLE = 1
    NVML_TEMPERATURE_GPU = 0

    def __init__(self, refused: int) -> None:
        self.refused = refused

    def nvmlDeviceGetCount(self):
        return 3

    def nvmlDeviceGetHandleByIndex(self, index):
        if index == self.refused:
            raise RuntimeError("Insufficient Permissions")
        return ("gpu", index)

    def nvmlDeviceGetUUID(self, handle):
        return f"MIG-{handle[1]}{handle[2]}" if handle[0] == "mig" else f"GPU-{handle[1]}"

    def nvmlDeviceGetMigMode(self, handle):
        return (int(handle[1] == 1), 0)

    def nvmlDeviceGetMaxMigDeviceCount(self, handle):
        return 3

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle, slot):
        if slot == 2:
            raise RuntimeError("Not Found")
        return ("mig", handle[1], slot)


def test_one_gpu_nvml_refuses_costs_only_its_own_samples():
    """GPU 2 refuses its handle: GPUs 0 and 1 (and 1's two MIG slices) are still described and
    sampled; GPU 2 is one row with the reason (before: NVML unavailable for the whole node)."""
    gpus = nvml.describe_all(FakePynvml(refused=2))
    assert [(g.index, g.uuid, [u for _, u in g.slices]) for g in gpus] == [
        (0, "GPU-0", []),
        (1, "GPU-1", ["MIG-10", "MIG-11"]),
        (2, "", []),
    ]
    assert gpus[2].error == "NVML cannot read GPU 2: Insufficient Permissions"
    session_ = nvml.Nvml(FakePynvml(refused=2), gpus)
    assert session_.uuids() == ["GPU-0", "GPU-1", "MIG-10", "MIG-11"]


# --- MIG slices in the analysis ------------------------------------------------------------------
def _gpu_row(t: int, index: int, uuid: str, memory: int, util=None) -> dict:
    return {
        "node_rank": 0,
        "unix_us": t,
        "nvml_index": index,
        "uuid": uuid,
        "util_percent": util,
        "memory_used_bytes": memory,
        "memory_total_bytes": 10 * memory,
        "temperature_c": None,
        "power_w": None,
        "unavailable_reason": None,
    }


def test_mig_slices_are_devices_of_their_own():
    """GPU 0 in MIG mode with two slices (same nvml_index, own UUIDs), GPU 1 plain: four rows,
    parent first (before the fix: GPU 0 and its slices collapsed into one row)."""
    gpus = []
    for t in (1, 2):
        gpus += [
            _gpu_row(t, 0, "GPU-a", 300),
            _gpu_row(t, 0, "MIG-a1", 100 * t),
            _gpu_row(t, 0, "MIG-a2", 50),
            _gpu_row(t, 1, "GPU-b", 700, util=80.0),
        ]
    system = [
        {"unix_us": t, "cpu_percent": 10.0, "ram_used_bytes": 1, "ram_total_bytes": 2}
        for t in (1, 2)
    ]
    rows = node_system(system, gpus, None).gpus
    assert [(g.nvml_index, g.uuid, g.memory_used_bytes_max) for g in rows] == [
        (0, "GPU-a", 300),
        (0, "MIG-a1", 200),
        (0, "MIG-a2", 50),
        (1, "GPU-b", 700),
    ]
    assert rows[3].util_percent_median == 80.0


# --- no CUDA call at init, none in a forked child -----------------------------------------------
_COUNT_CUDA = """
import json, os, sys, torch
calls = []
def counted(name):
    return lambda *a, **k: calls.append(name) or 0
torch.backends.cuda.is_built = lambda: True  # as in a CUDA build
for name in ("is_available", "device_count", "init", "current_device", "set_device"):
    setattr(torch.cuda, name, counted(name))
torch._C._cuda_getDeviceCount = counted("cudaGetDeviceCount")
"""


def _run(code: str) -> dict:
    result = subprocess.run(
        [sys.executable, "-c", _COUNT_CUDA + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_init_makes_no_cuda_call():
    """Attaching the GPU telemetry of a CUDA build asks CUDA nothing (before the fix:
    ``torch.cuda.is_available()``, which initialises the driver and poisons fork); nor does a
    step before the script used CUDA."""
    got = _run("""
        from traceml.sdk.identity import RankInfo
        from traceml.sdk.rank_state import RankState
        s = RankState(RankInfo.from_env(), "no-cuda", "127.0.0.1:9")
        s._attach_cuda()
        s.tracer.begin(); s.tracer.end()
        print(json.dumps({"calls": calls, "gpu_clock": s.tracer.gpu_step_factory is not None}))
        os._exit(0)
    """)
    assert got == {"calls": [], "gpu_clock": True}


def test_a_child_forked_inside_a_step_runs_no_hook():
    """A DataLoader worker forked inside an open step inherits the training thread's identity:
    its host ``.to(dtype)`` took the H2D path and the GPU clock (CUDA driver calls in the
    child, before the fix). Now every hook passes through in the child."""
    got = _run("""
        import time
        from traceml.sdk import instrumentation
        from traceml.sdk.step import StepTracer
        class Clock:  # the GPU clock of a timed step: any call would be a CUDA call
            def __getattr__(self, name):
                return counted("gpu_step." + name)
        tracer = StepTracer(lambda m: None, time.perf_counter_ns())
        instrumentation.install(tracer)
        instrumentation.install_h2d()
        tracer.begin()
        tracer.gpu_step = Clock()
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            torch.zeros(4).to(torch.float64)
            os.write(write, json.dumps(calls).encode())
            os._exit(0)
        os.waitpid(pid, 0)
        print(json.dumps({"child": json.loads(os.read(read, 4096))}))
    """)
    assert got == {"child": []}
