"""What the dashboard page draws, as JSON: one :class:`Snapshot` of a run, sliced per viewer.

A :class:`Snapshot` is built from a :class:`~traceml.analysis.rundata.RunData` (the live
windows, or the whole stored run) and the summary document of the same run (the live verdict,
or ``final_summary.json``). It holds the run's time series, in order, and the tables (ranks,
nodes, findings). :meth:`Snapshot.frame` gives one viewer what it has not had yet: the points
after its :class:`Cursor`, about :data:`MAX_POINTS` a series at most (every k-th point when
there are more, and the last one), and the tables whole. A frame (all times in s, durations in
ms, memory in bytes, utilisation in %; None where not measured)::

    {"run": {"run_name", "world_size", "live", "status", "generated_unix_s"},
     "verdict": {"kind", "severity", "summary", "action", "ranks"} | None,
     "findings": [{"section", "kind", "severity", "summary", "action", "ranks", "nodes"}],
     "ranks": [{"rank", "node_rank", "hostname", "state", "steps", "last_step_age_s",
                "step_ms_median", "step_ms_p95", "input_pct", "h2d_pct", "cpu_percent", "rss_bytes",
                "gpu_allocated_bytes"}],
     "nodes": [{"node_rank", "hostname", "ranks", "state", "last_seen_age_s", "cpu_percent",
                "gpu_util_percent", "gpu_note"}],
     "charted_ranks": [...],
     "steps": {rank: {"restart", "reset", "step": [...], "step_ms": [...]}},
     "phases": {"step": [...], "input_wait" | "h2d" | "forward" | "backward" | "optimizer"
                | "residual": [...]},
     "memory": {rank: {"reset", "t": [...], "rss_bytes": [...], "gpu_allocated_bytes": [...]}},
     "system": {node: {"t": [...], "cpu_percent": [...], "gpu_util_percent": [...]}},
     "metrics": ["step", <phase>...],
     "scale": {"metric", "ranks", "nodes", "first_step", "bin_steps", "columns", "lo_ms",
               "hi_ms", "levels", "colors", "no_data_color", "cells",
               "band": {"step", "min", "median", "max"}, "slowest", "lines": {rank: [...]}}
              | None}

(the event stream adds ``"full": true`` to its first frame: that one holds everything).

Above :data:`~traceml.report.grid.SCALE_RANKS` ranks the frame's ``scale`` holds the rank x
step grid (:mod:`traceml.report.grid`) of the viewer's metric (``Cursor.metric``: ``step`` or
a phase of ``metrics``, those measured): the heatmap's cells as base64 of one colour level a
byte (0: no step; row by row, rows in rank order, ``nodes`` giving each row's node), on the
scale ``lo_ms`` .. ``hi_ms`` of ``colors``; the band (min, median, max over ranks per column of
steps, ``step`` being each column's first step); the slowest ranks and their lines. It is sent
whole in every frame (O(ranks x columns) bytes: at most 175 KiB at 1,024 ranks); below the
threshold it is None. The charted ranks are then the verdict's, then the slowest by step time.
The tables and the scale views, alike for every viewer, are encoded once, when the snapshot is
built (:meth:`Snapshot.encode`).

Per-rank series (``steps``, ``memory``) are sent for the :data:`MAX_CHART_RANKS` charted
ranks only (:func:`charted_ranks`), so a frame's size does not grow with the world size
beyond its tables and its heatmap. ``phases`` are each part's share of the step by step, summed
over all ranks
(:func:`_phase_shares`), on the CPU clock (``<phase>_us`` of the steps; the ``/metrics``
figures use the same), since every step has it. A rank's ``steps`` is its latest step index + 1
(steps count
from 0 in an attempt); ``reset`` is true when the rank's attempt changed since the viewer's
last frame (the page then drops what it had of that rank). A node's GPU utilisation at a
sample time is the mean over its GPUs.
"""

from __future__ import annotations

import array
import base64
import bisect
import json
import math
import operator
import time
from dataclasses import dataclass, field

import numpy as np

from traceml.analysis.rundata import RunData
from traceml.core.phases import PHASES
from traceml.report import grid

#: Most points of one series in one frame (a stored run of 1M steps is sent as every k-th).
MAX_POINTS = 2000
#: Ranks drawn as lines in the step-time and memory charts (the ranks' table shows them all).
MAX_CHART_RANKS = 16
#: Phases charted, with their CPU-clock step field (µs): the parts of the step.
CHART_PHASES = tuple((p.name, p.cpu_field) for p in PHASES if p.part)
#: A running rank or node with nothing new for this long is shown as silent, s.
SILENT_AFTER_S = 30.0


