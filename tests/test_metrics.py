"""Prometheus /metrics of a real aggregator (--metrics-port): parsed with prometheus-client's
parser, its per-rank step counts match the store at the end."""

from __future__ import annotations

import urllib.request

from conftest import free_port
from live_aggregator import LiveAggregator
from prometheus_client.parser import text_string_to_metric_families

from traceml import wire
from traceml.core import endpoint
from traceml.wire.records import add_steps

RUN = "prom"
START_US = 1_700_000_000_000_000


def push(target: str, batch: wire.Batch) -> None:
    ack = endpoint.call(target, "Push", batch, 10.0)
    assert ack.stored_seq == batch.seq and not ack.rejected, ack


def rank_batches(rank: int, n_steps: int, per_batch: int = 200) -> list[wire.Batch]:
    """Rank ``rank``'s steps 0..n-1 of 10 ms + rank ms (forward 3 ms), in batches."""
    out = []
    for seq, first in enumerate(range(0, n_steps, per_batch), start=1):
        b = wire.Batch(run_name=RUN, rank=rank, seq=seq)
        if seq == 1:
            b.identity.CopyFrom(wire.RankIdentity(
                run_name=RUN, rank=rank, node_rank=rank, world_size=2, hostname=f"h{rank}",
                start_unix_us=START_US,
            ))  # fmt: skip
        add_steps(b, (
            {"step": i, "end_us": 20_000 * (i + 1), "step_us": 10_000 + 1000 * rank,
             "forward_us": 3000}
            for i in range(first, min(first + per_batch, n_steps))
        ))  # fmt: skip
        b.process_samples.add(unix_us=START_US, cpu_percent=97.5, rss_bytes=123456)
        out.append(b)
    return out


def scrape(port: int) -> dict[str, list]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def by_rank(samples, name: str) -> dict[str, float]:
    return {s.labels["rank"]: s.value for s in samples if s.name == name}


def test_metrics_parse_and_their_step_counts_match_the_store(tmp_path):
    port = free_port()
    agg = LiveAggregator(tmp_path / "run", RUN, world_size=2,
                         extra_args=("--metrics-port", str(port)))  # fmt: skip
    with agg:
        for rank, n in ((0, 300), (1, 1234)):
            for b in rank_batches(rank, n):
                push(agg.target, b)
        # rank 1's sender has dropped 7 records so far (buffer full): known before its finish
        late = wire.Batch(run_name=RUN, rank=1, seq=len(rank_batches(1, 1234)) + 1)
        late.counts.records_dropped, late.counts.records_produced = 7, 1250
        push(agg.target, late)
        node = wire.Batch(run_name=RUN, node_rank=1, seq=1)
        s = node.system_samples.add(unix_us=START_US, node_rank=1, hostname="h1",
                                    cpu_percent=42.0, ram_used_bytes=1 << 30)  # fmt: skip
        s.gpus.add(nvml_index=3, uuid="GPU-x", util_percent=88.0, memory_used_bytes=1 << 20)
        push(agg.target, node)
        families = scrape(port)
        assert agg.stop() == 0
        stored = dict(agg.query("SELECT rank, COUNT(*) FROM steps GROUP BY rank"))

    steps = by_rank(families["traceml_steps_total"], "traceml_steps_total")
    assert steps == {"0": 300.0, "1": 1234.0}
    assert {int(r): int(v) for r, v in steps.items()} == stored
    step_time = families["traceml_step_time_seconds"]
    quantiles = {(s.labels["rank"], s.labels["quantile"]): s.value for s in step_time
                 if s.name == "traceml_step_time_seconds"}  # fmt: skip
    assert quantiles == {("0", "0.5"): 0.01, ("0", "0.95"): 0.01,
                         ("1", "0.5"): 0.011, ("1", "0.95"): 0.011}  # fmt: skip
    counts = by_rank(step_time, "traceml_step_time_seconds_count")
    assert counts == {"0": 300.0, "1": 512.0}  # the window: the latest 512 steps
    forward = {(s.labels["rank"], s.labels["phase"]): s.value
               for s in families["traceml_phase_median_seconds"]}  # fmt: skip
    assert forward == {("0", "forward"): 0.003, ("1", "forward"): 0.003}
    last = by_rank(families["traceml_last_step_timestamp_seconds"],
                   "traceml_last_step_timestamp_seconds")  # fmt: skip
    assert last == {"0": (START_US + 20_000 * 300) / 1e6, "1": (START_US + 20_000 * 1234) / 1e6}
    assert {s.labels["node"] for s in families["traceml_steps_total"]} == {"0", "1"}
    assert by_rank(families["traceml_process_cpu_percent"], "traceml_process_cpu_percent") == {
        "0": 97.5, "1": 97.5
    }
    assert [(s.labels, s.value) for s in families["traceml_gpu_util_percent"]] == [
        ({"node": "1", "gpu": "3"}, 88.0)
    ]
    assert [s.value for s in families["traceml_node_cpu_percent"]] == [42.0]
    dropped = by_rank(families["traceml_records_dropped_total"], "traceml_records_dropped_total")
    assert dropped == {"1": 7.0}  # rank 0's batches carried no counts, and no finish marker


def test_a_bad_metrics_port_is_refused_in_one_line(tmp_path):
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-m", "traceml_aggregator", "--run-dir", str(tmp_path), "--run-name",
         RUN, "--metrics-port", "70000"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2
    assert "--metrics-port 70000 is not a TCP port (1-65535)" in result.stderr
