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
                "step_ms_median", "step_ms_p95", "input_pct", "cpu_percent", "rss_bytes",
                "gpu_allocated_bytes"}],
     "nodes": [{"node_rank", "hostname", "ranks", "state", "last_seen_age_s", "cpu_percent",
                "gpu_util_percent", "gpu_note"}],
     "charted_ranks": [...],
     "steps": {rank: {"restart", "reset", "step": [...], "step_ms": [...]}},
     "phases": {"step": [...], "input_wait" | "h2d" | "forward" | "backward" | "optimizer"
                | "residual": [...]},
     "memory": {rank: {"reset", "t": [...], "rss_bytes": [...], "gpu_allocated_bytes": [...]}},
     "system": {node: {"t": [...], "cpu_percent": [...], "gpu_util_percent": [...]}}}

(the event stream adds ``"full": true`` to its first frame: that one holds everything).

Per-rank series (``steps``, ``memory``) are sent for the :data:`MAX_CHART_RANKS` charted
ranks only (:func:`charted_ranks`), so a frame's size does not grow with the world size
beyond its tables. ``phases`` are each part's share of the step by step, summed over all ranks
(:func:`_phase_shares`), on the CPU clock (``<phase>_us`` of the steps; the ``/metrics``
figures use the same), since every step has it. A rank's ``steps`` is its latest step index + 1 (steps count
from 0 in an attempt); ``reset`` is true when the rank's attempt changed since the viewer's
last frame (the page then drops what it had of that rank). A node's GPU utilisation at a
sample time is the mean over its GPUs.
"""

from __future__ import annotations

import bisect
import math
import operator
import time
from dataclasses import dataclass, field

from traceml.analysis.rundata import RunData
from traceml.core.phases import PHASES

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
        self.charted = charted_ranks(run, summary)
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
        self._phase_steps, self._phase_pct = _phase_shares(run, live=live)
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

    def frame(self, cursor: Cursor) -> dict:
        """What the viewer at ``cursor`` has not had yet (see the module docstring); advances
        ``cursor``. Costs O(new points + ranks + nodes)."""
        steps, memory, system = {}, {}, {}
        for r, s in self._ranks.items():
            restart, last = cursor.steps.get(r, (s.restart, -1))
            reset = restart != s.restart
            start = 0 if reset else bisect.bisect_right(s.step, last)
            if start < len(s.step) or reset:
                steps[str(r)] = {"restart": s.restart, "reset": reset,
                                 "step": _thin(s.step, start), "step_ms": _thin(s.step_ms, start)}
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
        return {**self.tables, "charted_ranks": self.charted, "steps": steps,
                "phases": phases, "memory": memory, "system": system}  # fmt: skip


def charted_ranks(run: RunData, summary: dict | None) -> list[int]:
    """The ranks drawn as lines (at most :data:`MAX_CHART_RANKS`): those the verdict names
    first, then the others by rank, among the ranks with steps."""
    named = ((summary or {}).get("primary_diagnosis") or {}).get("ranks") or []
    with_steps = [r for r, rd in run.ranks.items() if len(rd.steps)]
    first = [r for r in named if r in run.ranks and len(run.ranks[r].steps)]
    rest = [r for r in sorted(with_steps) if r not in first]
    return (first + rest)[:MAX_CHART_RANKS]


def _phase_shares(run: RunData, *, live: bool) -> tuple[list[int], dict[str, list]]:
    """Each part's share of the step (%, one decimal) by step: the part's time summed over the
    ranks over their step times summed, the residual being each step's time outside every
    measured phase. Live, only the steps that every rank with steps has completed (a later
    frame never changes a point already sent). Costs O(ranks x steps)."""
    sums: dict[int, list] = {}  # step -> [step time, each phase or None, residual] (µs)
    width = len(CHART_PHASES) + 2
    lasts = []
    for rd in run.ranks.values():
        cols = rd.steps
        if not len(cols):
            continue
        lasts.append(cols["step"][-1])
        phase_columns = [cols[f] for _, f in CHART_PHASES]
        for i, (step, step_us) in enumerate(zip(cols["step"], cols["step_us"])):
            row = sums.get(step)
            if row is None:
                row = sums[step] = [0, *([None] * (width - 2)), 0]
            row[0] += step_us
            parts = 0
            for p, column in enumerate(phase_columns, 1):
                value = column[i]
                if value is not None:  # a phase no rank measured at a step stays None
                    row[p] = (row[p] or 0) + value
                    parts += value
            row[-1] += max(0, step_us - parts)
    through = min(lasts) if live and lasts else None
    steps = sorted(s for s in sums if through is None or s <= through)
    names = [name for name, _ in CHART_PHASES] + ["residual"]
    pct = {
        name: [
            round(100.0 * sums[s][p] / sums[s][0], 1) if sums[s][0] and sums[s][p] is not None
            else None
            for s in steps
        ]
        for p, name in enumerate(names, 1)
    }
    return steps, pct


def _tables(run: RunData, summary: dict | None, *, live: bool, now_s: float) -> dict:
    """The frame's run, verdict, findings, ranks and nodes (see the module docstring)."""
    summary = summary or {}
    info = summary.get("run") or {}
    by_rank = {r["rank"]: r for r in summary.get("ranks") or ()}
    ranks, last_seen = [], {}
    for r, rd in run.ranks.items():
        ident = rd.identity or {}
        s = by_rank.get(r) or {}
        node = ident.get("node_rank", s.get("node_rank"))
        last_unix_s = None
        if len(rd.steps) and ident.get("start_unix_us") is not None:
            last_unix_s = (ident["start_unix_us"] + rd.steps["end_us"][-1]) / 1e6
            last_seen[node] = max(last_seen.get(node, 0.0), last_unix_s)
        process = rd.process_samples[-1] if rd.process_samples else {}
        step_ms = s.get("step_time_ms") or {}
        ranks.append({
            "rank": r,
            "node_rank": node,
            "hostname": ident.get("hostname", s.get("hostname")),
            "state": _rank_state(rd),
            "steps": rd.steps["step"][-1] + 1 if len(rd.steps) else 0,
            "last_step_age_s": (
                round(max(0.0, now_s - last_unix_s), 1) if live and last_unix_s else None
            ),
            "step_ms_median": step_ms.get("median"),
            "step_ms_p95": step_ms.get("p95"),
            "input_pct": (s.get("phase_share_pct") or {}).get("input_wait"),
            "cpu_percent": process.get("cpu_percent"),
            "rss_bytes": process.get("rss_bytes"),
            "gpu_allocated_bytes": process.get("gpu_allocated_bytes"),
        })  # fmt: skip
    for n, samples in run.system_samples.items():
        if samples:
            last_seen[n] = max(last_seen.get(n, 0.0), samples[-1]["unix_us"] / 1e6)
    findings = []
    for section, items in (summary.get("findings") or {}).items():
        for f in items:
            findings.append({
                "section": section, "kind": f["kind"], "severity": f["severity"],
                "summary": f["summary"], "action": f["action"], "ranks": f.get("ranks", []),
                "nodes": f.get("nodes", []),
            })  # fmt: skip
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
    end = (rd.end or {}).get("end_state") or (rd.finish or {}).get("end_state")
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
    for n in sorted(set(node_ranks) | set(run.node_exits) | set(run.system_samples)
                    | set(by_node)):  # fmt: skip
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
            state = f"exited {exit_['exit_code']}"
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
        rows.append({
            "node_rank": n,
            "hostname": hosts.get(n) or latest.get("hostname") or (by_node.get(n) or {}).get(
                "hostname"),
            "ranks": sorted(node_ranks.get(n, (by_node.get(n) or {}).get("ranks", []))),
            "state": state,
            "last_seen_age_s": age,
            "cpu_percent": latest.get("cpu_percent"),
            "gpu_util_percent": round(sum(utils) / len(utils), 1) if utils else None,
            "gpu_note": gpu_note,
        })  # fmt: skip
    return rows
