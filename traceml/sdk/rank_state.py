"""The SDK's per-process state: identity, telemetry client, step tracer, exit handling.

``traceml.init()`` builds one :class:`RankState`; everything else in the public API goes through
:func:`current`. Every entry point is fail-open: an SDK error becomes one warning line and a
no-op, unless ``TRACEML_STRICT=1`` asks for it to raise.
"""

from __future__ import annotations

import atexit
import functools
import re
import sys
import threading
import time

from traceml import settings
from traceml.core import clock, orphans
from traceml.sdk import client as client_mod
from traceml.sdk import sigterm, workload
from traceml.sdk.failopen import fail_open, warn
from traceml.sdk.identity import RankInfo
from traceml.sdk.stall import StallDetail
from traceml.sdk.step import StepTracer


class RankState:
    """A rank's live telemetry state (created by :func:`start`).

    Attributes:
        info: the rank's identity.
        run_name: the run the telemetry belongs to.
        client: the rank's :class:`~traceml.sdk.client.TelemetryClient`.
        tracer: the rank's :class:`~traceml.sdk.step.StepTracer`.
    """

    def __init__(self, info: RankInfo, run_name: str, target: str) -> None:
        self.info = info
        self.run_name = run_name
        self.target = target
        # The two clocks read together: step ends and collective arrivals are sent as offsets
        # on the second from the first, and node 0 compares arrivals across ranks to the ms.
        self.start_unix_us = clock.unix_ns() // 1000
        origin_ns = time.perf_counter_ns()
        self.parallelism = "single"
        self.backend = ""  # process-group backend ("gloo", "nccl"), "" before one is seen
        self._exception: BaseException | None = None
        self._closed = False
        self._nested_warned = False
        #: What the rank does while its step stays open, added to its batches' progress by the
        #: sender thread (set once the tracer exists).
        self.stall: StallDetail | None = None
        self.client = client_mod.TelemetryClient(
            target,
            run_name,
            rank=info.rank,
            node_rank=info.node_rank,
            restart_count=info.restart_count,
            identity=self._identity,
            progress=self._progress,
            progress_detail=self._progress_detail,
            config=client_mod.ClientConfig(first_record_at_once=True),
            relay=settings.read(settings.RELAY),
        )
        self.tracer = StepTracer(functools.partial(self.client.submit, client_mod.STEPS), origin_ns)
        self.stall = StallDetail(self.tracer, settings.read(settings.HANG_TIMEOUT_SEC))
        self.tracer.flops_counter = workload.FlopsCounter(
            functools.partial(self.client.submit, workload.FLOPS_COUNTS),
            settings.read(settings.PEAK_TFLOPS),
        )
        self.extensions: list = []  # objects with close(timeout_s): samplers, GPU timing
        #: The rank's CUDA device (a :class:`~traceml.sdk.device.RankDevice`) when torch has CUDA.
        self.device = None
        self.step_context = None  # the reusable context manager trace_step() returns

    def _progress(self) -> tuple[int, str]:
        """``(steps_completed, phase)`` now, for the sender thread (two attribute reads)."""
        tracer = self.tracer
        return tracer.steps_completed, tracer.phase

    def _progress_detail(self, progress) -> None:
        """Add what the rank does while its step stays open to ``progress`` (a
        ``wire.Progress``), for the sender thread (:class:`~traceml.sdk.stall.StallDetail`)."""
        stall = self.stall
        if stall is not None:
            stall(progress)

    def _identity(self):
        """The RankIdentity, built when the first batch is sent (the traced model is known by
        then; the process group may already be destroyed, so its backend is the one
        :meth:`note_model` saw)."""
        import torch

        from traceml import wire

        backend = self.backend or _process_group_backend()
        info = self.info
        device, uuid = self._device()
        return wire.RankIdentity(
            run_name=self.run_name,
            rank=info.rank,
            local_rank=info.local_rank,
            node_rank=info.node_rank,
            world_size=info.world_size,
            local_world_size=info.local_world_size,
            hostname=info.hostname,
            pid=info.pid,
            restart_count=info.restart_count,
            start_unix_us=self.start_unix_us,
            torch_version=torch.__version__,
            cuda_version=torch.version.cuda or "",
            backend=backend,
            parallelism=self.parallelism,
            device=device,
            gpu_uuid=uuid,
            own_process_group=info.own_process_group,
        )

    def _device(self) -> tuple[str, str]:
        """``("cuda:<i>", NVML UUID)`` once the training thread has used a GPU, else cpu.

        Runs on the sender thread, which must not ask CUDA for its own current device (device
        0 for that thread): the index is the one the training thread found.
        """
        device = self.device
        if device is None or device.index is None:
            return "cpu", ""
        try:
            uuid = device.uuid()
        except Exception:
            uuid = ""
        return f"cuda:{device.index}", uuid

    def attach_telemetry(self) -> None:
        """Add what goes beyond CPU step phases: with CUDA, the GPU clock, step memory peaks
        and H2D timing; the samplers (:func:`traceml.sdk.samplers.start_rank_samplers`).
        See ``docs/telemetry.md`` for what each figure is and costs. Fail-open: a part that
        cannot start is one warning, and the CPU step phases go on."""
        try:
            self._attach_cuda()
        except Exception as exc:
            fail_open("GPU telemetry setup", exc)
        try:
            from traceml.sdk import samplers

            sampler = samplers.start_rank_samplers(self)
            if sampler is not None:
                self.extensions.append(sampler)
        except Exception as exc:
            fail_open("sampler setup", exc)

    def _attach_cuda(self) -> None:
        """The GPU clock, step memory and H2D timing, when torch is built with CUDA.

        No CUDA call is made here: ``torch.cuda.is_available()`` would initialise the driver
        in the parent (``cudaGetDeviceCount``), which breaks a CUDA user in a process the
        script forks later. The device is found once the rank's own work has used it
        (:class:`~traceml.sdk.device.RankDevice`); until then the hooks cost one check.
        """
        import torch

        from traceml.sdk import instrumentation, memory, timing
        from traceml.sdk.device import RankDevice

        if not torch.backends.cuda.is_built():
            return
        device = RankDevice()
        tracer = self.tracer

        def on_device() -> None:
            tracer.h2d_measured = True

        timer = timing.GpuTimer(
            device,
            settings.read(settings.GPU_TIMING_EVERY_N_STEPS),
            on_device=on_device,
            finish_wait_s=settings.read(settings.GPU_FINISH_WAIT_SEC),
        )
        tracer.gpu_step_factory = timer
        tracer.memory_reader = memory.StepMemory(
            device, settings.read(settings.MEMORY_EVERY_N_STEPS)
        )
        instrumentation.install_h2d(device)
        timing.install_capture_guard()
        self.extensions.append(timer)
        self.device = device

    def note_model(self, model) -> None:
        """Remember the process group's backend and the parallelism wrapper of the first
        traced model, and tell the rank's device about the model (training thread, as a step
        opens with a model other than the last's)."""
        if not self.backend:
            self.backend = _process_group_backend()
        if self.device is not None and model is not None:
            self.device.note_model(model)
        if self.parallelism != "single" or model is None:
            return
        name = type(model).__name__
        if name == "DistributedDataParallel":
            self.parallelism = "ddp"
            from traceml.sdk import collectives

            collectives.watch_ddp(model)
        elif name in ("FullyShardedDataParallel", "FSDPModule") or "FSDP" in name:
            self.parallelism = "fsdp"

    def note_nested_step(self) -> None:
        """A ``trace_step`` opened inside an open step: warn once (it counts as the outer's)."""
        if not self._nested_warned:
            self._nested_warned = True
            warn(
                "trace_step() opened inside an open step; the inner block is timed as part of "
                "the outer step"
            )

    @property
    def closed(self) -> bool:
        """True once :meth:`close` began (the finish marker is on its way, or was sent)."""
        return self._closed

    def record_exception(self, exc: BaseException) -> None:
        """Remember the exception that ends the process (reported in the finish marker)."""
        self._exception = exc

    def close(self, timeout_s: float | None = None, signal_name: str = "") -> None:
        """Flush and send the finish marker, within ``timeout_s`` (default
        ``TRACEML_FINISH_TIMEOUT_SEC``). ``signal_name`` ("SIGTERM") marks an end by that
        signal (:mod:`traceml.sdk.sigterm`): end state ``signaled``, the name as the reason."""
        if self._closed or client_mod.in_forked_child():
            return
        self._closed = True
        from traceml import wire

        if timeout_s is None:
            timeout_s = settings.read(settings.FINISH_TIMEOUT_SEC)
        deadline = time.monotonic() + timeout_s  # the samplers' delivery shares the budget
        for ext in self.extensions:
            try:
                ext.close(timeout_s=max(deadline - time.monotonic(), 0.0))
            except Exception as exc:
                warn(f"telemetry extension failed to close: {exc}")
        finish = wire.RankFinish(steps_completed=self.tracer.steps_completed)
        if signal_name:
            finish.end_state = wire.EndState.END_STATE_SIGNALED
            finish.reason = signal_name
        elif self._exception is None:
            finish.end_state = wire.EndState.END_STATE_COMPLETED
        else:
            finish.end_state = wire.EndState.END_STATE_FAILED
            finish.reason = f"{type(self._exception).__name__}: {self._exception}"[:500]
        self.client.close(finish, timeout_s=max(deadline - time.monotonic(), 0.1))


