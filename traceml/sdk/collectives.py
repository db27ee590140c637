"""Collectives as measured events on the rank, and the step's time in communication.

What is recorded: every collective the rank takes part in through

* the explicit ``torch.distributed`` calls :data:`OPS` (``all_reduce``, ``all_gather``,
  ``all_gather_into_tensor``, ``reduce_scatter``, ``reduce_scatter_tensor``, ``broadcast``,
  ``barrier``), sync and async (``async_op=True``): the functions are replaced in
  ``torch.distributed`` and ``torch.distributed.distributed_c10d`` by wrappers that call the
  original exactly once with the same arguments and return its result unchanged;
* the gradient buckets of ``DistributedDataParallel``, through a communication hook that wraps
  the hook the user registers (``register_comm_hook``, ``_register_builtin_comm_hook``: both
  are replaced on the class so that a hook registered after ours becomes the wrapped one), or
  torch's default all-reduce hook (``default_hooks.allreduce_hook`` on the model's process
  group, the Python form of DDP's built-in all-reduce: divide by the group size, then sum).

Each event (:class:`Collective`) carries the op, the process group's name (``"default"`` for
the default group), its sequence number in that group on this rank (1, 2, ... in the order this
rank issued them: the same collective has the same number on every rank of the group, since
the ranks of a group issue its collectives in the same order), the bytes the rank contributes
(its input tensor(s)), and ``perf_counter_ns`` on entry and at completion. Completion of a
sync call is its return; of an async call or a DDP bucket, the moment its ``Work``'s future
completes, seen by a callback on the thread that completes it (never a wait on the training
thread); a bucket's callback is chained to the future DDP waits on, so it has run when
backward returns. On NCCL that future completes when the work is enqueued, not when it ran:
CUDA-event completion is not measured yet (``docs/telemetry.md``).

The step's ``comm`` phase (:data:`traceml.core.phases.PHASES`) is the time the training
thread had nothing to do but wait for collectives, so that it is a part of the step like the
others (never counted twice):

* a sync collective: its whole call, taken out of the phase it ran in (forward, backward,
  optimizer, H2D, the step outside them: the residual, or between steps: the next step's
  input wait);
* DDP's buckets: from the entry of the step's last bucket (its gradients are the last ready,
  so backward's compute is done) to the completion of the last bucket to complete, taken out
  of backward: the wait at the end of backward for the gradient all-reduce;
* an async explicit collective: an event, but no part of ``comm`` (where the script waits for
  it is not seen).

The step's *arrival* (:data:`traceml.core.phases.ARRIVAL_FIELDS`) is the last collective it
waited in (of its sync collectives and its last DDP bucket, the one entered last): its entry,
group and sequence number, one per step, so that node 0 can align the same collective across
ranks and see who arrived last (:mod:`traceml.analysis.skew`) for the cost of three integers a
step on the wire.

Before the rank's first collective ``comm`` is not measured (absent, as in a process without
collectives); from its first collective on, every step has it, 0 on a step without any
(:meth:`Recorder.close_step`).

Fail-open: recording never raises into the training; an exception in the recording drops the
event, and the collective runs as if TraceML were absent. ``benchmarks/collective_events.py``
measures the cost per event on the calling thread.
"""

from __future__ import annotations

import collections
import functools
import threading
import time
import zlib

from traceml.sdk.failopen import warn_once

_now_ns = time.perf_counter_ns

#: The explicit collectives recorded: name -> (position and keyword of the tensor argument(s)
#: whose bytes are the rank's contribution, or None for none; position of ``group``; position
#: of ``async_op``), from the signatures of ``torch.distributed`` (torch >= 2.1).
OPS: dict[str, tuple[int | None, str | None, int, int]] = {
    "all_reduce": (0, "tensor", 2, 3),
    "all_gather": (1, "tensor", 2, 3),
    "all_gather_into_tensor": (1, "input_tensor", 2, 3),
    "reduce_scatter": (1, "input_list", 3, 4),
    "reduce_scatter_tensor": (1, "input", 3, 4),
    "broadcast": (0, "tensor", 2, 3),
    "barrier": (None, None, 0, 1),
}
#: The op name of a DDP gradient bucket's collective.
DDP_BUCKET = "ddp_bucket"
#: Events kept on the rank (the newest; older ones are dropped, ring buffer).
EVENTS_KEPT = 4096
#: Group name of the default process group.
DEFAULT_GROUP = "default"

#: Tracer phase (:attr:`traceml.sdk.step.StepTracer.phase`) -> the measurement attribute a
#: sync collective's time is taken out of; any other phase ("step") is the residual's time.
_PHASE_ATTR = {
    "idle": "input_wait_ns",
    "h2d": "h2d_ns",
    "forward": "forward_ns",
    "backward": "backward_ns",
    "optimizer": "optimizer_ns",
}


