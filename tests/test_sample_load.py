"""Samples load as columns, not a dict per row (issue 25, item 3): a long run's process, system
and GPU samples (built straight into SQLite by ``benchmarks/sample_load.py``) load and summarise
in a fresh process with exact figures and a bounded extra RSS."""

from __future__ import annotations

import importlib.util
import statistics
import sys

import pytest
from conftest import ROOT

from traceml.analysis.rundata import SampleColumns
from traceml_aggregator.load import load
from traceml_aggregator.store import Store

pytestmark = pytest.mark.slow

_spec = importlib.util.spec_from_file_location(
    "sample_load", ROOT / "benchmarks" / "sample_load.py"
)
sample_load = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sample_load)

RANKS, SAMPLES = 8, 25_000  # 200,000 process rows, 200,000 GPU rows, 25,000 system rows
#: The bound of the extra RSS of loading and summarising those 425,000 rows, MiB: their columns
#: take ~30 MiB (8 bytes a value), ~87 MiB at the peak; a dict per row took 238 MiB (measured).
EXTRA_RSS_MIB = 128


def test_samples_load_as_columns_with_exact_figures_and_bounded_memory(tmp_path):
    path = tmp_path / "telemetry.sqlite"
    rows = sample_load.build_sample_store(path, RANKS, SAMPLES)
    assert rows == SAMPLES * (2 * RANKS + 1)
    sys.path.insert(0, str(ROOT))
    figures = sample_load.measure(ROOT, path)
    assert figures["extra_rss_mib"] <= EXTRA_RSS_MIB, figures
    # Every sample counts (the runs have no steps, so no window span narrows them).
    for rank, process in enumerate(figures["ranks"]):
        assert process == {
            "samples": SAMPLES,
            "cpu_percent_median": statistics.median(90.0 + (i + rank) % 10 for i in range(SAMPLES)),
            "rss_bytes_max": 2**30 + 4096 * (SAMPLES - 1),
            "gpu_allocated_bytes_max": 2**31,
            "gpu_reserved_bytes_max": 2**32,
        }
    (node,) = figures["nodes"]
    assert node["samples"] == SAMPLES
    assert node["ram_used_pct_max"] == 25.0
    assert node["ram_total_bytes"] == 2**36
    assert [g["nvml_index"] for g in node["gpus"]] == list(range(RANKS))
    for g in node["gpus"]:
        index = g["nvml_index"]
        assert g["uuid"] == f"GPU-0-{index}"
        assert g["util_percent_median"] == statistics.median(
            50.0 + (i * 7 + index) % 50 for i in range(SAMPLES)
        )
        assert g["memory_used_bytes_max"] == 2**33 + 999
        assert g["temperature_c_max"] == 79.0


def test_loaded_samples_are_columns_that_still_read_as_rows(tmp_path):
    path = tmp_path / "telemetry.sqlite"
    sample_load.build_sample_store(path, 2, 3, gpus_per_node=2)
    store = Store(path, read_only=True)
    try:
        run = load(store, [])
    finally:
        store.close()
    samples = run.ranks[1].process_samples
    assert isinstance(samples, SampleColumns)
    assert samples.column("rss_bytes").tolist() == [2**30, 2**30 + 4096, 2**30 + 8192]
    assert samples[-1] == {
        "rank": 1,
        "restart": 0,
        "unix_us": sample_load.START_US + 2_000_000,
        "cpu_percent": 93.0,
        "rss_bytes": 2**30 + 8192,
        "gpu_allocated_bytes": 2**31,
        "gpu_reserved_bytes": 2**32,
    }
    assert [row["unix_us"] for row in samples] == [
        sample_load.START_US + i * 1_000_000 for i in range(3)
    ]
    gpus = run.gpu_samples[0]
    assert [(g["unix_us"], g["nvml_index"]) for g in gpus] == [
        (sample_load.START_US + i * 1_000_000, index) for i in range(3) for index in range(2)
    ]
    assert gpus.last_text("uuid") == "GPU-0-1" and gpus[0]["unavailable_reason"] is None
    assert run.system_samples[0][0]["hostname"] == "host0"


def test_iterating_samples_gives_each_row_exactly_as_indexing_does():
    """Iteration converts whole columns at once (the checkpoint's windows and the live tails
    take rows so); each row equals ``samples[i]``, value and type: an integer column's
    values ``int``, a float's ``float``, NaN ``None``, text as stored."""
    rows = [
        {
            "unix_us": sample_load.START_US + i,
            "cpu_percent": None if i % 3 == 0 else i / 4,
            "rss_bytes": None if i == 4 else 2**40 + i,
            "hostname": "host0" if i % 2 else None,
        }
        for i in range(6)
    ]
    samples = SampleColumns.of(rows)
    assert samples.ints == {"unix_us", "rss_bytes"}
    iterated = list(samples)
    assert iterated == rows == [samples[i] for i in range(6)]
    assert [type(v).__name__ for v in iterated[1].values()] == ["int", "float", "int", "str"]
    assert [type(v).__name__ for v in iterated[4].values()] == [
        "int",
        "float",
        "NoneType",
        "NoneType",
    ]
