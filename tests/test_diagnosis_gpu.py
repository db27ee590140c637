"""GPU-machine diagnoses under real `traceml run` (skipped without CUDA): H2D-bound on the GPU
clock, memory creep told apart from the caching allocator's warm-up plateau."""

from __future__ import annotations

import pytest
from conftest import SCRIPTS, free_port, load_summary, run_traceml

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.torchrun,
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

#: Every step GPU-timed and every other step a memory reading, so 40 steps are plenty.
ENV = {"TRACEML_GPU_TIMING_EVERY_N_STEPS": "1", "TRACEML_MEMORY_EVERY_N_STEPS": "2"}


def _run(scenario: str, tmp_path) -> dict:
    proc = run_traceml(
        [
            "run",
            str(SCRIPTS / "planted_gpu.py"),
            "--nproc-per-node=1",
            f"--aggregator-port={free_port()}",
            f"--run-name={scenario}",
            f"--logs-dir={tmp_path}",
            "--",
            "--scenario",
            scenario,
        ],
        cwd=tmp_path,
        env=ENV,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return load_summary(tmp_path / scenario)


def test_h2d_bound_on_the_gpu_clock(tmp_path):
    s = _run("h2d", tmp_path)
    assert s["analysis"]["clock"]["name"] == "gpu"
    p = s["primary_diagnosis"]
    assert p["kind"] == "H2D_BOUND"
    assert p["evidence"]["typical_share_pct"] >= 15.0
    assert s["ranks"][0]["phase_median_ms"]["h2d"] > s["ranks"][0]["phase_median_ms"]["forward"]


def test_memory_creep(tmp_path):
    s = _run("creep", tmp_path)
    creep = [f for f in s["findings"]["memory"] if f["kind"] == "MEMORY_CREEP"]
    assert creep and creep[0]["ranks"] == [0]
    trend = s["ranks"][0]["memory"]["trend"]
    assert trend["name"] == "creep"
    # 64 MiB kept per step: about 64 MiB x 1000 per 1000 steps
    assert 0.8 * 64_000 <= trend["bytes_per_1k_steps"] / 2**20 <= 1.2 * 64_000


def test_allocator_warmup_is_a_plateau(tmp_path):
    s = _run("plateau", tmp_path)
    assert [f["kind"] for f in s["findings"]["memory"]] == []
    memory = s["ranks"][0]["memory"]
    assert memory["trend"]["name"] == "plateau"
    assert memory["peak_allocated_bytes"] > 0 and memory["gpu_total_bytes"] > 0
