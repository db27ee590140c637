"""The node's GPUs as NVML reports them (``nvidia-ml-py``, import name ``pynvml``).

NVML sees every GPU of the host by its own index, whatever ``CUDA_VISIBLE_DEVICES`` says (it
may hold indices or ``GPU-``/``MIG-`` UUIDs), so GPUs are identified by UUID, which is also
what a rank reports for its device (:meth:`traceml.sdk.device.RankDevice.uuid`). NVML never
creates a CUDA context.

A figure NVML cannot give is absent and the sample's ``unavailable_reason`` says why: a GPU in
MIG mode and its slices report no utilisation, a slice has no temperature or power of its own.
NVML missing or broken (CPU hosts, containers without the driver library) raises
:class:`NvmlUnavailable` from :meth:`Nvml.open`; the caller reports that once and goes on.
"""

from __future__ import annotations

from dataclasses import dataclass, field


class NvmlUnavailable(RuntimeError):
    """NVML cannot be used on this host; the message says why (one line)."""


@dataclass
class _Gpu:
    """One physical GPU and, in MIG mode, its slices' handles and UUIDs."""

    index: int
    handle: object
    uuid: str
    mig: bool = False
    slices: list[tuple[object, str]] = field(default_factory=list)


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class Nvml:
    """An initialised NVML session over the host's GPUs; :meth:`close` ends it."""

    def __init__(self, pynvml, gpus: list[_Gpu]) -> None:
        self._nv = pynvml
        self.gpus = gpus

    @classmethod
    def open(cls) -> "Nvml":
        """Initialise NVML and list the GPUs (and MIG slices).

        Raises:
            NvmlUnavailable: the library is missing or fails, or there is no GPU.
        """
        try:
            import pynvml as nv
        except ImportError as exc:
            raise NvmlUnavailable(f"nvidia-ml-py is not installed ({exc})") from None
        try:
            nv.nvmlInit()
        except Exception as exc:  # NVMLError_LibraryNotFound, DriverNotLoaded, OSError...
            raise NvmlUnavailable(f"NVML did not start ({exc})") from None
        try:
            gpus = [_describe(nv, i) for i in range(nv.nvmlDeviceGetCount())]
        except Exception as exc:
            _shutdown(nv)
            raise NvmlUnavailable(f"NVML cannot list GPUs ({exc})") from None
        if not gpus:
            _shutdown(nv)
            raise NvmlUnavailable("NVML found no GPU on this host")
        return cls(nv, gpus)

    def uuids(self) -> list[str]:
        """UUIDs of every GPU and MIG slice (``GPU-…``, ``MIG-…``)."""
        out = []
        for gpu in self.gpus:
            out.append(gpu.uuid)
            out.extend(uuid for _, uuid in gpu.slices)
        return out

    def sample(self) -> list:
        """One :class:`~traceml.wire.GpuSample` per GPU and per MIG slice, now."""
        from traceml import wire  # not at import: it loads grpc, which init() must not pay for

        nv = self._nv
        samples = []
        for gpu in self.gpus:
            h = gpu.handle
            s = wire.GpuSample(nvml_index=gpu.index, uuid=gpu.uuid)
            reasons: list[str] = []
            if gpu.mig:
                reasons.append("utilisation: MIG mode, NVML reports none")
            else:
                _put(s, "util_percent", reasons, lambda: nv.nvmlDeviceGetUtilizationRates(h).gpu)
            _put_memory(nv, s, h, reasons)
            _put(s, "temperature_c", reasons,
                 lambda: nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU))
            _put(s, "power_w", reasons, lambda: nv.nvmlDeviceGetPowerUsage(h) / 1000.0)  # mW
            s.unavailable_reason = "; ".join(reasons)
            samples.append(s)
            for mig, uuid in gpu.slices:
                s = wire.GpuSample(nvml_index=gpu.index, uuid=uuid)
                reasons = [
                    "utilisation: MIG slice, NVML reports none",
                    f"temperature, power: see the parent GPU (nvml_index {gpu.index})",
                ]
                _put_memory(nv, s, mig, reasons)
                s.unavailable_reason = "; ".join(reasons)
                samples.append(s)
        return samples

    def close(self) -> None:
        """End the NVML session (NVML counts sessions: others in the process are unaffected)."""
        _shutdown(self._nv)


def _describe(nv, index: int) -> _Gpu:
    handle = nv.nvmlDeviceGetHandleByIndex(index)
    gpu = _Gpu(index, handle, _text(nv.nvmlDeviceGetUUID(handle)))
    try:
        gpu.mig = nv.nvmlDeviceGetMigMode(handle)[0] == nv.NVML_DEVICE_MIG_ENABLE
    except Exception:  # NotSupported: a GPU without MIG
        return gpu
    if gpu.mig:
        for slot in range(nv.nvmlDeviceGetMaxMigDeviceCount(handle)):
            try:
                mig = nv.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot)
            except Exception:  # NotFound: an empty slot
                continue
            gpu.slices.append((mig, _text(nv.nvmlDeviceGetUUID(mig))))
    return gpu


def _put(sample, name: str, reasons: list[str], read) -> None:
    """Set ``sample.name`` to ``read()``, or note why NVML could not give it."""
    try:
        setattr(sample, name, read())
    except Exception as exc:  # NVMLError_NotSupported, GpuIsLost, ...
        reasons.append(f"{name}: {exc}")


def _put_memory(nv, sample, handle, reasons: list[str]) -> None:
    try:
        info = nv.nvmlDeviceGetMemoryInfo(handle)
    except Exception as exc:
        reasons.append(f"memory: {exc}")
        return
    sample.memory_used_bytes = int(info.used)
    sample.memory_total_bytes = int(info.total)


def _shutdown(nv) -> None:
    try:
        nv.nvmlShutdown()
    except Exception:
        pass


def find_uuid(bare: str) -> str | None:
    """The NVML UUID (``GPU-…``/``MIG-…``) whose hex part is ``bare`` (CUDA's form), or None
    when NVML is unavailable or lists no such device."""
    try:
        session = Nvml.open()
    except NvmlUnavailable:
        return None
    try:
        return next((u for u in session.uuids() if u.split("-", 1)[-1] == bare), None)
    finally:
        session.close()