class Collective:
    """One collective as this rank saw it.

    Attributes:
        op: the ``torch.distributed`` function name, or :data:`DDP_BUCKET`.
        group: process group name (:data:`DEFAULT_GROUP` for the default group).
        seq: sequence number in ``group`` on this rank, from 1.
        nbytes: bytes the rank contributes (0 for a barrier).
        entry_ns: ``perf_counter_ns`` as the rank entered it.
        done_ns: ``perf_counter_ns`` at completion; None while in flight (or failed).
        phase: the tracer's phase on entry (:data:`traceml.sdk.step.IDLE`, ...).
    """

    __slots__ = ("op", "group", "seq", "nbytes", "entry_ns", "done_ns", "phase")

    def __init__(self, op: str, group: str, seq: int, nbytes: int, phase: str) -> None:
        self.op, self.group, self.seq, self.nbytes, self.phase = op, group, seq, nbytes, phase
        self.done_ns: int | None = None
        self.entry_ns = _now_ns()

    def as_dict(self) -> dict:
        """The event as JSON-able values (ns on the ``perf_counter_ns`` clock)."""
        return {s: getattr(self, s) for s in self.__slots__}


class Recorder:
    """The rank's collective events and the open step's communication time.

    Args:
        tracer: the rank's :class:`~traceml.sdk.step.StepTracer` (its ``phase`` is read on
            entry; :meth:`close_step` is called by it at step end).
    """

    def __init__(self, tracer) -> None:
        self.tracer = tracer
        #: The newest events, oldest first (at most :data:`EVENTS_KEPT`).
        self.events: collections.deque[Collective] = collections.deque(maxlen=EVENTS_KEPT)
        #: Collectives entered and not completed, by ``id()`` (read by the sender thread).
        self.open: dict[int, Collective] = {}
        self._seq: dict[str, int] = {}
        self._group_names: dict[int, str] = {}
        #: Sync collectives' time since the last step ended, by tracer phase (ns).
        self._sync_ns: dict[str, int] = {}
        #: DDP buckets entered since the last step ended.
        self._buckets: list[Collective] = []
        #: The last sync collective completed since the last step ended.
        self._last_sync: Collective | None = None
        #: Group name -> its CRC-32 (the arrival's ``arrive_group``).
        self._group_crc: dict[str, int] = {}
        self._local = threading.local()

    # -- on the calling thread ------------------------------------------------------------------
    def group_name(self, group) -> str:
        """Name of process group ``group`` (None or the default group: :data:`DEFAULT_GROUP`)."""
        if group is None:
            return DEFAULT_GROUP
        key = id(group)
        name = self._group_names.get(key)
        if name is None:
            from torch.distributed import distributed_c10d as c10d

            if group is c10d.GroupMember.WORLD or group is c10d._get_default_group():
                name = DEFAULT_GROUP
            else:
                name = c10d._get_process_group_name(group)
            self._group_names[key] = name
        return name

    def enter(self, op: str, group: str, nbytes: int) -> Collective:
        """Record the entry into a collective (its sequence number taken now)."""
        seq = self._seq.get(group, 0) + 1
        self._seq[group] = seq
        ev = Collective(op, group, seq, nbytes, self.tracer.phase)
        self.open[id(ev)] = ev
        self.events.append(ev)
        return ev

    def done(self, ev: Collective, sync: bool = False) -> None:
        """Record ``ev``'s completion now (any thread); a sync call's time is the step's
        communication time."""
        ev.done_ns = now = _now_ns()
        self.open.pop(id(ev), None)
        if sync:
            self._sync_ns[ev.phase] = self._sync_ns.get(ev.phase, 0) + now - ev.entry_ns
            self._last_sync = ev

    def failed(self, ev: Collective) -> None:
        """``ev``'s call raised: it is no longer in flight, and has no completion."""
        self.open.pop(id(ev), None)

    def inside(self) -> Collective | None:
        """The oldest collective in flight (the one the rank waits in), or None."""
        try:
            return min(self.open.values(), key=lambda e: e.entry_ns, default=None)
        except RuntimeError:  # changed size while read from another thread: read again
            return min(list(self.open.values()), key=lambda e: e.entry_ns, default=None)

    # -- at step end (training thread) ----------------------------------------------------------
    def close_step(self, m) -> None:
        """Set the step's ``comm_ns`` on measurement ``m`` (ns) and take it out of the phases
        that held it (module docstring).

        ``comm_ns`` is None (not measured) until this rank has entered its first collective
        (any op, a DDP bucket or an async call included), so a process without collectives
        never reports ``comm``; from then on every step has it, 0 on a step without a sync
        collective or DDP bucket: the rank takes part in collectives and waited in none, a
        measurement of 0, so that the step's median ``comm`` is over the same steps as its
        other parts. The check reads the per-group sequence numbers :meth:`enter` keeps (no
        cost on the collective's path, no allocation on a step without collectives)."""
        sync, buckets = self._sync_ns, self._buckets
        if not (sync or buckets):
            m.comm_ns = 0 if self._seq else None
            return
        last_sync, self._last_sync = self._last_sync, None
        self._sync_ns, self._buckets = {}, []
        m.comm_ns = None
        try:
            m.comm_ns = self._split(m, sync, buckets)
            m.arrival = self._arrival(last_sync, buckets[-1] if buckets else None)
        except Exception as exc:  # fail-open: the step is sent without comm
            _warn_once(exc)

    def _arrival(self, sync: Collective | None, bucket: Collective | None) -> tuple[int, int, int]:
        """``(entry ns, group CRC-32, seq)`` of the one of ``sync`` and ``bucket`` (not both
        None) entered last."""
        ev = (
            sync
            if bucket is None or (sync is not None and sync.entry_ns > bucket.entry_ns)
            else bucket
        )
        crc = self._group_crc.get(ev.group)
        if crc is None:
            crc = self._group_crc[ev.group] = zlib.crc32(ev.group.encode())
        return ev.entry_ns, crc, ev.seq

    def _split(self, m, sync: dict[str, int], buckets: list[Collective]) -> int:
        total = 0
        for phase, ns in sync.items():
            total += _take(m, _PHASE_ATTR.get(phase), ns)
        if buckets:
            done = [b.done_ns for b in buckets if b.done_ns is not None]
            if done:
                tail = max(0, max(done) - max(b.entry_ns for b in buckets))
                total += _take(m, _PHASE_ATTR.get(buckets[-1].phase), tail)
        return total


