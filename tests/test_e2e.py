"""The main job, end to end: `traceml run examples/ddp_minimal.py --nproc-per-node=2`.

Real torchrun, real DDP over gloo with two ranks, real gRPC to a real aggregator, real SQLite;
then the artifacts are checked against what the script is known to have done.
"""

from __future__ import annotations

import json

import pytest
from conftest import EXAMPLES, free_port, load_summary, query, run_traceml
from helpers.aggregator import relay_calls
from helpers.jobs import tmp_leftovers

STEPS = 70  # crosses an epoch: the example's DataLoader has 64 batches per rank
RUN = "e2e-main"

pytestmark = [pytest.mark.slow, pytest.mark.torchrun, pytest.mark.smoke]


@pytest.fixture(scope="module", params=["--node-relay", "--no-node-relay"])
def main_job(request, tmp_path_factory):
    """One run of the main job, shared by the tests below: its ranks and sampler stream
    through the node relay (the default), then straight to node 0."""
    cwd = tmp_path_factory.mktemp("main-job")
    (cwd / "tmp").mkdir()  # the job's TMPDIR: what it leaves there is checked below
    result = run_traceml(
        [
            "run",
            str(EXAMPLES / "ddp_minimal.py"),
            "--nproc-per-node=2",
            "--run-name",
            RUN,
            "--aggregator-port",
            str(free_port()),
            request.param,
            "--steps",
            str(STEPS),
        ],
        cwd,
        env={"TMPDIR": str(cwd / "tmp")},
    )
    return result, cwd / "logs" / RUN


def test_the_run_leaves_nothing_in_tmp(main_job):
    """Plain torchrun leaves a ``torchelastic_*`` directory a run; the launcher's own log
    directory for it goes with it (tests/test_torchrun_command.py)."""
    _, run_dir = main_job
    assert tmp_leftovers(run_dir.parent.parent / "tmp") == []


def test_the_streams_took_the_path_asked_for_and_ended_closed(main_job):
    result, run_dir = main_job
    relayed = "--node-relay" in result.args
    assert relay_calls((run_dir / "aggregator" / "process.stderr.log").read_text()) == relayed
    manifest = json.loads((run_dir / "nodes" / "node_0" / "manifest.json").read_text())
    assert manifest["launch"]["node_relay"] is relayed
    streams = load_summary(run_dir)["run"]["telemetry_health"]["sender_streams"]
    assert [(s["sender"], s["id"], s["state"], s["streams"]) for s in streams] == [
        ("rank", 0, "closed", 1),
        ("rank", 1, "closed", 1),
        ("node", 0, "closed", 1),
    ]


def test_exit_code_zero_and_artifacts(main_job):
    result, run_dir = main_job
    assert result.returncode == 0, result.stderr[-3000:]
    for name in ("final_summary.json", "final_summary.txt", "telemetry.sqlite", "manifest.json"):
        assert (run_dir / name).is_file(), name
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["status"] == "completed" and manifest["exit_code"] == 0
    assert manifest["aggregator"]["status"] == "stopped"
    assert manifest["aggregator"]["exit_code"] == 0
    assert f"trained {STEPS} steps" in result.stdout


def test_summary_has_every_rank_with_exact_steps_and_consistent_times(main_job):
    _, run_dir = main_job
    summary = load_summary(run_dir)
    assert isinstance(summary["schema_version"], int)
    assert summary["run"]["run_name"] == RUN
    assert summary["run"]["world_size"] == 2
    assert summary["run"]["complete"] is True and summary["run"]["missing_ranks"] == []
    ranks = {r["rank"]: r for r in summary["ranks"]}
    assert set(ranks) == {0, 1}
    for r in ranks.values():
        assert r["steps_completed"] == STEPS
        assert r["records_received"] == STEPS
        assert r["records_dropped"] == 0
        assert r["end"]["state"] == "completed" and r["end"]["exit_code"] == 0
        st = r["step_time_ms"]
        assert 0 < st["median"] <= st["p95"] <= st["max"]
        assert st["mean"] > 0
        phases = r["phase_median_ms"]
        for name in ("input_wait", "forward", "backward", "optimizer"):
            assert phases[name] is not None and phases[name] > 0, name
        assert phases["h2d"] is None  # CPU: never measured, so null, never 0


def test_sqlite_holds_exactly_one_row_per_step_per_rank(main_job):
    _, run_dir = main_job
    per_rank = query(
        run_dir,
        "SELECT rank, restart, COUNT(*), COUNT(DISTINCT step), MIN(step), MAX(step) "
        "FROM steps GROUP BY rank, restart ORDER BY rank",
    )
    assert per_rank == [(0, 0, STEPS, STEPS, 0, STEPS - 1), (1, 0, STEPS, STEPS, 0, STEPS - 1)]
    assert query(
        run_dir,
        "SELECT rank, steps_completed, records_dropped, end_state FROM rank_finish ORDER BY rank",
    ) == [(0, STEPS, 0, "completed"), (1, STEPS, 0, "completed")]
    assert query(
        run_dir, "SELECT rank, world_size, backend, parallelism FROM ranks ORDER BY rank"
    ) == [(0, 2, "gloo", "ddp"), (1, 2, "gloo", "ddp")]
    # Phases are disjoint parts of their step: they never add up to more than the step.
    over = query(
        run_dir,
        "SELECT rank, step FROM steps WHERE COALESCE(input_wait_us, 0) + forward_us"
        " + backward_us + optimizer_us > step_us",
    )
    assert over == []
    # The first step has no input wait (nothing before it); every later one has.
    assert (
        query(run_dir, "SELECT rank, step FROM steps WHERE (input_wait_us IS NULL) != (step = 0)")
        == []
    )


def test_text_summary_is_printed_and_written(main_job):
    result, run_dir = main_job
    text = (run_dir / "final_summary.txt").read_text()
    assert text.startswith("TraceML summary")
    assert RUN in text.splitlines()[0]
    assert text in result.stdout  # the launcher prints the same report
    starts = [line.split()[:3] for line in text.splitlines()]
    for rank in (0, 1):  # its row of the step-time table: rank, node, steps, ...
        assert [str(rank), "0", str(STEPS)] in starts
