"""OTLP export (``--otlp-endpoint``, or the standard ``OTEL_EXPORTER_OTLP_*`` variables): node 0's
aggregator pushes the ``/metrics`` series, as OpenTelemetry gauges, to a real OTLP/gRPC
receiver built here from the official proto package (``opentelemetry-proto``'s
``MetricsService``), with the run's resource attributes; an unreachable collector costs the
run nothing but counted drops; without the ``otlp`` extra, one line says so and training goes
on."""

from __future__ import annotations

import os
import re
import socket
import threading
from concurrent import futures

import grpc
import pytest
from conftest import SCRIPTS, free_port, load_summary, run_traceml, wait_for
from helpers.aggregator import LiveAggregator
from helpers.jobs import run_args
from loop_hold import LoopHold
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from prometheus_client.core import GaugeMetricFamily
from test_metrics import RUN, node_1_batch, push, rank_batches
from test_metrics_run import get, samples

from traceml_aggregator import otlp


class Receiver(metrics_service_pb2_grpc.MetricsServiceServicer):
    """A real OTLP/gRPC metrics receiver on 127.0.0.1 (a free port): keeps every request and
    its call's metadata."""

    def __init__(self) -> None:
        self.requests: list = []
        self.metadata: list[dict] = []
        self._lock = threading.Lock()
        self.server = grpc.server(futures.ThreadPoolExecutor(4))
        metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port(f"127.0.0.1:{free_port()}")
        self.server.start()

    def Export(self, request, context):  # noqa: N802 (the service's name)
        with self._lock:
            self.requests.append(request)
            self.metadata.append(dict(context.invocation_metadata()))
        return metrics_service_pb2.ExportMetricsServiceResponse()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def count(self) -> int:
        with self._lock:
            return len(self.requests)

    def latest(self, since: int = 0) -> tuple[dict, dict, dict]:
        """``(points, units, resource)`` of the requests from number ``since`` on, the later
        winning: ``{(name, sorted attributes): value}``, ``{name: unit}`` and the resource's
        attributes."""
        points, units, resource = {}, {}, {}
        with self._lock:
            requests = self.requests[since:]
        for request in requests:
            for rm in request.resource_metrics:
                resource = {a.key: a.value.string_value for a in rm.resource.attributes}
                for sm in rm.scope_metrics:
                    for m in sm.metrics:
                        units[m.name] = m.unit
                        for p in m.gauge.data_points:
                            attrs = tuple(
                                sorted((a.key, a.value.string_value) for a in p.attributes)
                            )
                            value = (
                                p.as_double if p.WhichOneof("value") == "as_double" else p.as_int
                            )
                            points[(m.name, attrs)] = value
        return points, units, resource

    def stop(self) -> None:
        self.server.stop(None)


@pytest.fixture
def receiver():
    r = Receiver()
    yield r
    r.stop()


def steps_of(points: dict) -> dict[str, float]:
    return {dict(k[1])["rank"]: v for k, v in points.items() if k[0] == "traceml_steps_total"}


TOTALS = re.compile(
    r"OTLP export to (\S+): (\d+) requests sent \((\d+) data points\), (\d+) failed \((\d+) data "
    r"points dropped\), (\d+) pushes skipped while an export was in flight$"
)


def totals(log_text: str) -> tuple:
    """The aggregator's one totals line, parsed: (target, sent, points, failed, dropped,
    skipped)."""
    found = [m for line in log_text.splitlines() if (m := TOTALS.search(line))]
    assert len(found) == 1, log_text
    m = found[0]
    return (m[1], *(int(g) for g in m.groups()[1:]))


