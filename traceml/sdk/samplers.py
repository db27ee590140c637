"""Periodic samples taken off the training thread: the node, its workers, the rank's GPU memory.

Every ``TRACEML_SAMPLE_INTERVAL_SEC`` (default 1 s) one daemon thread (:class:`SamplerThread`)
calls each sampler:

* :class:`NodeSampler`, one per node: a :class:`~traceml.wire.SystemSample` (host CPU %, RAM,
  and per GPU what NVML reports, see :mod:`traceml.sdk.nvml`) and one
  :class:`~traceml.wire.ProcessSample` per local training worker (CPU %, RSS), streamed by its
  own :class:`~traceml.sdk.client.TelemetryClient` as a node sender. It runs in the
  ``traceml run`` launcher (:func:`start_node_sampler`), so a script that never imports
  TraceML still gets system and process telemetry; without the launcher (plain ``torchrun``
  and a standalone aggregator) local rank 0's SDK hosts it (:func:`start_rank_samplers`).
* :class:`RankMemorySampler`, in each rank's SDK: the CUDA caching allocator's current
  allocated and reserved bytes, which only the process itself can read, as a ProcessSample of
  that rank (its CPU and RSS come from the node sampler, so no figure is counted twice).

Workers are found with psutil: torchrun exports ``RANK`` and ``TORCHELASTIC_RESTART_COUNT`` to
each worker it starts, and ``/proc/<pid>/environ`` keeps them, so each sample names its rank and
attempt (a restarted worker group is kept apart from the first attempt).

Fail-open: a sampler that raises is reported once and keeps being called; NVML missing or
broken is ``gpu_unavailable_reason`` in every system sample, and one info line on a host that
has the NVIDIA driver (``/proc/driver/nvidia``: a GPU host whose figures are missing); nothing
here touches CUDA on any device but the rank's own (explicit index, see
:mod:`traceml.sdk.memory`).
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from traceml import settings
from traceml.core import clock
from traceml.core.threads import name_os_thread
from traceml.sdk import client as client_mod
from traceml.sdk.failopen import warn
from traceml.sdk.nvml import Nvml, NvmlUnavailable

# psutil and traceml.wire (which loads grpc) are imported where they are used, on the sampler
# thread or in the launcher: a rank's init() must not pay for them (~0.2 s measured here).
if TYPE_CHECKING:
    import psutil


def _now_us() -> int:
    return clock.unix_ns() // 1000


class Workers:
    """The node's torchrun workers, sampled for CPU % and RSS.

    A worker is a process whose environment holds ``RANK`` and ``TORCHELASTIC_RESTART_COUNT``
    and whose parent is not itself a worker (DataLoader workers and other children inherit the
    variables and are left out).

    Args:
        candidates: called with the pids of the workers known so far, returns the processes
            to consider now (``psutil.Process`` objects); it may leave out the descendants of
            those workers (a worker's child is never a worker), which spares reading them.
        extra: ``(pid, rank, restart)`` of a process sampled even without those variables (an
            SDK rank started without torchrun samples itself).
    """

    def __init__(
        self,
        candidates: Callable[[set[int]], Iterable[psutil.Process]],
        extra: tuple[int, int, int] | None = None,
    ) -> None:
        self._candidates = candidates
        self._extra = extra
        self._extra_proc: psutil.Process | None = None
        self._procs: dict[int, psutil.Process] = {}  # kept: cpu_percent() needs the same object
        #: pid -> (rank, restart), or None for a process that is not (yet) a worker: read again
        #: each time, since between fork() and exec() a new worker still has torchrun's
        #: environment.
        self._ids: dict[int, tuple[int, int] | None] = {}
        self._primed: set[int] = set()

    def find(self) -> dict[int, tuple[psutil.Process, int, int]]:
        """``pid -> (process, rank, restart)`` of the workers alive now."""
        import psutil

        seen: dict[int, psutil.Process] = {}
        known = {pid for pid, ident in self._ids.items() if ident is not None}
        for proc in self._candidates(known):
            known = self._procs.get(proc.pid)
            if known is None or known != proc:  # new, or the pid was reused
                self._procs[proc.pid] = proc
                self._ids[proc.pid] = None
                self._primed.discard(proc.pid)
            if self._ids[proc.pid] is None:
                self._ids[proc.pid] = _worker_id(proc)
            seen[proc.pid] = self._procs[proc.pid]
        for pid in set(self._procs) - set(seen):
            del self._procs[pid], self._ids[pid]
            self._primed.discard(pid)
        found = {}
        for pid, proc in seen.items():
            ident = self._ids[pid]
            if ident is None:
                continue
            try:
                if self._ids.get(proc.ppid()) is not None:
                    continue  # a worker's child
            except psutil.Error:
                continue
            found[pid] = (proc, *ident)
        if self._extra is not None and self._extra[0] not in found:
            pid, rank, restart = self._extra
            if self._extra_proc is None:
                self._extra_proc = psutil.Process(pid)
            found[pid] = (self._extra_proc, rank, restart)
        return found

    def sample(self, unix_us: int) -> list:
        """One :class:`~traceml.wire.ProcessSample` per live worker (one that exited and is not
        reaped yet has none: its RSS and CPU % read 0, which were never measured). CPU % (of one
        core, over the time since the previous sample) is absent from a worker's first
        sample."""
        import psutil

        from traceml import wire

        out = []
        for pid, (proc, rank, restart) in self.find().items():
            try:
                with proc.oneshot():
                    if proc.status() == psutil.STATUS_ZOMBIE:
                        continue  # exited, not reaped yet: psutil reads 0 B and 0 %, unmeasured
                    cpu = proc.cpu_percent(None)
                    rss = proc.memory_info().rss
            except psutil.Error:
                continue
            sample = wire.ProcessSample(
                unix_us=unix_us, rank=rank, restart_count=restart, rss_bytes=rss
            )
            if pid in self._primed:
                sample.cpu_percent = cpu
            else:
                self._primed.add(pid)
            out.append(sample)
        return out


def _worker_id(proc: psutil.Process) -> tuple[int, int] | None:
    """``(RANK, TORCHELASTIC_RESTART_COUNT)`` from the process's environment, or None."""
    import psutil

    try:
        env = proc.environ()
        return int(env["RANK"]), int(env["TORCHELASTIC_RESTART_COUNT"])
    except (psutil.Error, OSError, KeyError, ValueError):
        return None


class NodeSampler:
    """System and worker samples of one node, sent by their own client (a node sender).

    Args:
        client: the node's client (``rank=None``, ``node_rank`` set).
        node_rank: the node's rank.
        workers: the node's workers.
    """

    def __init__(self, client: client_mod.TelemetryClient, node_rank: int, workers: Workers):
        self.client = client
        self.node_rank = node_rank
        self.hostname = socket.gethostname()
        self.workers = workers
        self._nvml: Nvml | None = None
        self._gpu_reason: str | None = None  # None until NVML was tried (first sample)

    def sample(self) -> None:
        """Submit one SystemSample and the workers' ProcessSamples (sampler thread)."""
        import psutil

        from traceml import wire

        now = _now_us()
        first = self._gpu_reason is None
        if first:
            self._open_nvml()
        mem = psutil.virtual_memory()
        system = wire.SystemSample(
            unix_us=now,
            node_rank=self.node_rank,
            hostname=self.hostname,
            ram_used_bytes=mem.total - mem.available,
            ram_total_bytes=mem.total,
        )
        cpu = psutil.cpu_percent(None)  # all cores, since the previous call
        if not first:
            system.cpu_percent = cpu
        if self._nvml is not None:
            system.gpus.extend(self._nvml.sample())
        else:
            system.gpu_unavailable_reason = self._gpu_reason
        self.client.submit(client_mod.SYSTEM_SAMPLES, system)
        for proc in self.workers.sample(now):
            self.client.submit(client_mod.PROCESS_SAMPLES, proc)

    def _open_nvml(self) -> None:
        try:
            self._nvml = Nvml.open()
            self._gpu_reason = ""
        except NvmlUnavailable as exc:
            self._gpu_reason = str(exc)
            # A host without the NVIDIA driver has no GPU figures to miss: the reason goes in
            # every sample (and the summary) without a line on the training's stderr.
            if os.path.exists("/proc/driver/nvidia"):
                warn(f"GPU metrics are off on node {self.node_rank}: {exc}")

    def close(self, timeout_s: float) -> None:
        """Take a last sample (a short run still gets one), then deliver what is buffered
        within ``timeout_s``, s."""
        try:
            self.sample()
        finally:
            if self._nvml is not None:
                self._nvml.close()
            self.client.close(timeout_s=timeout_s)


class RankMemorySampler:
    """The rank's CUDA caching-allocator bytes, as ProcessSamples of that rank.

    Args:
        client: the rank's client.
        device: the rank's device (nothing is sent before the training thread used it).
    """

    def __init__(self, client: client_mod.TelemetryClient, device) -> None:
        self.client = client
        self.device = device

    def sample(self) -> None:
        """Submit the allocator's current allocated and reserved bytes (sampler thread)."""
        from traceml import wire
        from traceml.sdk.memory import allocator_bytes

        index = self.device.index
        figures = None if index is None else allocator_bytes(index)
        if figures is None:
            return
        self.client.submit(
            client_mod.PROCESS_SAMPLES,
            wire.ProcessSample(
                unix_us=_now_us(),
                rank=self.client.rank,
                restart_count=self.client.restart_count,
                gpu_allocated_bytes=figures[0],
                gpu_reserved_bytes=figures[1],
            ),
        )

    def close(self, timeout_s: float) -> None:
        """Nothing to release: the rank state closes the rank's client."""


class SamplerThread:
    """Calls each sampler's ``sample()`` now and then every ``interval_s`` on one daemon thread.

    Args:
        samplers: objects with ``sample()`` and ``close()``.
        interval_s: period, seconds.
    """

    def __init__(self, samplers: list, interval_s: float) -> None:
        self.samplers = samplers
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._failed: set[int] = set()
        self._thread = threading.Thread(target=self._run, name="traceml-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        name_os_thread()
        while True:
            for i, sampler in enumerate(self.samplers):
                try:
                    sampler.sample()
                except Exception as exc:  # fail-open: report once, keep sampling
                    if i not in self._failed:
                        self._failed.add(i)
                        warn(f"{type(sampler).__name__} failed ({type(exc).__name__}: {exc})")
            if self._stop.wait(self.interval_s):
                return

    def close(self, timeout_s: float | None = None) -> None:
        """Stop the thread (waiting at most one interval + 2 s), then close each sampler,
        all within ``timeout_s``, s (default ``TRACEML_FINISH_TIMEOUT_SEC``)."""
        if timeout_s is None:
            timeout_s = settings.read(settings.FINISH_TIMEOUT_SEC)
        deadline = time.monotonic() + timeout_s
        self._stop.set()
        self._thread.join(min(self.interval_s + 2.0, timeout_s))
        for sampler in self.samplers:
            try:
                sampler.close(timeout_s=max(deadline - time.monotonic(), 0.0))
            except Exception as exc:
                warn(f"{type(sampler).__name__} did not close cleanly ({exc})")


def _interval_s() -> float:
    return settings.read(settings.SAMPLE_INTERVAL_SEC)


def start_node_sampler(config, torchrun_pid: int, relay: str = "") -> SamplerThread:
    """The node sampler of a ``traceml run`` launcher (a :class:`LaunchConfig`): its workers
    are the processes that torchrun (``torchrun_pid``, the launcher's child) started; it
    streams through the node relay at ``relay`` ("": straight to node 0)."""
    import psutil

    client = client_mod.TelemetryClient(
        config.launcher_target,
        str(config.run_name),
        rank=None,
        node_rank=config.node_rank,
        relay=relay,
    )
    torchrun = psutil.Process(torchrun_pid)
    workers = Workers(lambda known: _children(torchrun, recursive=True, prune=known))
    return SamplerThread([NodeSampler(client, config.node_rank, workers)], _interval_s())


def start_rank_samplers(state) -> SamplerThread | None:
    """The samplers a rank's SDK runs (None when there is nothing to sample):

    * with CUDA, its allocator figures (:class:`RankMemorySampler`);
    * without the launcher (``TRACEML_LAUNCHED`` unset), on local rank 0, the node sampler: its
      workers are its parent's (torchrun's) worker children, and itself.
    """
    info = state.info
    samplers: list = []
    if state.device is not None:
        samplers.append(RankMemorySampler(state.client, state.device))
    if not settings.read(settings.LAUNCHED) and info.local_rank == 0:
        # Its own stream per attempt: a restarted rank 0 starts its sequence numbers again.
        client = client_mod.TelemetryClient(
            state.target,
            state.run_name,
            rank=None,
            node_rank=info.node_rank,
            restart_count=info.restart_count,
        )
        workers = Workers(_siblings, extra=(os.getpid(), info.rank, info.restart_count))
        samplers.append(NodeSampler(client, info.node_rank, workers))
    return SamplerThread(samplers, _interval_s()) if samplers else None


def _siblings(_known: set[int]) -> list[psutil.Process]:
    import psutil

    parent = psutil.Process().parent()
    return _children(parent) if parent is not None else []


def _children(
    proc: psutil.Process, recursive: bool = False, prune: set[int] = frozenset()
) -> list[psutil.Process]:
    """``proc.children(recursive)``, read from ``/proc/<pid>/task/<tid>/children`` on Linux;
    the processes in ``prune`` are listed, their descendants are not; none for a process that
    has exited.

    psutil finds children by reading the parent of every process on the host: 3.5 ms per call
    with 80 processes (measured here), more on a busy node, once per sample. The kernel's
    per-thread children lists cost one read per thread of the tree: 0.9-2.9 ms of CPU per
    sample for a 2-rank job walked from the launcher (66 reads), 0.2 ms from torchrun with its
    workers pruned (measured on the loaded 2-core test machine). Without them (a kernel built
    without ``CONFIG_PROC_CHILDREN``, another OS) psutil's scan is used.
    """
    import psutil

    try:
        pids = _child_pids(proc.pid)
    except FileNotFoundError:
        try:
            return proc.children(recursive=recursive)
        except psutil.NoSuchProcess:  # it has exited (torchrun, at the sampler's last look)
            return []
    out = []
    while pids:
        pid = pids.pop()
        try:
            out.append(psutil.Process(pid))
            if recursive and pid not in prune:
                pids.extend(_child_pids(pid))
        except (psutil.Error, FileNotFoundError):
            continue  # exited since it was listed
    return out


def _child_pids(pid: int) -> list[int]:
    """Pids of the children of every thread of ``pid``.

    Raises:
        FileNotFoundError: ``pid`` is gone, or the kernel keeps no children lists.
    """
    task_dir = f"/proc/{pid}/task"
    pids = []
    for tid in os.listdir(task_dir):
        try:
            with open(f"{task_dir}/{tid}/children") as children:
                pids.extend(int(child) for child in children.read().split())
        except FileNotFoundError:
            if not os.path.exists(f"{task_dir}/{tid}"):
                continue  # the thread ended since it was listed
            raise
    return pids
