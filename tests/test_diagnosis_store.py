"""Reports from data stored through the real Store API with real wire messages: zero-code runs
(system and process samples only), partial summaries, restarted attempts, schema validity."""

from __future__ import annotations

import json
import time
from functools import partial
from pathlib import Path

import jsonschema
import pytest
from helpers import batches
from helpers.batches import START_US

from traceml import wire
from traceml.report import read_summary
from traceml_aggregator.reports import HTML_AFTER_DEADLINE_S, write_reports
from traceml_aggregator.store import Store

SCHEMA = json.loads(
    (Path(__file__).resolve().parents[1] / "docs" / "final_summary.schema.json").read_text()
)
GIB = 1024**3


#: The ranks' identities (:func:`batches.rank_identity`), with the torch version they report.
identity = partial(batches.rank_identity, torch_version="2.13.0")


def steps(n: int, input_us: int = 1000) -> list[wire.StepColumns]:
    """``n`` steps of 20 ms as the wire carries them: one group of columns (µs)."""
    return [
        wire.StepColumns(
            step=range(n),
            end_us=[(i + 1) * 20_000 for i in range(n)],
            step_us=[20_000] * n,
            input_wait_us=[input_us] * n,
            forward_us=[8000] * n,
            backward_us=[9000] * n,
            optimizer_us=[1000] * n,
        )
    ]


def node_samples(seq: int) -> wire.Batch:
    """What the node sampler sends for a script that never calls traceml: host and processes."""
    batch = wire.Batch(run_name="r", node_rank=0, seq=seq)
    for k in range(5):
        t = START_US + k * 1_000_000
        batch.system_samples.append(
            wire.SystemSample(
                unix_us=t,
                node_rank=0,
                hostname="h0",
                cpu_percent=40.0 + k,
                ram_used_bytes=8 * GIB,
                ram_total_bytes=32 * GIB,
                gpu_unavailable_reason="NVML Shared Library Not Found",
            )
        )
        for r in range(2):
            batch.process_samples.append(
                wire.ProcessSample(unix_us=t, rank=r, cpu_percent=99.0, rss_bytes=(1 + r) * GIB)
            )
    return batch


def node_exit(states=("completed", "completed"), code=0) -> wire.NodeExit:
    return batches.node_exit([batches.rank_end(r, s) for r, s in enumerate(states)], exit_code=code)


@pytest.fixture
def store(tmp_path):
    s = Store(tmp_path / "telemetry.sqlite")
    s.set_meta("run_name", "r")
    s.set_meta("world_size", "2")
    yield s
    s.close()


def _report(store: Store, run_dir: Path, missing: list[int]) -> dict:
    outcome = write_reports(store, run_dir, missing, html=True)
    summary = read_summary(outcome.json_path)
    jsonschema.validate(summary, SCHEMA)
    assert outcome.html_path.read_text().startswith("<!doctype html>")
    return summary


def test_zero_code_run_reports_missing_steps_and_system_figures(store, tmp_path):
    store.write_batches([node_samples(1)], START_US)
    store.write_node_exit(node_exit(), START_US)
    s = _report(store, tmp_path, [])
    p = s["primary_diagnosis"]
    assert p["kind"] == "INSUFFICIENT_DATA"
    assert p["evidence"] == {
        "missing": ["steps"],
        "ranks_without_steps": [0, 1],
        "statistic": "events",
    }
    assert "traceml.init()" in p["action"] and "traceml.trace_step(model)" in p["action"]
    system = s["nodes"][0]["system"]
    assert system["samples"] == 5
    assert system["cpu_percent"]["median"] == 42.0
    assert system["ram_used_pct_max"] == 25.0
    assert system["gpus"] == [] and system["unavailable_reason"] == "NVML Shared Library Not Found"
    assert [r["process"]["rss_bytes_max"] for r in s["ranks"]] == [GIB, 2 * GIB]
    assert [r["end"]["state"] for r in s["ranks"]] == ["completed", "completed"]
    text = (tmp_path / "final_summary.txt").read_text()
    assert "INSUFFICIENT_DATA" in text and "traceml.init()" in text
    assert "cpu %" in text and "42" in text