@pytest.mark.aggregator
def test_the_aggregator_pushes_the_metrics_series_through_the_standard_variables(
    tmp_path, receiver
):
    """No flag: OTEL_EXPORTER_OTLP_METRICS_ENDPOINT turns the export on, and the SDK itself
    honours OTEL_EXPORTER_OTLP_HEADERS and OTEL_RESOURCE_ATTRIBUTES. What arrives is /metrics,
    sample for sample."""
    metrics_port = free_port()
    agg = LiveAggregator(
        tmp_path / "run",
        RUN,
        world_size=2,
        extra_args=("--metrics-port", str(metrics_port)),
        env={
            "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": receiver.url,
            "OTEL_EXPORTER_OTLP_HEADERS": "x-collector-key=k1",
            "OTEL_RESOURCE_ATTRIBUTES": "deployment.environment=test",
            "SLURM_JOB_ID": "4242",
            "TRACEML_OTLP_INTERVAL_SEC": "0.5",
        },
    )
    with agg:
        for rank, n in ((0, 300), (1, 1234)):
            for b in rank_batches(rank, n):
                push(agg.target, b)
        push(agg.target, node_1_batch())
        # Every push from the second one after the last batch covers all of it.
        arrived = receiver.count()
        wait_for(lambda: receiver.count() >= arrived + 2, 120, "two pushes after the batches")
        points, units, resource = receiver.latest(arrived + 1)
        status, text = get(
            f"http://127.0.0.1:{metrics_port}/metrics", os.environ["TRACEML_RUN_TOKEN"]
        )
        assert status == 200
        assert agg.stop() == 0
        log_text = agg.log_path.read_text()

    assert points == samples(text)  # the same series, labels and values as /metrics
    assert steps_of(points) == {"0": 300, "1": 1234}
    assert (
        points[("traceml_step_time_seconds", (("node", "1"), ("quantile", "0.5"), ("rank", "1")))]
        == 0.011
    )
    assert points[("traceml_gpu_util_percent", (("gpu", "3"), ("node", "1")))] == 88.0
    assert (
        units["traceml_step_time_seconds"],
        units["traceml_step_time_seconds_count"],
        units["traceml_process_rss_bytes"],
        units["traceml_steps_total"],
        units["traceml_node_cpu_percent"],
    ) == ("s", "1", "By", "1", "%")
    assert {
        k: resource[k]
        for k in (
            "service.name",
            "traceml.run_name",
            "slurm.job.id",
            "host.name",
            "deployment.environment",
        )
    } == {
        "service.name": "traceml",
        "traceml.run_name": RUN,
        "slurm.job.id": "4242",
        "host.name": socket.gethostname(),
        "deployment.environment": "test",
    }
    assert {m.get("x-collector-key") for m in receiver.metadata} == {"k1"}
    target, sent, sent_points, failed, dropped, _ = totals(log_text)
    assert (target, failed, dropped) == (receiver.url, 0, 0)
    assert sent == receiver.count()  # every push, the last one at the stop included
    assert sent_points == sum(
        len(m.gauge.data_points)
        for r in receiver.requests
        for rm in r.resource_metrics
        for sm in rm.scope_metrics
        for m in sm.metrics
    )
    assert "failed (" not in log_text.replace("0 failed (0 data", "")


def test_a_push_is_split_into_requests_of_at_most_batch_points():
    pytest.importorskip("opentelemetry.sdk")
    family = GaugeMetricFamily("traceml_x_bytes", "x", labels=["rank"])
    for r in range(2 * otlp.BATCH_POINTS + 5):
        family.add_metric([str(r)], r)
    from opentelemetry.sdk.resources import Resource

    requests = otlp.metrics_data([family], Resource.create({}), 7)
    assert [otlp.points(r) for r in requests] == [otlp.BATCH_POINTS, otlp.BATCH_POINTS, 5]
    last = requests[-1].resource_metrics[0].scope_metrics[0].metrics[0]
    assert (
        last.name,
        last.unit,
        [(p.attributes, p.value, p.time_unix_nano) for p in last.data.data_points][-1],
    ) == (
        "traceml_x_bytes",
        "By",
        ({"rank": str(2 * otlp.BATCH_POINTS + 4)}, 2 * otlp.BATCH_POINTS + 4, 7),
    )
    assert otlp.metrics_data([GaugeMetricFamily("traceml_y", "y", labels=["rank"])], None, 7) == []


def run_job(
    tmp_path,
    name: str,
    otlp_flag: list[str],
    steps: int,
    env: dict | None = None,
    step_sleep: float = 0.0,
):
    """``traceml run`` of tests/scripts/fail_open_train.py on 2 ranks with ``otlp_flag``."""
    return run_traceml(
        run_args(
            tmp_path,
            SCRIPTS / "fail_open_train.py",
            name,
            free_port(),
            *otlp_flag,
            "--steps",
            str(steps),
            "--step-sleep",
            str(step_sleep),
        ),
        tmp_path,
        timeout=300,
        env={"TRACEML_OTLP_INTERVAL_SEC": "1", **(env or {})},
    )


@pytest.mark.slow
@pytest.mark.torchrun
def test_traceml_run_pushes_its_ranks_to_the_collector(tmp_path, receiver):
    result = run_job(
        tmp_path, "otlp-run", ["--otlp-endpoint", receiver.url], 30, env={"SLURM_JOB_ID": "777"}
    )
    assert result.returncode == 0, result.stderr
    assert "OTLP" not in result.stderr  # nothing to say on the console: it worked
    points, _, resource = receiver.latest()
    # The last push, after the run's last batches: every step of both ranks, on node 0.
    assert steps_of(points) == {"0": 30, "1": 30}
    counts = {k[1]: v for k, v in points.items() if k[0] == "traceml_step_time_seconds_count"}
    assert counts == {(("node", "0"), ("rank", "0")): 30, (("node", "0"), ("rank", "1")): 30}
    assert (resource["service.name"], resource["traceml.run_name"], resource["slurm.job.id"]) == (
        "traceml",
        "otlp-run",
        "777",
    )
    log_text = (tmp_path / "logs" / "otlp-run" / "aggregator" / "process.stderr.log").read_text()
    target, sent, _, failed, dropped, _ = totals(log_text)
    assert (target, sent, failed, dropped) == (receiver.url, receiver.count(), 0, 0)
    summary = load_summary(tmp_path / "logs" / "otlp-run")
    assert {r["rank"]: r["steps_completed"] for r in summary["ranks"]} == {0: 30, 1: 30}