@dataclass
class Cursor:
    """What one viewer has received: per charted rank its attempt and last step index sent,
    and its attempt and last process sample time sent (µs); per node the last system sample
    time sent (µs)."""

    steps: dict[int, tuple[int, int]] = field(default_factory=dict)
    memory: dict[int, tuple[int, int]] = field(default_factory=dict)
    system: dict[int, int] = field(default_factory=dict)
    #: The last step of the phase shares sent.
    phases: int = -1
    #: The figure of the scale views' grid: ``step`` or a phase name.
    metric: str = "step"


_unix_us = operator.itemgetter("unix_us")


def _ms(us) -> float | None:
    return None if us is None else round(us / 1000.0, 3)


def _thin(values: list, start: int) -> list:
    """``values[start:]``; beyond :data:`MAX_POINTS` of them, every k-th (k the smallest
    that keeps at most :data:`MAX_POINTS`) and the last."""
    tail = values[start:]
    if len(tail) <= MAX_POINTS:
        return tail
    stride = math.ceil(len(tail) / MAX_POINTS)
    kept = tail[::stride]
    if (len(tail) - 1) % stride:
        kept.append(tail[-1])
    return kept


@dataclass
class _RankSeries:
    restart: int
    step: list[int]
    step_ms: list
    mem_t_us: list[int]
    memory: dict[str, list]  # "rss_bytes", "gpu_allocated_bytes"


@dataclass
class _NodeSeries:
    t_us: list[int]
    cpu_percent: list
    gpu_util_percent: list


class Snapshot:
    """One run at one moment (see the module docstring): built off the event loop (it only
    reads ``run``, a copy), sliced per viewer with :meth:`frame`.

    Args:
        run: the run's data (live windows or the stored run).
        summary: its summary document (``build_summary``), None while none is computed yet.
        live: whether the run is live (ages since the last step are shown then).
        version: the source's change counter this snapshot covers.
    """

    def __init__(self, run: RunData, summary: dict | None, *, live: bool, version: int) -> None:
        self.version = version
        self.live = live
        self.generated_unix_s = time.time()
        self.tables = _tables(run, summary, live=live, now_s=self.generated_unix_s)
        stack = _Stack(run)
        self._scale = _scale_views(run, stack, self.tables["ranks"])
        slowest = self._scale["step"]["slowest"] if self._scale else []
        self.charted = charted_ranks(run, summary, slowest)
        self._ranks: dict[int, _RankSeries] = {}
        for r in self.charted:
            rd = run.ranks[r]
            samples = sorted(rd.process_samples, key=_unix_us)
            self._ranks[r] = _RankSeries(
                restart=rd.restart,
                step=list(rd.steps["step"]),
                step_ms=[_ms(v) for v in rd.steps["step_us"]],
                mem_t_us=[s["unix_us"] for s in samples],
                memory={
                    name: [s.get(name) for s in samples]
                    for name in ("rss_bytes", "gpu_allocated_bytes")
                },
            )
        self._phase_steps, self._phase_pct = _phase_shares(stack, live=live)
        self._nodes: dict[int, _NodeSeries] = {}
        for n in sorted(set(run.system_samples) | set(run.gpu_samples)):
            system = run.system_samples.get(n, [])
            gpu_at: dict[int, list[float]] = {}
            for g in run.gpu_samples.get(n, []):
                if g.get("util_percent") is not None:
                    gpu_at.setdefault(g["unix_us"], []).append(g["util_percent"])
            times = sorted({s["unix_us"] for s in system} | set(gpu_at))
            cpu_at = {s["unix_us"]: s.get("cpu_percent") for s in system}
            self._nodes[n] = _NodeSeries(
                t_us=times,
                cpu_percent=[cpu_at.get(t) for t in times],
                gpu_util_percent=[
                    round(sum(gpu_at[t]) / len(gpu_at[t]), 1) if t in gpu_at else None
                    for t in times
                ],
            )
        # What every viewer gets alike, encoded once here (off the event loop).
        self._tables_json = _dumps(self.tables)[1:-1]
        self._scale_json = {m: _dumps(v) for m, v in (self._scale or {}).items()}

    def frame(self, cursor: Cursor) -> dict:
        """What the viewer at ``cursor`` has not had yet (see the module docstring); advances
        ``cursor``. Costs O(new points + ranks + nodes)."""
        scale = self._scale.get(cursor.metric, self._scale["step"]) if self._scale else None
        return {**self.tables, **self._news(cursor), "scale": scale}

    def encode(self, cursor: Cursor, **extra) -> bytes:
        """:meth:`frame` with the keys ``extra``, as compact JSON (UTF-8): the tables and the
        scale views, alike for every viewer, were encoded when the snapshot was built, so this
        costs O(new points) (no NaN: ValueError)."""
        scale = self._scale_json.get(cursor.metric, self._scale_json.get("step", "null"))
        news = _dumps({**self._news(cursor), **extra})
        return f'{{{self._tables_json},"scale":{scale},{news[1:]}'.encode()

    def _news(self, cursor: Cursor) -> dict:
        """The frame's parts that depend on the viewer (``cursor``, advanced): new points."""
        steps, memory, system = {}, {}, {}
        for r, s in self._ranks.items():
            restart, last = cursor.steps.get(r, (s.restart, -1))
            reset = restart != s.restart
            start = 0 if reset else bisect.bisect_right(s.step, last)
            if start < len(s.step) or reset:
                steps[str(r)] = {
                    "restart": s.restart,
                    "reset": reset,
                    "step": _thin(s.step, start),
                    "step_ms": _thin(s.step_ms, start),
                }
                if s.step:
                    cursor.steps[r] = (s.restart, s.step[-1])
            m_restart, m_last = cursor.memory.get(r, (s.restart, -1))
            m_reset = m_restart != s.restart
            m_start = 0 if m_reset else bisect.bisect_right(s.mem_t_us, m_last)
            if m_start < len(s.mem_t_us) or m_reset:
                entry = {"reset": m_reset, "t": [t / 1e6 for t in _thin(s.mem_t_us, m_start)]}
                entry.update((k, _thin(v, m_start)) for k, v in s.memory.items())
                memory[str(r)] = entry
                cursor.memory[r] = (s.restart, s.mem_t_us[-1] if s.mem_t_us else -1)
        start = bisect.bisect_right(self._phase_steps, cursor.phases)
        phases = {"step": _thin(self._phase_steps, start)}
        phases.update((k, _thin(v, start)) for k, v in self._phase_pct.items())
        if self._phase_steps:
            cursor.phases = max(cursor.phases, self._phase_steps[-1])
        for n, s in self._nodes.items():
            start = bisect.bisect_right(s.t_us, cursor.system.get(n, -1))
            if start < len(s.t_us):
                system[str(n)] = {
                    "t": [t / 1e6 for t in _thin(s.t_us, start)],
                    "cpu_percent": _thin(s.cpu_percent, start),
                    "gpu_util_percent": _thin(s.gpu_util_percent, start),
                }
                cursor.system[n] = s.t_us[-1]
        return {
            "charted_ranks": self.charted,
            "steps": steps,
            "phases": phases,
            "memory": memory,
            "system": system,
            "metrics": list(self._scale or ()),
        }