def test_partial_summary_names_the_missing_rank(store, tmp_path):
    store.write_batches(
        [
            wire.Batch(
                run_name="r",
                rank=0,
                seq=1,
                identity=identity(0),
                step_groups=steps(30),
                finish=wire.RankFinish(
                    last_seq=1, steps_completed=30, end_state=wire.EndState.END_STATE_COMPLETED
                ),
            ),
            wire.Batch(run_name="r", rank=1, seq=1, identity=identity(1), step_groups=steps(30)),
        ],
        START_US,
    )
    s = _report(store, tmp_path, [1])
    assert s["run"]["complete"] is False and s["run"]["missing_ranks"] == [1]
    missing = [f for f in s["findings"]["health"] if f["kind"] == "RANK_MISSING"]
    assert missing[0]["ranks"] == [1] and missing[0]["severity"] == "critical"
    assert s["ranks"][1]["end"]["state"] == "running"
    # rank 1 completed its 30 steps as rank 0 did and never exited: that wait is the run's
    # largest loss of wall time (issue 24 item 3); the steps stored still count, and their
    # verdict comes first among the step-time findings
    hung = s["primary_diagnosis"]
    assert hung["kind"] == "RANK_HUNG"
    assert [e["rank"] for e in hung["evidence"]["not_exited"]] == [1]
    assert hung["summary"].startswith("Rank 1 completed its 30 steps, then did not exit for ")
    assert s["findings"]["step_time"][0]["kind"] == "COMPUTE_BOUND"
    text = (tmp_path / "final_summary.txt").read_text()
    assert "PARTIAL   rank 1 never finished (its data may be incomplete)\n" in text


def test_restarted_attempts_stay_apart(store, tmp_path):
    store.write_batches(
        [
            wire.Batch(
                run_name="r", rank=r, seq=1, identity=identity(r), step_groups=steps(12, 9000)
            )
            for r in range(2)
        ],
        START_US,
    )
    store.write_batches(
        [
            wire.Batch(
                run_name="r",
                rank=r,
                restart_count=1,
                seq=1,
                identity=identity(r, 1),
                step_groups=steps(30),
            )
            for r in range(2)
        ],
        START_US,
    )
    s = _report(store, tmp_path, [])
    assert s["run"]["attempt"] == 1
    assert [r["earlier_attempts"] for r in s["ranks"]] == [{"0": 12}, {"0": 12}]
    assert [r["records_received"] for r in s["ranks"]] == [30, 30]
    # the first attempt's 9 ms input wait does not leak into the latest attempt's analysis
    assert s["analysis"]["typical"]["phase_median_ms"]["input_wait"] == 1.0
    assert "RESTARTED" in [f["kind"] for f in s["findings"]["health"]]


def test_failed_rank_end_state_in_reports(store, tmp_path):
    store.write_batches(
        [
            wire.Batch(run_name="r", rank=r, seq=1, identity=identity(r), step_groups=steps(30))
            for r in range(2)
        ],
        START_US,
    )
    store.write_node_exit(node_exit(("failed", "terminated"), code=1), START_US)
    s = _report(store, tmp_path, [])
    assert [r["end"]["state"] for r in s["ranks"]] == ["failed", "terminated"]
    kinds = [f["kind"] for f in s["findings"]["health"]]
    assert kinds[:2] == ["RANK_CRASHED", "RANK_TERMINATED"] and "NODE_FAILED" in kinds
    text = (tmp_path / "final_summary.txt").read_text()
    assert "rank 0: failed, exit code 1" in text


def test_past_the_finalization_deadline_the_summary_is_written_and_the_html_left_out(
    store, tmp_path, caplog
):
    """The deadline is checked once the summary is written: more than HTML_AFTER_DEADLINE_S
    past it, final_summary.json and .txt are those of a finalization in time, and the HTML
    report is left out with one warning line that says how to draw it later; within it (a
    partial summary written after the budget went to waiting for ranks) it is drawn."""
    store.write_batches([node_samples(1)], START_US)
    store.write_node_exit(node_exit(), START_US)
    (tmp_path / "in_time").mkdir(), (tmp_path / "late").mkdir()
    in_time = write_reports(
        store, tmp_path / "in_time", [], html=True, deadline=time.monotonic() - 1
    )
    late = write_reports(
        store, tmp_path / "late", [], html=True, deadline=time.monotonic() - HTML_AFTER_DEADLINE_S
    )
    assert in_time.html_path.exists() and late.html_path is None
    assert sorted(p.name for p in (tmp_path / "late").iterdir()) == [
        "final_summary.json",
        "final_summary.txt",
    ]

    def stable(path: Path) -> dict:  # the summary less when it was written
        summary = json.loads(path.read_text())
        del summary["generated_unix_s"]
        return summary

    assert stable(late.json_path) == stable(in_time.json_path)
    assert late.text == in_time.text == (tmp_path / "late" / "final_summary.txt").read_text()
    warnings = [r.getMessage() for r in caplog.records if "left out" in r.getMessage()]
    assert warnings == [
        "warning: final_summary.html left out: the summary was written more than 15 s past "
        f"the finalization's deadline (traceml view {tmp_path / 'late'} --html PATH draws it)"
    ]
