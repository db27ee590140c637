"""Prometheus ``/metrics`` of the live aggregates (prometheus-client's text format).

Served by prometheus-client's own HTTP server (a daemon thread of the aggregator process) on
``--metrics-port``, bound to the aggregator's host; off unless that flag is given. A scrape asks
the event loop for a copy of the live aggregates (:mod:`traceml_aggregator.live`; O(ranks x
window), the loop never waits on the scrape) and computes the figures on the HTTP thread.

Series (label ``rank`` is the global rank, ``node`` the node rank, "" when unknown):

* ``traceml_step_time_seconds{rank,node,quantile="0.5"|"0.95"}``: the step time's median and
  p95 over the rank's window (its latest 512 steps), exact; ``_count`` and ``_sum`` cover
  the window's steps;
* ``traceml_phase_median_seconds{rank,node,phase}``: each phase's median over the window, for
  the phases measured (``input_wait``, ``dataloader_next``, ``h2d``, ``forward``, ``backward``,
  ``optimizer``);
* ``traceml_steps_total{rank,node}``: steps stored (this attempt);
* ``traceml_last_step_timestamp_seconds{rank,node}``: wall clock at the end of the latest
  step (alert on ``time() - traceml_last_step_timestamp_seconds > 300``);
* ``traceml_records_dropped_total{rank,node}``: records the rank dropped so far (the running
  totals every batch carries; absent before its first batch with them);
* ``traceml_process_cpu_percent``, ``traceml_process_rss_bytes``,
  ``traceml_process_gpu_allocated_bytes{rank,node}``: the latest process sample;
* ``traceml_node_cpu_percent``, ``traceml_node_ram_used_bytes{node}``, and
  ``traceml_gpu_util_percent``, ``traceml_gpu_memory_used_bytes{node,gpu}``: the latest system
  sample and each GPU's latest sample.

Cardinality: at most 2 + 6 + 5 = 13 series a rank (+ the summary's ``_count`` and ``_sum``:
15), 2 a node and 2 a GPU; for 8,000 ranks on 1,000 nodes of 8 GPUs that is at most
8,000 x 15 + 1,000 x 2 + 8,000 x 2 = 138,000 series, whatever the run's length (labels hold
only rank, node, phase, GPU index and quantile: never a step or a time).
"""

from __future__ import annotations

import asyncio
import math

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import GaugeMetricFamily, SummaryMetricFamily

from traceml.analysis.phases import PHASES
from traceml_aggregator.live import LiveAggregates

#: The phases exported, with their CPU-clock step field (µs).
_PHASE_FIELDS = tuple((name, cpu_field) for name, cpu_field, _ in PHASES) + (
    ("dataloader_next", "dataloader_next_us"),
)
#: How long a scrape waits for the event loop's copy of the aggregates, s.
SNAPSHOT_TIMEOUT_S = 10.0