def _dumps(value) -> str:
    return json.dumps(value, separators=(",", ":"), allow_nan=False)


def charted_ranks(run: RunData, summary: dict | None, slowest: list[int] = ()) -> list[int]:
    """The ranks drawn as lines (at most :data:`MAX_CHART_RANKS`): those the verdict names
    first, then those of ``slowest``, then the others by rank, among the ranks with steps."""
    named = ((summary or {}).get("primary_diagnosis") or {}).get("ranks") or []
    with_steps = [r for r, rd in run.ranks.items() if len(rd.steps)]
    chosen: dict[int, None] = {}
    for r in [*named, *slowest, *sorted(with_steps)]:
        if r in run.ranks and len(run.ranks[r].steps):
            chosen.setdefault(r)
    return list(chosen)[:MAX_CHART_RANKS]


class _Stack:
    """Every rank's steps as flat arrays, point by point (numpy, built once a snapshot):
    ``row`` (the rank's index in ``ranks``, every rank of the run in rank order), ``step``,
    ``step_us`` and each charted phase's CPU-clock field (µs, NaN where not measured); and
    ``lasts``, each rank with steps' latest step."""

    def __init__(self, run: RunData) -> None:
        self.ranks = list(run.ranks)
        fields = ("step", "step_us", *(f for _, f in CHART_PHASES))
        columns: dict[str, list[np.ndarray]] = {f: [] for f in fields}
        rows: list[np.ndarray] = []
        self.lasts = []
        for i, rd in enumerate(run.ranks.values()):
            cols = rd.steps
            if not len(cols):
                continue
            self.lasts.append(cols["step"][-1])
            rows.append(np.full(len(cols), i, dtype=np.int64))
            for f in fields:
                columns[f].append(_floats(cols[f]))
        self.row = np.concatenate(rows) if rows else np.zeros(0, np.int64)
        self.values = {f: np.concatenate(cs) if cs else np.zeros(0) for f, cs in columns.items()}
        self.step = self.values["step"].astype(np.int64)