@pytest.mark.slow
@pytest.mark.torchrun
def test_an_unreachable_collector_costs_the_run_nothing_but_counted_drops(tmp_path):
    dead = free_port()  # nothing listens there
    result = run_job(
        tmp_path, "otlp-dead", ["--otlp-endpoint", f"http://127.0.0.1:{dead}"], 30, step_sleep=0.1
    )
    assert result.returncode == 0, result.stderr
    assert "OTLP" not in result.stderr
    summary = load_summary(tmp_path / "logs" / "otlp-dead")
    assert {r["rank"]: r["steps_completed"] for r in summary["ranks"]} == {0: 30, 1: 30}
    log_text = (tmp_path / "logs" / "otlp-dead" / "aggregator" / "process.stderr.log").read_text()
    said = [line for line in log_text.splitlines() if "training goes on" in line]
    assert len(said) == 1 and f"OTLP export to http://127.0.0.1:{dead} failed (" in said[0], (
        log_text
    )
    target, sent, sent_points, failed, dropped, _ = totals(log_text)
    assert (target, sent, sent_points) == (f"http://127.0.0.1:{dead}", 0, 0)
    assert failed >= 1 and dropped >= failed, log_text  # the last push's at least


@pytest.mark.slow
@pytest.mark.torchrun
def test_without_the_otlp_extra_one_line_says_so_and_training_goes_on(tmp_path, receiver):
    """The packages are hidden: a package ``opentelemetry`` of its own, first on the path,
    has no ``sdk``."""
    hidden = tmp_path / "hidden"
    (hidden / "opentelemetry").mkdir(parents=True)
    (hidden / "opentelemetry" / "__init__.py").write_text("")
    env = {"PYTHONPATH": os.pathsep.join([str(hidden), os.environ.get("PYTHONPATH", "")])}
    result = run_job(tmp_path, "otlp-none", ["--otlp-endpoint", receiver.url], 5, env=env)
    assert result.returncode == 0, result.stderr
    line = (
        "OTLP export off: opentelemetry.sdk.metrics is not installed (pip install "
        "'traceml-insight[otlp]'); training goes on without it"
    )
    assert [x for x in result.stderr.splitlines() if "OTLP" in x] == [f"traceml: {line}"]
    log_text = (tmp_path / "logs" / "otlp-none" / "aggregator" / "process.stderr.log").read_text()
    assert [x for x in log_text.splitlines() if "OTLP" in x] == [f"traceml-aggregator: {line}"]
    summary = load_summary(tmp_path / "logs" / "otlp-none")
    assert {r["rank"]: r["steps_completed"] for r in summary["ranks"]} == {0: 5, 1: 5}
    assert receiver.count() == 0


@pytest.mark.alone  # a bound of ms on the event loop (see test_metrics.py's twin)
def test_a_push_at_1024_ranks_never_holds_the_event_loop_past_the_scrape_bound(receiver):
    """The push of 1,024 ranks' full windows (512 steps each) to a real receiver: the loop's
    longest hold (its thread's CPU time between two turns of a 1 ms ticker) stays under the
    scrape's LOOP_HOLD_BOUND_S, the series being built, encoded and sent in the analysis
    process; every rank's step count arrives."""
    import asyncio
    import gc

    from test_metrics import RANKS_AT_SCALE, batches_at_scale

    from traceml.core.heap import freeze_startup_objects
    from traceml_aggregator.live import LiveAggregates
    from traceml_aggregator.metrics import LOOP_HOLD_BOUND_S

    live = LiveAggregates(RUN, RANKS_AT_SCALE)
    pusher = otlp.OtlpPush(live, otlp.Options(receiver.url, RUN), receiver.url, 3600.0)
    # As the aggregator does once serving (traceml/core/heap.py): here it is the test process's
    # heap (pytest, every module it imported) that a full collection on the loop would walk,
    # 160-300 ms of it measured; the windows fed below stay collectable.
    gc.collect()
    freeze_startup_objects()

    async def main() -> float:
        await live.summary()  # starts the analysis process (not measured)
        for b in batches_at_scale(512):
            live.on_batch(b)
        gc.collect()  # as test_metrics.py's twin does, and why
        async with LoopHold() as hold:
            await pusher.final()
        return hold.max_s

    try:
        hold_s = asyncio.run(main())
    finally:
        live.close()
        gc.unfreeze()
    points, _, _ = receiver.latest()
    assert steps_of(points) == {str(r): 512 for r in range(RANKS_AT_SCALE)}
    counts = {v for k, v in points.items() if k[0] == "traceml_step_time_seconds_count"}
    assert counts == {32}  # the analysis covers 32 steps a rank at 1,024 ranks
    assert (pusher.counts["failed"], pusher.counts["points_sent"]) == (0, len(points))
    assert pusher.counts["exports"] == receiver.count() == -(-len(points) // otlp.BATCH_POINTS)
    print(f"the loop was held {hold_s * 1000:.1f} ms at most; {len(points)} data points")
    assert hold_s < LOOP_HOLD_BOUND_S, f"the loop was held {hold_s * 1000:.0f} ms"
