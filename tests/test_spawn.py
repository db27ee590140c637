"""Processes the script starts itself: under ``traceml run --nproc-per-node=1``, children of
``torch.multiprocessing.spawn`` that build their own process group are never merged into one
rank.

Every child inherits torchrun's ``RANK=0``. Each takes its rank from ``torch.distributed`` and
says so in one line naming its pid; the aggregator, which validates senders against the run's
world size (torchrun's: 1), then refuses both children with a reason (world size 2 for rank 0,
rank 1 out of range) and counts the refusals in ``run.rejected``: nothing of theirs is stored
under torchrun's rank 0, whose own record shows the steps it ran itself (none)."""

from __future__ import annotations

import re

from conftest import SCRIPTS, load_summary, query, run_traceml


def test_spawned_children_are_named_and_refused_never_merged(tmp_path, port):
    run_dir = tmp_path / "logs" / "spawn"
    result = run_traceml(
        ["run", str(SCRIPTS / "spawn_ddp.py"), "--nproc-per-node=1", "--run-name", "spawn",
         "--aggregator-port", str(port), "--logs-dir", str(tmp_path / "logs"),
         "--nprocs", "2", "--steps", "5"],
        tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = load_summary(run_dir)
    assert [(r["rank"], r["steps_completed"], r["records_received"]) for r in summary["ranks"]] == [
        (0, 0, 0)
    ]
    assert summary["run"]["rejected"] == {"rank_out_of_range": 1, "world_size_mismatch": 1}
    assert query(run_dir, "SELECT COUNT(*) FROM steps") == [(0,)]
    stderr = (run_dir / "nodes" / "node_0" / "training.stderr.log").read_text()
    children = re.findall(
        r"traceml: pid (\d+) is rank (\d) of a process group of 2 that the script built "
        r"itself \(torchrun started it as rank 0 of 1\)", stderr)
    assert sorted(rank for _, rank in children) == ["0", "1"], stderr[-2000:]
    assert len({pid for pid, _ in children}) == 2
    assert stderr.count("aggregator rejected telemetry") == 2
