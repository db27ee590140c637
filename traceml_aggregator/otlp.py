"""OTLP export: node 0's aggregator pushes the ``/metrics`` series to an OpenTelemetry
collector (``--otlp-endpoint URL``, or the standard ``OTEL_EXPORTER_OTLP_*`` variables: see
:mod:`traceml.core.otlp`), with the official SDK's types and OTLP/gRPC exporter (the ``otlp``
extra: ``pip install 'traceml-insight[otlp]'``).

Who does what, so that neither the event loop nor the aggregator's GIL carries the export:

* the aggregator (:class:`OtlpPush`, a task on its event loop) asks the live analysis process
  every ``TRACEML_OTLP_INTERVAL_SEC`` to fold in what arrived since its last delta (the loop
  pays that delta only, as for a scrape: :meth:`~traceml_aggregator.live.LiveAggregates.
  in_analysis_process`) and to push (:func:`push`);
* the analysis process builds the series from its mirror with the very families ``/metrics``
  is written from (:func:`traceml_aggregator.metrics.families`), hands them to its exporter
  thread and returns at once: one export in flight at most, and one waiting (a newer push
  replaces the waiting one, counted as skipped);
* the exporter thread (in the analysis process, at its low CPU priority) sends them with
  ``OTLPMetricExporter``, in requests of at most :data:`BATCH_POINTS` data points.

Each sample of ``/metrics`` is a data point of an OpenTelemetry gauge of the sample's name
(the step-time summary's quantiles, ``_count`` and ``_sum`` are three gauges), its labels
(``rank``, ``node``, ``phase``, ``gpu``, ``quantile``) its attributes, its value the same.
The data is built with the SDK's own types (``opentelemetry.sdk.metrics.export``) and given
to the exporter directly, not through a ``MeterProvider``: the figures are already aggregated
last values, and a meter provider would add its aggregation pass and its cap of 2,000
attribute sets per instrument (1,024 ranks have 7,168 phase series).

The resource (:func:`resource`): ``service.name`` ``traceml`` (unless ``OTEL_SERVICE_NAME`` or
``OTEL_RESOURCE_ATTRIBUTES`` names one), ``traceml.run_name``, ``slurm.job.id`` (when
``SLURM_JOB_ID`` is set), ``host.name`` (node 0's host), and ``OTEL_RESOURCE_ATTRIBUTES``.

Fail-open: an export that fails (the collector unreachable or refusing, after the exporter's
own retries within ``OTEL_EXPORTER_OTLP_TIMEOUT``, 10 s unless set) drops its data points and
counts them; the aggregator says the first failure in one line of its log and the totals
when it stops. When the run ends, one last push is waited for, at most
:data:`FINAL_EXPORT_S` once it reached the analysis process, and not at all while the
collector fails; what it could not send by then is counted as one failed export, its data
points dropped.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
import time
from collections import Counter
from dataclasses import dataclass

from traceml.core import log
from traceml_aggregator.live import analysis_process
from traceml_aggregator.metrics import families

_log = log.get("aggregator")

#: Most data points in one export request (~100 bytes each once encoded: ~1 MB, under the
#: 4 MiB a gRPC server receives by default).
BATCH_POINTS = 10_000
#: How long the last push at the end of the run may take once in the analysis process, s.
FINAL_EXPORT_S = 3.0
#: How long the aggregator waits for that last push, s: the above, plus its wait behind a
#: computation already running in the analysis process, or the start of that process.
FINAL_WAIT_S = FINAL_EXPORT_S + 5.0
#: The SDK's exporter logger: its lines (a retry, a failure) become the last error the
#: aggregator reports, not one line per failed export in the aggregator's log.
EXPORTER_LOGGER = "opentelemetry.exporter.otlp.proto.grpc.exporter"
#: ``service.name`` unless the standard variables name one.
SERVICE = "traceml"
#: The counts :func:`push` returns (each since its previous call).
COUNTS = ("exports", "points_sent", "failed", "points_dropped", "skipped")
#: Sample-name suffixes and their OpenTelemetry units (UCUM); any other series: "1".
_UNITS = (("_seconds", "s"), ("_bytes", "By"), ("_percent", "%"))


@dataclass(frozen=True)
class Options:
    """What the analysis process needs to export (picklable).

    Attributes:
        endpoint: ``--otlp-endpoint``; None: the exporter reads the standard variables.
        run_name: the run's name (a resource attribute).
    """

    endpoint: str | None
    run_name: str


def _unit(family: str, sample: str) -> str:
    """The unit of sample ``sample`` of family ``family``: ``_count`` is a count, else the
    family's suffix says it."""
    if sample.endswith("_count"):
        return "1"
    return next((unit for suffix, unit in _UNITS if family.endswith(suffix)), "1")