def _take(m, attr: str | None, ns: int) -> int:
    """Take ``ns`` out of ``m.<attr>`` (at most what it holds); return what was taken (all of
    ``ns`` when ``attr`` is None: the residual's time)."""
    if attr is None:
        return ns
    held = getattr(m, attr)
    if held is None:
        return ns if attr == "input_wait_ns" else 0
    taken = min(held, ns)
    setattr(m, attr, held - taken)
    return taken


_recorder: Recorder | None = None
_installed = False


def recorder() -> Recorder | None:
    """The process's recorder once :func:`install` ran, else None."""
    return _recorder


def _nbytes(value) -> int:
    if isinstance(value, (list, tuple)):
        return sum(t.numel() * t.element_size() for t in value)
    return value.numel() * value.element_size()


def _wrap(name: str, original):
    tensor_pos, tensor_kw, group_pos, async_pos = OPS[name]

    @functools.wraps(original)
    def collective(*args, **kwargs):
        rec = _recorder
        if rec is None or getattr(rec._local, "suppress", False):
            return original(*args, **kwargs)
        ev = is_async = None
        try:
            group = args[group_pos] if len(args) > group_pos else kwargs.get("group")
            is_async = args[async_pos] if len(args) > async_pos else kwargs.get("async_op")
            if tensor_pos is None:
                nbytes = 0
            else:
                tensor = args[tensor_pos] if len(args) > tensor_pos else kwargs.get(tensor_kw)
                nbytes = _nbytes(tensor)
            ev = rec.enter(name, rec.group_name(group), nbytes)
        except Exception as exc:  # fail-open: the collective runs unrecorded
            _warn_once(exc)
        try:
            result = original(*args, **kwargs)
        except BaseException:
            if ev is not None:
                rec.failed(ev)
            raise
        if ev is not None:
            _completed(rec, ev, result if is_async else None)
        return result

    collective.__traceml_original__ = original  # type: ignore[attr-defined]
    return collective


def _completed(rec: Recorder, ev: Collective, work) -> None:
    """Record ``ev``'s completion: now for a sync call, else from ``work``'s future."""
    try:
        if work is None:
            rec.done(ev, sync=True)
        else:
            work.get_future().add_done_callback(lambda _fut: rec.done(ev))
    except Exception as exc:
        rec.failed(ev)
        _warn_once(exc)


def _warn_once(exc: BaseException) -> None:
    warn_once(
        "collectives",
        f"collective recording failed ({type(exc).__name__}: {exc}); continuing without",
    )


