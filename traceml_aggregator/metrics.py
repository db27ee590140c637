"""Prometheus ``/metrics`` of the live aggregates (prometheus-client's text format).

Served by a small HTTP server of its own (:class:`MetricsServer`: a thread of the aggregator
process, a thread per request) on ``--metrics-port`` of ``--metrics-bind-host`` (127.0.0.1
unless asked otherwise); off unless that port is given. Every request must carry the run token
as ``Authorization: Bearer TOKEN`` (Prometheus's ``authorization`` scrape option, its
``credentials_file`` the run directory's ``run_token``), compared in constant time; without it
the answer is 401. When the aggregator serves TLS (``--tls-cert``/``--tls-key``), so does
``/metrics``, with the same certificate (Prometheus's ``scheme: https`` and ``tls_config``).

A scrape never copies the windows on the event loop: the loop only builds the delta of what
arrived since the last delta (:meth:`~traceml_aggregator.live.LiveAggregates.metrics`, given
back to the loop every ``DELTA_SLICE_RANKS`` ranks), and the live analysis process, from its
mirror of the windows, computes the figures and writes the text (:func:`exposition`), holding
no GIL of the aggregator. Concurrent scrapes share one computation, and a scrape while nothing
arrived, or within ``METRICS_MAX_AGE_S`` (5 s) of the last computation, is answered from the
last text. The event loop's longest hold during a scrape at 1,024
ranks is bounded by :data:`LOOP_HOLD_BOUND_S` (``tests/test_metrics.py``), and scrapes'
effect on acknowledgements is measured by ``benchmarks/ingest.py --scrapers 0 8``.

Series (label ``rank`` is the global rank, ``node`` the node rank, "" when unknown):

* ``traceml_step_time_seconds{rank,node,quantile="0.5"|"0.95"}``: the step time's median and
  p95 over the rank's window, exact: its latest steps the live analysis covers
  (:func:`~traceml_aggregator.live.analysis_process.analysis_steps`: 512 up to 32 ranks, 64 at 256,
  32 from 512 ranks on); ``_count`` and ``_sum`` cover the window's steps;
* ``traceml_phase_median_seconds{rank,node,phase}``: each phase's median over the window, for
  the phases measured (``input_wait``, ``dataloader_next``, ``h2d``, ``forward``, ``backward``,
  ``optimizer``, ``comm``: the phase table's);
* ``traceml_steps_total{rank,node}``: steps stored (this attempt; a counter, as is the next
  but one: it restarts from 0 with the rank's attempt);
* ``traceml_last_step_timestamp_seconds{rank,node}``: wall clock at the end of the latest
  step (alert on ``time() - traceml_last_step_timestamp_seconds > 300``);
* ``traceml_records_dropped_total{rank,node}``: records the rank dropped so far (the running
  totals every batch carries; absent before its first batch with them);
* ``traceml_process_cpu_percent``, ``traceml_process_rss_bytes``,
  ``traceml_process_gpu_allocated_bytes{rank,node}``: the latest process sample;
* ``traceml_node_cpu_percent``, ``traceml_node_ram_used_bytes{node}``, and
  ``traceml_gpu_util_percent``, ``traceml_gpu_memory_used_bytes{node,gpu}``: the latest system
  sample and each GPU's latest sample.

Cardinality: at most 2 + 7 + 6 = 15 series a rank (quantiles, phases, the rest; + the
summary's ``_count`` and ``_sum``: 17), 2 a node and 2 a GPU; for 8,000 ranks on 1,000 nodes
of 8 GPUs that is at most 8,000 x 17 + 1,000 x 2 + 8,000 x 2 = 154,000 series, whatever the
run's length (labels hold only rank, node, phase, GPU index and quantile: never a step or a
time).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Protocol
from urllib.parse import urlsplit

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily

from traceml.analysis.phases import PHASES
from traceml.core.transport import same_token
from traceml_aggregator.aggregates import last
from traceml_aggregator.auth import bearer, server_ssl_context


class MetricsSource(Protocol):
    """What the server scrapes: :class:`traceml_aggregator.live.LiveAggregates` (imported by
    neither this module nor its type hints, so that the live engine may import this one)."""

    async def metrics(self) -> bytes: ...


class WindowsMirror(Protocol):
    """What :func:`exposition` reads: the live analysis process's mirror
    (:class:`traceml_aggregator.live.analysis_process.Mirror`)."""

    analysis_steps: int
    ranks: dict


#: The phases exported, with their CPU-clock step field (µs).
_PHASE_FIELDS = tuple((name, cpu_field) for name, cpu_field, _ in PHASES) + (
    ("dataloader_next", "dataloader_next_us"),
)
#: How long a scrape waits for its text, s (Prometheus's default ``scrape_timeout`` is 10 s);
#: past it the answer is 503.
SNAPSHOT_TIMEOUT_S = 10.0
#: Longest the event loop is held at one go (its thread's CPU time) while scrapes are served
#: at 1,024 ranks, s: the bound ``tests/test_metrics.py`` checks (a delta gives the loop back
#: every ``DELTA_SLICE_RANKS`` ranks; before, one scrape copied every window on the loop:
#: 132-259 ms at 1,024 ranks).
LOOP_HOLD_BOUND_S = 0.05
#: Seconds a client has to send its request (TLS handshake included) before it is dropped.
REQUEST_TIMEOUT_S = 10.0
#: The body of every 401 answer.
UNAUTHORIZED = b"401 Unauthorized: send the run token as 'Authorization: Bearer TOKEN'\n"


def _quantile(ordered: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of a sorted, non-empty list, linearly interpolated."""
    pos = (len(ordered) - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


class _Families:
    """A prometheus-client collector that yields the metric families it was given."""

    def __init__(self, families) -> None:
        self.families = families

    def collect(self):
        return iter(self.families)


def exposition(mirror: WindowsMirror) -> bytes:
    """The ``/metrics`` text (see the module docstring) of ``mirror``, the live analysis
    process's windows: each rank's latest ``mirror.analysis_steps`` steps. UTF-8 bytes."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(families(mirror)))
    return generate_latest(registry)


def families(mirror: WindowsMirror) -> list:
    """The metric families of ``/metrics`` (see the module docstring) of ``mirror``, as
    prometheus-client's ``Metric`` objects (name, documentation, type, samples: each a
    sample name, its labels and its value), in the exposition's order; the one source of
    both the text (:func:`exposition`) and the OTLP export (:mod:`traceml_aggregator.otlp`)."""
    keep = mirror.analysis_steps
    rl_labels = ["rank", "node"]
    step = SummaryMetricFamily(
        "traceml_step_time_seconds",
        "step time over the rank's window (its latest steps)",
        labels=rl_labels,
    )
    phase = GaugeMetricFamily(
        "traceml_phase_median_seconds",
        "phase median over the rank's window",
        labels=rl_labels + ["phase"],
    )
    # Counters (their one sample is NAME_total): running totals that reset when a rank's
    # attempt restarts, which Prometheus's rate() and increase() read as a counter reset.
    steps = CounterMetricFamily("traceml_steps", "steps stored (this attempt)", labels=rl_labels)
    last_step = GaugeMetricFamily(
        "traceml_last_step_timestamp_seconds",
        "wall clock at the end of the latest step",
        labels=rl_labels,
    )
    dropped = CounterMetricFamily(
        "traceml_records_dropped",
        "records the rank dropped so far",
        labels=rl_labels,
    )
    proc = {
        name: GaugeMetricFamily(f"traceml_process_{name}", help_, labels=rl_labels)
        for name, help_ in (
            ("cpu_percent", "the rank's process CPU, % of a core (latest sample)"),
            ("rss_bytes", "the rank's resident memory (latest sample)"),
            ("gpu_allocated_bytes", "the rank's CUDA allocated memory (latest sample)"),
        )
    }
    for r, mr in sorted(mirror.ranks.items()):
        node = mr.identity.node_rank if mr.identity else None
        labels = [str(r), "" if node is None else str(node)]
        steps.add_metric(labels, mr.steps_stored)
        ordered = sorted(last(mr.window["step_us"], keep))
        if ordered:
            for q in (0.5, 0.95):
                step.add_sample(
                    "traceml_step_time_seconds",
                    {"rank": labels[0], "node": labels[1], "quantile": str(q)},
                    _quantile(ordered, q) / 1e6,
                )
            step.add_metric(labels, count_value=len(ordered), sum_value=sum(ordered) / 1e6)
        for name, field in _PHASE_FIELDS:
            values = sorted(v for v in last(mr.window[field], keep) if v is not None)
            if values:
                phase.add_metric(labels + [name], _quantile(values, 0.5) / 1e6)
        if mr.last_step_unix_s is not None:
            last_step.add_metric(labels, mr.last_step_unix_s)
        source = mr.counts or mr.finish
        records_dropped = source.records_dropped if source else None
        if records_dropped is not None:
            dropped.add_metric(labels, records_dropped)
        latest = mr.process_samples[-1] if mr.process_samples else None
        for name, family in proc.items():
            value = (latest or {}).get(name)
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
        "traceml_gpu_memory_used_bytes",
        "GPU memory used (latest sample)",
        labels=["node", "gpu"],
    )
    for n in sorted(mirror.system_samples.keys() | mirror.gpu_samples.keys()):
        system = mirror.system_samples.get(n)
        latest_system = system[-1] if system else {}
        if latest_system.get("cpu_percent") is not None:
            node_cpu.add_metric([str(n)], latest_system["cpu_percent"])
        if latest_system.get("ram_used_bytes") is not None:
            node_ram.add_metric([str(n)], latest_system["ram_used_bytes"])
        latest_gpu: dict[int, dict] = {}
        for g in mirror.gpu_samples.get(n, ()):
            latest_gpu[g["nvml_index"]] = g
        for index, g in sorted(latest_gpu.items()):
            if g.get("util_percent") is not None:
                gpu_util.add_metric([str(n), str(index)], g["util_percent"])
            if g.get("memory_used_bytes") is not None:
                gpu_mem.add_metric([str(n), str(index)], g["memory_used_bytes"])
    return [
        step,
        phase,
        steps,
        last_step,
        dropped,
        *proc.values(),
        node_cpu,
        node_ram,
        gpu_util,
        gpu_mem,
    ]


class _Handler(BaseHTTPRequestHandler):
    """``GET /metrics`` with the run token; everything else 401 or 404."""

    server: MetricsServer
    timeout = REQUEST_TIMEOUT_S
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        if not same_token(bearer(self.headers.get("Authorization")), self.server.token):
            self._answer(
                401,
                UNAUTHORIZED,
                "text/plain; charset=utf-8",
                (("WWW-Authenticate", 'Bearer realm="traceml"'),),
            )
        elif urlsplit(self.path).path != "/metrics":
            self._answer(404, b"404 Not Found: the only path is /metrics\n", "text/plain")
        else:
            try:
                body = self.server.text()
            except Exception as exc:  # a timeout, the analysis process's death
                message = f"503: no metrics now ({type(exc).__name__}: {exc})\n"
                self._answer(503, message.encode(), "text/plain; charset=utf-8")
            else:
                self._answer(200, body, CONTENT_TYPE_LATEST)

    def _answer(self, code: int, body: bytes, content_type: str, headers=()) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for name, value in headers:
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format, *args) -> None:  # noqa: A002 (http.server's name)
        pass  # no access log on the aggregator's stderr


class MetricsServer(ThreadingHTTPServer):
    """``/metrics`` of ``live`` (see the module docstring) on ``host:port``, served by
    :meth:`start`'s thread until :meth:`shutdown`.

    Args:
        live: the aggregates; ``loop`` is the event loop that owns them.
        token: the run token every request must carry.
        tls: ``(cert, key)`` PEM paths to serve TLS with, None for plain HTTP.

    Raises:
        OSError: the port cannot be bound, or a TLS file cannot be read.
        ssl.SSLError: the TLS files are not a certificate and its key.
    """

    daemon_threads = True
    allow_reuse_address = True

    def __init__(
        self,
        live: MetricsSource,
        loop: asyncio.AbstractEventLoop,
        host: str,
        port: int,
        token: str,
        tls: tuple[Path, Path] | None = None,
    ) -> None:
        if not token:
            raise ValueError("/metrics needs the run token")
        if ":" in host:
            self.address_family = socket.AF_INET6
        super().__init__((host, port), _Handler)
        if tls is not None:
            # The handshake happens in the request's own thread (on its first read), never
            # in the accepting one: a slow client holds only its own request.
            self.socket = server_ssl_context(*tls).wrap_socket(
                self.socket, server_side=True, do_handshake_on_connect=False
            )
        self.live, self.loop, self.token = live, loop, token

    def text(self) -> bytes:
        """The exposition, asked of the event loop (called on a request's thread).

        Raises:
            TimeoutError: not ready within :data:`SNAPSHOT_TIMEOUT_S`.
            Exception: what building it raised.
        """
        future = asyncio.run_coroutine_threadsafe(self.live.metrics(), self.loop)
        try:
            return future.result(SNAPSHOT_TIMEOUT_S)
        except concurrent.futures.TimeoutError:
            # Not cancelled: a delta cut in the middle would leave the analysis process's
            # mirror without what was taken from the windows; the text, once written, answers
            # the next scrape.
            raise TimeoutError(f"not ready within {SNAPSHOT_TIMEOUT_S:g} s") from None

    def start(self) -> MetricsServer:
        """Serve on a daemon thread; returns this server."""
        threading.Thread(target=self.serve_forever, name="traceml-metrics", daemon=True).start()
        return self
