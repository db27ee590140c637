"""Processes the script starts itself: under ``traceml run --nproc-per-node=1``, children of
``torch.multiprocessing.spawn`` that build their own process group are each their own rank.

Every child inherits torchrun's ``RANK=0``; before the fix the second child to stream was
refused as "rank 0 already streamed from another pid" and its telemetry was lost. Now each
takes its rank from ``torch.distributed`` (with one warning naming its pid) and the summary
holds both, with their steps."""

from __future__ import annotations

import re

from conftest import SCRIPTS, load_summary, query, run_traceml


def test_spawned_children_are_each_their_own_rank(tmp_path, port):
    run_dir = tmp_path / "logs" / "spawn"
    result = run_traceml(
        ["run", str(SCRIPTS / "spawn_ddp.py"), "--nproc-per-node=1", "--run-name", "spawn",
         "--aggregator-port", str(port), "--logs-dir", str(tmp_path / "logs"),
         "--nprocs", "2", "--steps", "5"],
        tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = load_summary(run_dir)
    assert {r["rank"]: r["steps_completed"] for r in summary["ranks"]} == {0: 5, 1: 5}
    assert {r["rank"]: r["records_received"] for r in summary["ranks"]} == {0: 5, 1: 5}
    pids = dict(query(run_dir, "SELECT rank, pid FROM ranks ORDER BY rank"))
    assert len(set(pids.values())) == 2
    stderr = (run_dir / "nodes" / "node_0" / "training.stderr.log").read_text()
    for rank, pid in pids.items():
        assert re.search(
            rf"traceml: pid {pid} is rank {rank} of a process group of 2 that the script built "
            r"itself \(torchrun started it as rank 0 of 1\)", stderr), stderr[-2000:]
    assert "rejected" not in stderr