def resource(run_name: str):
    """The export's ``opentelemetry.sdk.resources.Resource`` (see the module docstring)."""
    from opentelemetry.sdk.resources import (
        HOST_NAME,
        SERVICE_NAME,
        OTELResourceDetector,
        Resource,
    )

    attributes = {
        SERVICE_NAME: SERVICE,
        "traceml.run_name": run_name,
        HOST_NAME: socket.gethostname(),
    }
    job = os.environ.get("SLURM_JOB_ID")
    if job:
        attributes["slurm.job.id"] = job
    if OTELResourceDetector().detect().attributes.get(SERVICE_NAME):
        del attributes[SERVICE_NAME]  # the user's OTEL_SERVICE_NAME or resource attributes
    return Resource.create(attributes)


def metrics_data(metric_families: list, resource_, now_ns: int) -> list:
    """The ``metric_families`` (:func:`traceml_aggregator.metrics.families`) as the SDK's
    ``MetricsData``: one per request of at most :data:`BATCH_POINTS` data points, each a gauge
    point at ``now_ns`` (Unix ns); [] when there is no sample."""
    from opentelemetry.sdk.metrics.export import (
        Gauge,
        Metric,
        MetricsData,
        NumberDataPoint,
        ResourceMetrics,
        ScopeMetrics,
    )
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope

    scope = InstrumentationScope("traceml")
    requests, metrics, count = [], [], 0
    by_name: dict[str, Metric] = {}

    def close() -> None:
        nonlocal metrics, count
        if metrics:
            scoped = ScopeMetrics(scope=scope, metrics=metrics, schema_url="")
            requests.append(MetricsData([ResourceMetrics(resource_, [scoped], schema_url="")]))
        metrics, count = [], 0
        by_name.clear()

    for family in metric_families:
        for sample in family.samples:
            metric = by_name.get(sample.name)
            if metric is None:
                metric = Metric(
                    name=sample.name,
                    description=family.documentation,
                    unit=_unit(family.name, sample.name),
                    data=Gauge(data_points=[]),
                )
                by_name[sample.name] = metric
                metrics.append(metric)
            metric.data.data_points.append(
                NumberDataPoint(dict(sample.labels), 0, now_ns, sample.value)
            )
            count += 1
            if count == BATCH_POINTS:
                close()
    close()
    return requests


def points(data) -> int:
    """Data points in one ``MetricsData``."""
    return sum(
        len(m.data.data_points)
        for rm in data.resource_metrics
        for sm in rm.scope_metrics
        for m in sm.metrics
    )


class _LastError(logging.Handler):
    """Keeps the text of the exporter's latest warning or error (instead of printing it),
    and tells ``on_error``."""

    def __init__(self, on_error) -> None:
        super().__init__(logging.WARNING)
        self.text = ""
        self.on_error = on_error

    def emit(self, record: logging.LogRecord) -> None:
        self.text = record.getMessage()
        self.on_error()


class Exporter:
    """The analysis process's exporter (see the module docstring): :meth:`submit` hands it
    the requests of one push, its thread sends them.

    Args:
        options: where to, and the run's name.

    Raises:
        ImportError: the ``otlp`` extra is not installed.
    """

    def __init__(self, options: Options) -> None:
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
        from opentelemetry.sdk.metrics.export import MetricExportResult

        self._error = _LastError(self._failed)
        sdk_log = logging.getLogger(EXPORTER_LOGGER)
        sdk_log.addHandler(self._error)
        sdk_log.propagate = False
        self.resource = resource(options.run_name)
        self._otlp = OTLPMetricExporter(endpoint=options.endpoint)
        self._success = MetricExportResult.SUCCESS
        self._cond = threading.Condition()
        self._pending: list | None = None  # the requests of the push waiting to be sent
        self._unsent = 0  # points of the requests taken by the thread, not yet sent or dropped
        self._counts: Counter = Counter()
        self._closed = False
        #: The collector failed (an export, a retry) and has not taken one since.
        self._failing = False
        threading.Thread(target=self._run, name="traceml-otlp", daemon=True).start()

    def submit(self, requests: list) -> None:
        """Queue one push's requests (replacing a push still waiting: counted skipped)."""
        with self._cond:
            if self._pending is not None:
                self._counts["skipped"] += 1
            self._pending = requests
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._pending is None:
                    self._cond.wait()
                requests, self._pending = self._pending, None
                self._unsent = sum(points(r) for r in requests)
            for request in requests:
                try:
                    ok = self._otlp.export(request) is self._success
                except Exception as exc:  # never let the thread die
                    self._error.text = f"{type(exc).__name__}: {exc}"
                    ok = False
                with self._cond:
                    if self._closed:
                        return
                    n = points(request)
                    if ok:
                        self._counts.update(exports=1, points_sent=n)
                        self._unsent -= n
                        self._failing = False
                    else:  # the rest of this push waits for the next one: dropped too
                        self._counts.update(failed=1, points_dropped=self._unsent)
                        self._unsent = 0
                        self._failing = True
                        break
            with self._cond:
                self._cond.notify_all()

    def _failed(self) -> None:
        """The exporter said a retry or a failure: the collector is failing now."""
        with self._cond:
            self._failing = True
            self._cond.notify_all()

    def finish(self, timeout_s: float) -> None:
        """Wait for what was submitted to be sent, at most ``timeout_s`` and no longer than
        the collector answers (a failing one is not waited for); then count what was not sent
        as one failed export, its points dropped, and close the exporter (the end of the
        run)."""
        with self._cond:
            self._cond.wait_for(
                lambda: self._failing or (self._pending is None and self._unsent == 0),
                timeout_s,
            )
            unsent = self._unsent + sum(points(r) for r in self._pending or ())
            if unsent:
                self._counts.update(failed=1, points_dropped=unsent)
            self._pending, self._unsent, self._closed = None, 0, True
        self._otlp.shutdown()

    def take(self) -> dict:
        """The counts since the previous call (:data:`COUNTS`), and ``error``: the exporter's
        latest warning or error ("" when none)."""
        with self._cond:
            counts, self._counts = self._counts, Counter()
        return {**{name: counts[name] for name in COUNTS}, "error": self._error.text}


