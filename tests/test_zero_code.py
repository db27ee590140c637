"""Zero-code runs: ``traceml run`` on a script that never imports TraceML.

The launcher's node sampler still streams system samples and each worker's CPU and RSS (found
through torchrun's ``RANK``/``TORCHELASTIC_RESTART_COUNT``), and the run ends normally with a
summary even though no step was ever traced.
"""

from __future__ import annotations

import pytest

from conftest import SCRIPTS, query, run_traceml


@pytest.mark.slow
def test_zero_code_run_yields_system_and_process_rows(tmp_path, port):
    result = run_traceml(
        [
            "run", str(SCRIPTS / "zero_code.py"), "--nproc-per-node=2",
            "--aggregator-port", str(port), "--logs-dir", str(tmp_path / "logs"),
            "--run-name", "zero",
        ],
        cwd=tmp_path,
        env={"TRACEML_SAMPLE_INTERVAL_SEC": "0.2"},
    )
    assert result.returncode == 0, result.stderr
    run_dir = tmp_path / "logs" / "zero"
    assert (run_dir / "final_summary.json").is_file()

    [(systems, nodes, ram_total)] = query(
        run_dir,
        "SELECT COUNT(*), COUNT(DISTINCT node_rank), MIN(ram_total_bytes) FROM system_samples",
    )
    assert systems >= 5 and nodes == 1 and ram_total > 0  # seconds of training at 0.2 s
    assert query(run_dir, "SELECT COUNT(cpu_percent) FROM system_samples")[0][0] >= systems - 1

    per_rank = query(
        run_dir,
        "SELECT rank, restart, COUNT(*), MAX(rss_bytes), COUNT(cpu_percent), "
        "COUNT(gpu_allocated_bytes) FROM process_samples GROUP BY rank, restart ORDER BY rank",
    )
    assert [(r[0], r[1]) for r in per_rank] == [(0, 0), (1, 0)]
    for _, _, samples, max_rss, with_cpu, with_gpu in per_rank:
        assert samples >= 3 and max_rss > 50 * 2**20  # a Python process with torch loaded
        assert with_cpu == samples - 1  # CPU % needs a previous reading: absent in the first
        assert with_gpu == 0  # only the rank's SDK can read the CUDA allocator

    # No SDK: no identity, no steps, no finish marker; the launcher's end report is there.
    assert query(run_dir, "SELECT COUNT(*) FROM steps") == [(0,)]
    assert query(run_dir, "SELECT COUNT(*) FROM ranks") == [(0,)]
    assert query(run_dir, "SELECT COUNT(*) FROM rank_finish") == [(0,)]
    assert query(run_dir, "SELECT rank, end_state FROM rank_ends ORDER BY rank") == [
        (0, "completed"), (1, "completed")
    ]