def _floats(column) -> np.ndarray:
    """A step column as floats, NaN for None (a column without None converted in C: the
    snapshot's main cost at 1,024 ranks)."""
    if isinstance(column, np.ndarray):
        return column.astype(float)
    try:
        return np.frombuffer(array.array("d", column), dtype=float)
    except TypeError:  # a None among the values: a step that did not measure it
        return np.array(column, dtype=float)


def _phase_shares(stack: _Stack, *, live: bool) -> tuple[list[int], dict[str, list]]:
    """Each part's share of the step (%, one decimal) by step: the part's time summed over the
    ranks over their step times summed, the residual being each step's time outside every
    measured phase. Live, only the steps that every rank with steps has completed (a later
    frame never changes a point already sent). Costs O(ranks x steps), vectorised."""
    names = [name for name, _ in CHART_PHASES] + ["residual"]
    steps, index = np.unique(stack.step, return_inverse=True)
    step_us = stack.values["step_us"]
    total = np.bincount(index, weights=step_us, minlength=len(steps))
    parts = np.zeros(len(step_us))
    sums = {}
    for name, f in CHART_PHASES:
        value = stack.values[f]
        measured = ~np.isnan(value)
        value = np.where(measured, value, 0.0)
        parts += value
        # a phase no rank measured at a step stays None
        seen = np.bincount(index, weights=measured, minlength=len(steps)) > 0
        sums[name] = np.where(seen, np.bincount(index, weights=value, minlength=len(steps)), np.nan)
    sums["residual"] = np.bincount(
        index, weights=np.maximum(0.0, step_us - parts), minlength=len(steps)
    )
    keep = (
        len(steps)
        if not (live and stack.lasts)
        else int(np.searchsorted(steps, min(stack.lasts), side="right"))
    )
    pct = {
        name: [
            round(100.0 * float(s) / float(t), 1) if t and not math.isnan(s) else None
            for s, t in zip(sums[name][:keep], total[:keep], strict=True)
        ]
        for name in names
    }
    return [int(s) for s in steps[:keep]], pct


def _scale_views(run: RunData, stack: _Stack, rank_rows: list[dict]) -> dict[str, dict] | None:
    """Above :data:`~traceml.report.grid.SCALE_RANKS` ranks, per figure (``step``, then each
    measured phase) the frame's ``scale`` (see the module docstring); None below."""
    if max(run.world_size or 0, len(run.ranks)) <= grid.SCALE_RANKS:
        return None
    node_of = {r["rank"]: r["node_rank"] for r in rank_rows}
    views = {}
    for name, f in (("step", "step_us"), *CHART_PHASES):
        ms = stack.values[f] / 1000.0
        if name != "step" and np.isnan(ms).all():
            continue
        g = grid.from_arrays(stack.ranks, stack.row, stack.step, ms)
        lo, hi = g.scale()
        slowest = g.slowest()
        views[name] = {
            "metric": name,
            "ranks": g.ranks,
            "nodes": [node_of.get(r) for r in g.ranks],
            "first_step": g.first_step,
            "bin_steps": g.bin_steps,
            "columns": g.columns,
            "lo_ms": round(lo, 3),
            "hi_ms": round(hi, 3),
            "levels": grid.LEVELS,
            "colors": list(grid.COLORS),
            "no_data_color": grid.NO_DATA_COLOR,
            "cells": base64.b64encode(g.levels()).decode("ascii"),
            "band": {"step": g.column_steps(), **g.band()},
            "slowest": slowest,
            "lines": {str(r): g.row(r) for r in slowest},
        }
    return views