def _quantile(ordered: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of a sorted, non-empty list, linearly interpolated."""
    pos = (len(ordered) - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def snapshot(live: LiveAggregates) -> tuple[list[dict], list[dict]]:
    """Copies of the aggregates a scrape needs (on the event loop): one dict per rank, one per
    node. Times in µs, as stored."""
    ranks = []
    for r, rl in sorted(live.ranks.items()):
        node = (rl.identity or {}).get("node_rank")
        window = rl.steps.window  # step field -> its column over the window
        fields = {name: [v for v in window[f] if v is not None] for name, f in _PHASE_FIELDS}
        ranks.append({
            "rank": r, "node": "" if node is None else str(node),
            "step_us": list(window["step_us"]), "phases_us": fields,
            "steps": rl.steps_stored, "last_step_unix_s": rl.last_step_unix_s,
            "dropped": (rl.counts or rl.finish or {}).get("records_dropped"),
            "process": rl.process_samples[-1] if rl.process_samples else None,
        })  # fmt: skip
    nodes = []
    for n in sorted(set(live.system_samples) | set(live.gpu_samples)):
        system = live.system_samples.get(n)
        latest_gpu: dict[int, dict] = {}
        for g in live.gpu_samples.get(n, ()):
            latest_gpu[g["nvml_index"]] = g
        nodes.append({"node": str(n), "system": system[-1] if system else None,
                      "gpus": latest_gpu})  # fmt: skip
    return ranks, nodes


class LiveCollector:
    """A prometheus-client collector of ``live``, whose event loop is ``loop``."""

    def __init__(self, live: LiveAggregates, loop: asyncio.AbstractEventLoop) -> None:
        self.live = live
        self.loop = loop

    async def _snapshot(self):
        return snapshot(self.live)

    def collect(self):
        """The metric families (see the module docstring); called on the HTTP thread."""
        future = asyncio.run_coroutine_threadsafe(self._snapshot(), self.loop)
        ranks, nodes = future.result(SNAPSHOT_TIMEOUT_S)
        rl_labels = ["rank", "node"]
        step = SummaryMetricFamily(
            "traceml_step_time_seconds", "step time over the rank's window (latest 512 steps)",
            labels=rl_labels,
        )  # fmt: skip
        phase = GaugeMetricFamily(
            "traceml_phase_median_seconds", "phase median over the rank's window",
            labels=rl_labels + ["phase"],
        )  # fmt: skip
        steps = GaugeMetricFamily(
            "traceml_steps_total", "steps stored (this attempt)", labels=rl_labels
        )
        last = GaugeMetricFamily(
            "traceml_last_step_timestamp_seconds", "wall clock at the end of the latest step",
            labels=rl_labels,
        )  # fmt: skip
        dropped = GaugeMetricFamily(
            "traceml_records_dropped_total", "records the rank dropped so far",
            labels=rl_labels,
        )  # fmt: skip
        proc = {
            name: GaugeMetricFamily(f"traceml_process_{name}", help_, labels=rl_labels)
            for name, help_ in (
                ("cpu_percent", "the rank's process CPU, % of a core (latest sample)"),
                ("rss_bytes", "the rank's resident memory (latest sample)"),
                ("gpu_allocated_bytes", "the rank's CUDA allocated memory (latest sample)"),
            )
        }
        for r in ranks:
            labels = [str(r["rank"]), r["node"]]
            steps.add_metric(labels, r["steps"])
            if r["step_us"]:
                ordered = sorted(r["step_us"])
                for q in (0.5, 0.95):
                    step.add_sample(
                        "traceml_step_time_seconds",
                        {"rank": labels[0], "node": labels[1], "quantile": str(q)},
                        _quantile(ordered, q) / 1e6,
                    )
                step.add_metric(labels, count_value=len(ordered), sum_value=sum(ordered) / 1e6)
            for name, values in r["phases_us"].items():
                if values:
                    phase.add_metric(labels + [name], _quantile(sorted(values), 0.5) / 1e6)
            if r["last_step_unix_s"] is not None:
                last.add_metric(labels, r["last_step_unix_s"])
            if r["dropped"] is not None:
                dropped.add_metric(labels, r["dropped"])
            for name, family in proc.items():
                value = (r["process"] or {}).get(name)
                if value is not None:
                    family.add_metric(labels, value)
        node_cpu = GaugeMetricFamily(
            "traceml_node_cpu_percent", "node CPU utilisation, % (latest sample)", labels=["node"]
        )
        node_ram = GaugeMetricFamily(
            "traceml_node_ram_used_bytes", "node RAM used (latest sample)", labels=["node"]
        )
        gpu_util = GaugeMetricFamily(
            "traceml_gpu_util_percent", "GPU utilisation, % (latest sample)", labels=["node", "gpu"]
        )
        gpu_mem = GaugeMetricFamily(
            "traceml_gpu_memory_used_bytes", "GPU memory used (latest sample)",
            labels=["node", "gpu"],
        )  # fmt: skip
        for n in nodes:
            system = n["system"] or {}
            if system.get("cpu_percent") is not None:
                node_cpu.add_metric([n["node"]], system["cpu_percent"])
            if system.get("ram_used_bytes") is not None:
                node_ram.add_metric([n["node"]], system["ram_used_bytes"])
            for index, g in sorted(n["gpus"].items()):
                if g.get("util_percent") is not None:
                    gpu_util.add_metric([n["node"], str(index)], g["util_percent"])
                if g.get("memory_used_bytes") is not None:
                    gpu_mem.add_metric([n["node"], str(index)], g["memory_used_bytes"])
        yield from (step, phase, steps, last, dropped, *proc.values())
        yield from (node_cpu, node_ram, gpu_util, gpu_mem)


def serve_metrics(live: LiveAggregates, host: str, port: int):
    """Start serving ``/metrics`` of ``live`` on ``host:port`` (call on the event loop).

    Returns:
        the HTTP server (``shutdown()`` it to stop).

    Raises:
        OSError: the port cannot be bound.
    """
    registry = CollectorRegistry(auto_describe=False)
    registry.register(LiveCollector(live, asyncio.get_running_loop()))
    server, _thread = start_http_server(port, addr=host, registry=registry)
    return server