#: This analysis process's exporter, made at its first push.
_exporter: Exporter | None = None


def push(delta, options: Options, final: bool) -> dict:
    """In the analysis process: fold ``delta`` into the mirror, hand its series to the
    exporter thread; with ``final``, wait at most :data:`FINAL_EXPORT_S` for them to be sent,
    then close the exporter. The counts since the previous push (:meth:`Exporter.take`).

    Raises:
        ImportError: the ``otlp`` extra is not installed.
    """
    global _exporter
    mirror = analysis_process.fold(delta)
    if _exporter is None:
        _exporter = Exporter(options)
    _exporter.submit(metrics_data(families(mirror), _exporter.resource, time.time_ns()))
    if final:
        _exporter.finish(FINAL_EXPORT_S)
    return _exporter.take()


class OtlpPush:
    """The aggregator's side: :meth:`start` pushes every ``interval_s`` until :meth:`final`,
    which pushes once more; the counts add up here and go to the aggregator's log.

    Args:
        live: the live aggregates (:class:`~traceml_aggregator.live.LiveAggregates`).
        options: what the analysis process needs.
        target: where the export goes, as the log lines say it.
        interval_s: time between two pushes, s (``TRACEML_OTLP_INTERVAL_SEC``).
    """

    def __init__(self, live, options: Options, target: str, interval_s: float) -> None:
        self.live, self.options, self.target, self.interval_s = live, options, target, interval_s
        self.counts: Counter = Counter()
        self.pushes_failed = 0  # pushes that never reached the exporter (analysis process)
        self._said_failure = False
        self._task: asyncio.Task | None = None
        self._in_flight: asyncio.Future | None = None  # the periodic push under way

    def start(self) -> None:
        """Push every ``interval_s`` from now on (a task of the running event loop)."""
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            # Shielded: stopping the task never loses the counts a push already took.
            self._in_flight = asyncio.ensure_future(self._push(final=False))
            await asyncio.shield(self._in_flight)

    async def final(self) -> None:
        """Stop the periodic pushes; push once more, after the one under way (its counts
        too), waited for at most :data:`FINAL_WAIT_S` in all; then the totals line."""
        if self._task is not None:
            self._task.cancel()

        async def last() -> None:
            if self._in_flight is not None:
                await self._in_flight
            await self._push(final=True)

        try:
            await asyncio.wait_for(last(), FINAL_WAIT_S)
        except asyncio.TimeoutError:
            self.pushes_failed += 1
        _log.info(self.totals())

    async def _push(self, final: bool) -> None:
        try:
            got = await self.live.in_analysis_process(push, self.options, final)
        except Exception as exc:  # the analysis process died: the next push starts a new one
            self.pushes_failed += 1
            self._say_failure(f"{type(exc).__name__}: {exc}")
            return
        self.counts.update({name: got[name] for name in COUNTS})
        if got["failed"]:
            self._say_failure(got["error"] or "no reason given")

    def _say_failure(self, why: str) -> None:
        """The first failure, in one line."""
        if not self._said_failure:
            self._said_failure = True
            _log.warning(
                f"OTLP export to {self.target} failed ({why}); training goes on, the data "
                "points of each failed export are counted as dropped (totals when the "
                "aggregator stops)"
            )

    def totals(self) -> str:
        """The export's totals, one line."""
        c = self.counts
        line = (
            f"OTLP export to {self.target}: {c['exports']} requests sent ({c['points_sent']} "
            f"data points), {c['failed']} failed ({c['points_dropped']} data points dropped), "
            f"{c['skipped']} pushes skipped while an export was in flight"
        )
        if self.pushes_failed:
            line += f", {self.pushes_failed} pushes not made (the analysis process failed)"
        return line