def _process_group_backend() -> str:
    """The default process group's backend, or "" when there is none."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return str(dist.get_backend())
    except Exception:
        pass
    return ""


#: The oldest torch the SDK runs on (major, minor): ``torch.get_autocast_dtype`` and
#: ``torch.is_autocast_enabled(device_type)`` are 2.4's (the FLOPs dtype); before 2.3 there is
#: no ``torch.compiler.is_compiling`` (every hook). Keep ``pyproject.toml`` in step.
MIN_TORCH = (2, 4)


def torch_version_error(version: str) -> str | None:
    """The one-line reason telemetry cannot run on torch ``version`` (``torch.__version__``),
    or None when it is :data:`MIN_TORCH` or newer (an unparsable version is let through)."""
    match = re.match(r"(\d+)\.(\d+)", str(version))
    if match is None or (int(match[1]), int(match[2])) >= MIN_TORCH:
        return None
    floor = ".".join(map(str, MIN_TORCH))
    return f"TraceML needs torch >= {floor}, this process has torch {version}; telemetry is off"


_state: RankState | None = None
_lock = threading.Lock()


def current() -> RankState | None:
    """The process's rank state, or None (not initialised, disabled, or a forked child)."""
    if _state is None or client_mod.in_forked_child():
        return None
    return _state