def _tables(run: RunData, summary: dict | None, *, live: bool, now_s: float) -> dict:
    """The frame's run, verdict, findings, ranks and nodes (see the module docstring)."""
    summary = summary or {}
    info = summary.get("run") or {}
    by_rank = {r["rank"]: r for r in summary.get("ranks") or ()}
    ranks, last_seen = [], {}
    for r, rd in run.ranks.items():
        ident = rd.identity
        s = by_rank.get(r) or {}
        node = ident.node_rank if ident else s.get("node_rank")
        last_unix_s = None
        if len(rd.steps) and ident and ident.start_unix_us is not None:
            last_unix_s = (ident.start_unix_us + rd.steps["end_us"][-1]) / 1e6
            last_seen[node] = max(last_seen.get(node, 0.0), last_unix_s)
        process = rd.process_samples[-1] if rd.process_samples else {}
        step_ms = s.get("step_time_ms") or {}
        ranks.append(
            {
                "rank": r,
                "node_rank": node,
                "hostname": ident.hostname if ident else s.get("hostname"),
                "state": _rank_state(rd),
                "steps": rd.steps["step"][-1] + 1 if len(rd.steps) else 0,
                "last_step_age_s": (
                    round(max(0.0, now_s - last_unix_s), 1) if live and last_unix_s else None
                ),
                "step_ms_median": step_ms.get("median"),
                "step_ms_p95": step_ms.get("p95"),
                "input_pct": (s.get("phase_share_pct") or {}).get("input_wait"),
                "h2d_pct": (s.get("phase_share_pct") or {}).get("h2d"),
                "cpu_percent": process.get("cpu_percent"),
                "rss_bytes": process.get("rss_bytes"),
                "gpu_allocated_bytes": process.get("gpu_allocated_bytes"),
            }
        )
    for n, samples in run.system_samples.items():
        if samples:
            last_seen[n] = max(last_seen.get(n, 0.0), samples[-1]["unix_us"] / 1e6)
    findings = []
    for section, items in (summary.get("findings") or {}).items():
        for f in items:
            findings.append(
                {
                    "section": section,
                    "kind": f["kind"],
                    "severity": f["severity"],
                    "summary": f["summary"],
                    "action": f["action"],
                    "ranks": f.get("ranks", []),
                    "nodes": f.get("nodes", []),
                }
            )
    primary = summary.get("primary_diagnosis")
    verdict = None
    if primary:
        verdict = {k: primary.get(k) for k in ("kind", "severity", "summary", "action", "ranks")}
    return {
        "run": {
            "run_name": run.run_name,
            "world_size": run.world_size,
            "live": live,
            "status": info.get("status", "running" if live else "unknown"),
            "generated_unix_s": round(now_s, 3),
        },
        "verdict": verdict,
        "findings": findings,
        "ranks": ranks,
        "nodes": _nodes(run, summary, ranks, last_seen, live=live, now_s=now_s),
    }


def _rank_state(rd) -> str:
    """``running`` until the rank's end is known: its launcher's end state, else its finish
    marker's."""
    end = (rd.end.end_state if rd.end else None) or (rd.finish.end_state if rd.finish else None)
    return end or ("running" if len(rd.steps) else "waiting")


def _nodes(
    run: RunData, summary: dict, ranks: list[dict], last_seen: dict, *, live: bool, now_s: float
) -> list[dict]:
    """One row per node: its state (``exited <code>`` once its launcher reported its torchrun's
    exit; live: ``running``, or ``silent`` past :data:`SILENT_AFTER_S` without a step or a
    sample; ``waiting`` before any), latest CPU and mean GPU utilisation, %."""
    by_node = {n["node_rank"]: n for n in summary.get("nodes") or ()}
    node_ranks: dict[int, list[int]] = {}
    hosts: dict[int, str] = {}
    for r in ranks:
        if r["node_rank"] is not None:
            node_ranks.setdefault(r["node_rank"], []).append(r["rank"])
            hosts.setdefault(r["node_rank"], r["hostname"])
    rows = []
    for n in sorted(set(node_ranks) | set(run.node_exits) | set(run.system_samples) | set(by_node)):
        system = run.system_samples.get(n) or []
        latest = system[-1] if system else {}
        gpus: dict[int, dict] = {}
        for g in run.gpu_samples.get(n) or ():
            gpus[g["nvml_index"]] = g
        utils = [g["util_percent"] for g in gpus.values() if g.get("util_percent") is not None]
        seen = last_seen.get(n)
        age = round(max(0.0, now_s - seen), 1) if live and seen else None
        exit_ = run.node_exits.get(n)
        if exit_ is not None:
            state = f"exited {exit_.exit_code}"
        elif seen is None:
            state = "waiting"
        elif not live:
            state = "no exit report"
        else:
            state = "silent" if age is not None and age > SILENT_AFTER_S else "running"
        if utils:
            gpu_note = f"{len(gpus)} GPU{'s' if len(gpus) > 1 else ''}"
        else:
            gpu_note = latest.get("gpu_unavailable_reason") or "no GPU readings"
        rows.append(
            {
                "node_rank": n,
                "hostname": hosts.get(n)
                or latest.get("hostname")
                or (by_node.get(n) or {}).get("hostname"),
                "ranks": sorted(node_ranks.get(n, (by_node.get(n) or {}).get("ranks", []))),
                "state": state,
                "last_seen_age_s": age,
                "cpu_percent": latest.get("cpu_percent"),
                "gpu_util_percent": round(sum(utils) / len(utils), 1) if utils else None,
                "gpu_note": gpu_note,
            }
        )
    return rows