# -- DDP ------------------------------------------------------------------------------------
def _bucket_hook(cell: list):
    """A DDP communication hook that runs ``cell = [state, hook]`` and records the bucket.

    A function (DDP reads its ``__qualname__`` and checks its ``bucket`` parameter), over a
    mutable cell: a hook the user registers later replaces the cell's contents."""

    def traceml_comm_hook(state, bucket):
        inner_state, hook = cell[0], cell[1]
        rec = _recorder
        ev = None
        if rec is not None:
            try:
                buf = bucket.buffer()
                ev = rec.enter(DDP_BUCKET, cell[2], buf.numel() * buf.element_size())
                rec._buckets.append(ev)
            except Exception as exc:
                _warn_once(exc)
            rec._local.suppress = True  # the hook's own dist.all_reduce is this event
        try:
            fut = hook(inner_state, bucket)
        except BaseException:
            if ev is not None:
                rec.failed(ev)
            raise
        finally:
            if rec is not None:
                rec._local.suppress = False
        if ev is None:
            return fut
        try:
            return fut.then(functools.partial(_bucket_done, rec, ev))
        except Exception as exc:
            rec.failed(ev)
            _warn_once(exc)
            return fut

    return traceml_comm_hook


def _bucket_done(rec: Recorder, ev: Collective, fut):
    """The bucket's completion, recorded by the future DDP waits on: its hook's future chained
    (``then``), whose value it passes on (or whose error it raises), so that DDP's backward
    returns only once the completion is recorded. A callback merely added to the hook's future
    could run after DDP's wait had returned (the future wakes its waiters first, then runs its
    callbacks on the completing thread): a starved gloo thread then left the step closed with
    the bucket not done, its wait counted in backward and ``comm`` 0."""
    try:
        value = fut.value()
    except BaseException:
        rec.failed(ev)
        raise
    rec.done(ev)
    return value


def watch_ddp(model) -> None:
    """Register the recording hook on DDP ``model`` (wrapping torch's default all-reduce) unless
    a hook is registered already (ours, which wraps the user's, or a built-in one registered
    before TraceML was installed, which is left alone). Never raises."""
    try:
        if model.__dict__.get("_traceml_comm") is not None:
            return
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        _register(model, model.process_group, default_hooks.allreduce_hook)
    except Exception as exc:
        _warn_once(exc)


def _register(model, state, hook) -> None:
    rec = _recorder
    group = rec.group_name(model.process_group) if rec is not None else DEFAULT_GROUP
    cell = [state, hook, group]
    _ORIGINAL_REGISTER(model, None, _bucket_hook(cell))
    model.__dict__["_traceml_comm"] = cell


_ORIGINAL_REGISTER = None


def _patch_ddp() -> None:
    global _ORIGINAL_REGISTER
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    _ORIGINAL_REGISTER = original_register = DDP.register_comm_hook
    original_builtin = DDP._register_builtin_comm_hook
    original_init = DDP.__init__

    @functools.wraps(original_register)
    def register_comm_hook(self, state, hook):
        cell = self.__dict__.get("_traceml_comm")
        if cell is False:  # a built-in hook is registered: torch says why not
            return original_register(self, state, hook)
        if cell is None:
            if _recorder is None:
                return original_register(self, state, hook)
            self._check_comm_hook(hook)
            return _register(self, state, hook)
        self._check_comm_hook(hook)
        cell[0], cell[1] = state, hook

    @functools.wraps(original_builtin)
    def register_builtin_comm_hook(self, comm_hook_type):
        cell = self.__dict__.get("_traceml_comm")
        if not cell:
            self.__dict__["_traceml_comm"] = False  # the built-in stays, unrecorded
            return original_builtin(self, comm_hook_type)
        python_form = {
            "ALLREDUCE": default_hooks.allreduce_hook,
            "FP16_COMPRESS": default_hooks.fp16_compress_hook,
        }[comm_hook_type.name]
        cell[0], cell[1] = self.process_group, python_form

    @functools.wraps(original_init)
    def __init__(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        if _recorder is not None:
            watch_ddp(self)

    DDP.register_comm_hook = register_comm_hook
    DDP._register_builtin_comm_hook = register_builtin_comm_hook
    DDP.__init__ = __init__


def install(tracer) -> Recorder | None:
    """Record the collectives of this process into a :class:`Recorder` fed by ``tracer``'s
    phases (once per process; later calls re-point it). Returns it, or None when
    ``torch.distributed`` is unavailable or the patching failed (a warning says why)."""
    global _recorder, _installed
    try:
        import torch.distributed as dist

        if not dist.is_available():
            return None
        if not _installed:
            from torch.distributed import distributed_c10d as c10d

            for name in OPS:
                original = getattr(c10d, name)
                original = getattr(original, "__traceml_original__", original)
                wrapped = _wrap(name, original)
                setattr(c10d, name, wrapped)
                setattr(dist, name, wrapped)
            _patch_ddp()
            _installed = True
        _recorder = Recorder(tracer)
        tracer.comm = _recorder
        return _recorder
    except Exception as exc:
        _warn_once(exc)
        return None