def start(aggregator: str | None = None, run_name: str | None = None) -> RankState | None:
    """Create the process's rank state; see ``traceml.init`` for the contract."""
    global _state
    with _lock:
        if _state is not None:
            return _state
        if settings.read(settings.DISABLE):
            return None
        import torch

        error = torch_version_error(torch.__version__)
        if error:
            warn(error)
            return None
        target = aggregator or settings.env_str(settings.AGGREGATOR)
        name = run_name or settings.env_str(settings.RUN_NAME)
        if not target or not name:
            warn(
                "no aggregator configured (run the script with `traceml run`, or set "
                f"{settings.AGGREGATOR.name} and {settings.RUN_NAME.name}); telemetry is off"
            )
            return None
        env_info = RankInfo.from_env()
        info = env_info.from_process_group()
        if info is not env_info:
            warn(
                f"pid {info.pid} is rank {info.rank} of a process group of {info.world_size} "
                f"that the script built itself (torchrun started it as rank {env_info.rank} of "
                f"{env_info.world_size}); its telemetry is reported as rank {info.rank}"
            )
        state = RankState(info, name, target)
        from traceml.sdk import collectives, instrumentation

        instrumentation.install(state.tracer)
        collectives.install(state.tracer)
        state.attach_telemetry()
        _install_exit_hooks(state)
        _state = state
        return state


def _install_exit_hooks(state: RankState) -> None:
    previous = sys.excepthook

    def excepthook(exc_type, exc, tb):
        state.record_exception(exc)
        previous(exc_type, exc, tb)

    sys.excepthook = excepthook
    atexit.register(state.close)
    sigterm.install(state)
    orphans.die_with_torchrun()  # a torchrun that dies without stopping the rank: SIGTERM
