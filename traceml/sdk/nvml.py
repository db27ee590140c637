"""The node's GPUs as NVML reports them (``nvidia-ml-py``, import name ``pynvml``).

NVML sees every GPU of the host by its own index, whatever ``CUDA_VISIBLE_DEVICES`` says (it
may hold indices or ``GPU-``/``MIG-`` UUIDs), so GPUs are identified by UUID, which is also
what a rank reports for its device (:meth:`traceml.sdk.device.RankDevice.uuid`). NVML never
creates a CUDA context.

A figure NVML cannot give is absent and the sample's ``unavailable_reason`` says why: a GPU in
MIG mode and its slices report no utilisation, a slice has no temperature or power of its own.
NVML missing or broken (CPU hosts, containers without the driver library) raises
:class:`NvmlUnavailable` from :meth:`Nvml.open`; the caller reports that once and goes on.

Each device is read on its own: a GPU whose handle or UUID NVML refuses (``NO_PERMISSION`` in
a restricted container, ``GPU_IS_LOST`` after an Xid 79) is sampled as a row with only its
NVML index and the reason, and a figure one GPU or slice cannot give never costs another
device its samples.
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
    #: Why NVML could not describe this GPU (its handle or UUID), "" when it could.
    error: str = ""


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class Nvml:
    """An initialised NVML session over the host's GPUs; :meth:`close` ends it."""

    def __init__(self, pynvml, gpus: list[_Gpu]) -> None:
        self._nv = pynvml
        self.gpus = gpus

    @classmethod
    def open(cls) -> Nvml:
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
            gpus = describe_all(nv)
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
            if gpu.uuid:
                out.append(gpu.uuid)
            out.extend(uuid for _, uuid in gpu.slices)
        return out

    def sample(self) -> list:
        """One :class:`~traceml.wire.GpuSample` per GPU and per MIG slice, now."""
        from traceml import wire  # not at import: it loads grpc, which init() must not pay for

        nv = self._nv
        samples = []
        for gpu in self.gpus:
            if gpu.error:
                samples.append(wire.GpuSample(nvml_index=gpu.index, unavailable_reason=gpu.error))
                continue
            h = gpu.handle
            s = wire.GpuSample(nvml_index=gpu.index, uuid=gpu.uuid)
            reasons: list[str] = []
            if gpu.mig:
                reasons.append("utilisation: MIG mode, NVML reports none")
            else:
                _put(
                    s, "util_percent", reasons, lambda h=h: nv.nvmlDeviceGetUtilizationRates(h).gpu
                )
            _put_memory(nv, s, h, reasons)
            _put(
                s,
                "temperature_c",
                reasons,
                lambda h=h: nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU),
            )
            _put(s, "power_w", reasons, lambda h=h: nv.nvmlDeviceGetPowerUsage(h) / 1000.0)  # mW
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


def describe_all(nv) -> list[_Gpu]:
    """Every GPU NVML counts (``nv`` is the ``pynvml`` module), each described on its own: a
    GPU NVML cannot describe is kept with its ``error``.

    Raises:
        Exception: whatever ``nvmlDeviceGetCount`` raises (NVML cannot list GPUs at all).
    """
    gpus = []
    for index in range(nv.nvmlDeviceGetCount()):
        try:
            gpus.append(_describe(nv, index))
        except Exception as exc:  # NoPermission, GpuIsLost, ...
            gpus.append(_Gpu(index, None, "", error=f"NVML cannot read GPU {index}: {exc}"))
    return gpus


def _describe(nv, index: int) -> _Gpu:
    handle = nv.nvmlDeviceGetHandleByIndex(index)
    gpu = _Gpu(index, handle, _text(nv.nvmlDeviceGetUUID(handle)))
    try:
        gpu.mig = nv.nvmlDeviceGetMigMode(handle)[0] == nv.NVML_DEVICE_MIG_ENABLE
        slots = nv.nvmlDeviceGetMaxMigDeviceCount(handle) if gpu.mig else 0
    except Exception:  # NotSupported: a GPU without MIG
        return gpu
    for slot in range(slots):
        try:
            mig = nv.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot)
            gpu.slices.append((mig, _text(nv.nvmlDeviceGetUUID(mig))))
        except Exception:  # NotFound: an empty slot; a slice NVML refuses is left out
            continue
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
