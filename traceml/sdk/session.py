"""The SDK's per-process state: identity, telemetry client, step tracer, exit handling.

``traceml.init()`` builds one :class:`Session`; everything else in the public API goes through
:func:`current`. Every entry point is fail-open: an SDK error becomes one warning line and a
no-op session, unless ``TRACEML_STRICT=1`` asks for it to raise.
"""

from __future__ import annotations

import atexit
import sys
import threading
import time

from traceml import settings
from traceml.sdk import client as client_mod
from traceml.sdk.identity import RankInfo
from traceml.sdk.step import StepTracer


def warn(message: str) -> None:
    """One ``traceml:``-prefixed line on stderr."""
    print(f"traceml: {message}", file=sys.stderr, flush=True)


class Session:
    """A rank's live telemetry session (created by :func:`start`).

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
        self.start_unix_us = time.time_ns() // 1000
        self.parallelism = "single"
        self._exception: BaseException | None = None
        self._closed = False
        self.client = client_mod.TelemetryClient(
            target,
            run_name,
            rank=info.rank,
            restart_count=info.restart_count,
            identity=self._identity,
        )
        self.tracer = StepTracer(self._emit_step, time.perf_counter_ns())
        self.extensions: list = []  # objects with close(): samplers, GPU timing
        self.models_seen: set[int] = set()  # id() of models whose forward is hooked
        self.step_context = None  # the reusable context manager trace_step() returns

    def _emit_step(self, measurement) -> None:
        self.client.submit(client_mod.STEPS, measurement)

    def _identity(self):
        """The RankIdentity, built when the first batch is sent (the process group and the
        traced model are known by then)."""
        import torch

        from traceml import wire

        backend = ""
        try:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                backend = str(dist.get_backend())
        except Exception:
            pass
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
        )

    def _device(self) -> tuple[str, str]:
        """The rank's device and, for a GPU whose context exists, its UUID."""
        import torch

        if not torch.cuda.is_available() or not torch.cuda.is_initialized():
            return "cpu", ""
        index = torch.cuda.current_device()
        try:
            uuid = str(torch.cuda.get_device_properties(index).uuid)
            if uuid and not uuid.startswith(("GPU-", "MIG-")):
                uuid = f"GPU-{uuid}"
        except Exception:
            uuid = ""
        return f"cuda:{index}", uuid

    def note_model(self, model) -> None:
        """Remember the parallelism wrapper of the first traced model."""
        if self.parallelism != "single" or model is None:
            return
        name = type(model).__name__
        if name == "DistributedDataParallel":
            self.parallelism = "ddp"
        elif name in ("FullyShardedDataParallel", "FSDPModule") or "FSDP" in name:
            self.parallelism = "fsdp"

    def record_exception(self, exc: BaseException) -> None:
        """Remember the exception that ends the process (reported in the finish marker)."""
        self._exception = exc

    def close(self) -> None:
        """Flush and send the finish marker; bounded by ``TRACEML_FINISH_TIMEOUT_SEC``."""
        if self._closed or client_mod.in_forked_child():
            return
        self._closed = True
        from traceml import wire

        for ext in self.extensions:
            try:
                ext.close()
            except Exception as exc:
                warn(f"telemetry extension failed to close: {exc}")
        finish = wire.RankFinish(steps_completed=self.tracer.steps_completed)
        if self._exception is None:
            finish.end_state = wire.EndState.END_STATE_COMPLETED
        else:
            finish.end_state = wire.EndState.END_STATE_FAILED
            finish.reason = f"{type(self._exception).__name__}: {self._exception}"[:500]
        timeout = settings.env_float(settings.FINISH_TIMEOUT_SEC)
        self.client.close(finish, timeout_s=timeout)


_session: Session | None = None
_lock = threading.Lock()


def current() -> Session | None:
    """The process's session, or None (not initialised, disabled, or a forked child)."""
    if _session is None or client_mod.in_forked_child():
        return None
    return _session


def start(aggregator: str | None = None, run_name: str | None = None) -> Session | None:
    """Create the process's session; see ``traceml.init`` for the contract."""
    global _session
    with _lock:
        if _session is not None:
            return _session
        if settings.env_bool(settings.DISABLE):
            return None
        target = aggregator or settings.env_str(settings.AGGREGATOR)
        name = run_name or settings.env_str(settings.RUN_NAME)
        if not target or not name:
            warn(
                "no aggregator configured (run the script with `traceml run`, or set "
                f"{settings.AGGREGATOR.name} and {settings.RUN_NAME.name}); telemetry is off"
            )
            return None
        info = RankInfo.from_env()
        session = Session(info, name, target)
        from traceml.sdk import instrumentation

        instrumentation.install(session.tracer)
        _install_exit_hooks(session)
        _session = session
        return session


def _install_exit_hooks(session: Session) -> None:
    previous = sys.excepthook

    def excepthook(exc_type, exc, tb):
        session.record_exception(exc)
        previous(exc_type, exc, tb)

    sys.excepthook = excepthook
    atexit.register(session.close)


def fail_open(what: str, exc: BaseException) -> None:
    """Report an SDK error as one warning, or raise it under ``TRACEML_STRICT=1``."""
    if settings.env_bool(settings.STRICT):
        raise exc
    warn(f"{what} failed ({type(exc).__name__}: {exc}); training continues")
