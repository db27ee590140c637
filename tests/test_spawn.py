"""Processes the script starts itself: under ``traceml run --nproc-per-node=1``, children of
``torch.multiprocessing.spawn`` that build their own process group are never merged into one
rank, and their world becomes the run's.

Every child inherits torchrun's ``RANK=0``. Each takes its rank from ``torch.distributed`` and
says so in one line naming its pid, and its identity says the world is its script's own
process group. The aggregator, whose world is torchrun's (1), takes that group as the run's
world when the children agree on it (one world size, one node, distinct ranks, the run's
token): the summary holds them as the run's ranks, with a SCRIPT_PROCESS_GROUP finding saying
so. What does not agree is refused, and the summary says why (TELEMETRY_REFUSED, with each
kind's first reason), not only the console."""

from __future__ import annotations

import re

import pytest
from conftest import SCRIPTS, load_summary, query, run_traceml
from live_aggregator import LiveAggregator

from traceml import wire
from traceml.core import endpoint

pytestmark = [pytest.mark.slow, pytest.mark.torchrun, pytest.mark.aggregator]


def test_spawned_children_are_the_runs_ranks(tmp_path, port):
    """Two spawned children (a world of 2 against torchrun's 1: each child a torch start-up,
    so no more than the claim needs) become the run's ranks 0 and 1."""
    run_dir = tmp_path / "logs" / "spawn"
    result = run_traceml(
        [
            "run",
            str(SCRIPTS / "spawn_ddp.py"),
            "--nproc-per-node=1",
            "--run-name",
            "spawn",
            "--aggregator-port",
            str(port),
            "--logs-dir",
            str(tmp_path / "logs"),
            "--nprocs",
            "2",
            "--steps",
            "5",
            "--finalize-timeout-sec",
            "60",
        ],
        tmp_path,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = load_summary(run_dir)
    assert summary["run"]["world_size"] == 2
    assert [(r["rank"], r["steps_completed"], r["records_received"]) for r in summary["ranks"]] == [
        (rank, 5, 5) for rank in range(2)
    ]
    # torchrun's own process (the children's parent, instrumented too) reports nothing itself.
    assert summary["run"]["rejected"] == {"script_parent": 1}
    assert summary["run"]["complete"] is True and summary["run"]["missing_ranks"] == []
    assert query(run_dir, "SELECT rank, COUNT(*) FROM steps GROUP BY rank") == [
        (rank, 5) for rank in range(2)
    ]
    world = [f for f in summary["findings"]["health"] if f["kind"] == "SCRIPT_PROCESS_GROUP"]
    assert [(f["severity"], f["ranks"], f["nodes"], f["evidence"]) for f in world] == [
        (
            "info",
            [0, 1],
            [0],
            {"statistic": "events", "world_size": 2, "node_rank": 0, "launched_world_size": 1},
        )
    ]
    assert world[0]["summary"].startswith(
        "The run's world came from the script's own process group: 2 ranks on node 0"
    )
    assert "(1 calls refused as script_parent: torchrun's rank 0 of 1 (pid " in world[0]["summary"]
    assert "TELEMETRY_REFUSED" not in {f["kind"] for f in summary["findings"]["health"]}
    text = " ".join((run_dir / "final_summary.txt").read_text().split())  # lines unwrapped
    assert "[info] SCRIPT_PROCESS_GROUP: The run's world came from the script's own process" in text
    stderr = (run_dir / "nodes" / "node_0" / "training.stderr.log").read_text()
    children = re.findall(
        r"traceml: pid (\d+) is rank (\d) of a process group of 2 that the script built "
        r"itself \(torchrun started it as rank 0 of 1\)",
        stderr,
    )
    assert sorted(rank for _, rank in children) == ["0", "1"], stderr[-2000:]
    assert len({pid for pid, _ in children}) == 2
    refused = re.findall(r"aggregator rejected telemetry: (.*)", stderr)
    assert len(refused) == 1 and refused[0].startswith("torchrun's rank 0 of 1 (pid "), refused


def identity_batch(rank: int, world_size: int, node_rank: int, own: bool) -> wire.Batch:
    return wire.Batch(
        run_name="world",
        rank=rank,
        seq=1,
        identity=wire.RankIdentity(
            run_name="world",
            rank=rank,
            world_size=world_size,
            node_rank=node_rank,
            pid=1000 + rank,
            own_process_group=own,
        ),
    )


def test_what_disagrees_with_the_scripts_world_is_refused_and_explained(tmp_path):
    """A real aggregator of a world of 1 (torchrun's): the first own group (2 ranks, node 0)
    becomes the run's; an own group of 3 and one on node 1 are refused (the summary explains
    each kind with its first reason), and so is torchrun's rank of world 1 on that node, the
    script's parent (``script_parent``, said by the group's finding)."""
    agg = LiveAggregator(tmp_path / "run", "world", world_size=1)
    with agg:
        acks = [
            endpoint.call(agg.target, "Push", identity_batch(*args), 10.0)
            for args in (
                (0, 2, 0, True),
                (1, 3, 0, True),
                (1, 2, 1, True),
                (1, 2, 0, True),
                (0, 1, 0, False),
            )
        ]
        assert [(a.stored_seq, a.rejected) for a in acks] == [
            (1, False),
            (0, True),
            (0, True),
            (1, False),
            (0, True),
        ]
        assert agg.stop() == 0
    summary = load_summary(tmp_path / "run")
    assert summary["run"]["world_size"] == 2
    assert [r["rank"] for r in summary["ranks"]] == [0, 1]
    assert summary["run"]["rejected"] == {"script_world_mismatch": 2, "script_parent": 1}
    refused = [f for f in summary["findings"]["health"] if f["kind"] == "TELEMETRY_REFUSED"]
    assert len(refused) == 1 and refused[0]["severity"] == "warning"
    # torchrun's own process of world 1 on node 0, which started the group, is not a
    # refusal to explain: the SCRIPT_PROCESS_GROUP finding says it reports nothing itself
    assert refused[0]["summary"] == (
        "The aggregator refused 2 calls and stored nothing of them: 2 script_world_mismatch "
        "(the first: rank 1's own process group of 3: the script's first one, the run's "
        "world, has 2)."
    )
    group = [f for f in summary["findings"]["health"] if f["kind"] == "SCRIPT_PROCESS_GROUP"]
    assert (
        "Torchrun's own process, which started them, reports nothing itself"
        in (group[0]["summary"])
    )
    kinds = {f["kind"] for f in summary["findings"]["health"]}
    assert "SCRIPT_PROCESS_GROUP" in kinds
    assert "TELEMETRY_REFUSED" in (tmp_path / "run" / "final_summary.txt").read_text()
