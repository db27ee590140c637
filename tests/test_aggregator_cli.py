"""``traceml-aggregator`` (typer): refusals are one ``traceml-aggregator: error:`` line and exit
code 2, nothing served; a store of another schema version is refused on open."""

from __future__ import annotations

import sqlite3
import subprocess
import sys

import pytest
from conftest import traceml_env

from traceml_aggregator.store import SCHEMA_VERSION, Store, StoreVersionError

pytestmark = [pytest.mark.aggregator]


def run_aggregator(args: list[str], cwd) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "traceml_aggregator", *args],
        cwd=cwd,
        env=traceml_env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.parametrize(
    "extra, env, expected",
    [
        (["--port", "0"], {}, "--port must be a TCP port, 1-65535 (got 0)"),
        (["--port", "70000"], {}, "--port must be a TCP port, 1-65535 (got 70000)"),
        (["--world-size", "0"], {}, "--world-size must be an integer >= 1 (got 0)"),
        (["--nnodes", "0"], {}, "--nnodes must be an integer >= 1 (got 0)"),
        (["--master-port", "0"], {}, "--master-port must be a TCP port, 1-65535 (got 0)"),
        (
            ["--finalize-timeout-sec", "nan"],
            {},
            "--finalize-timeout-sec must be a finite number > 0 (got nan)",
        ),
        (
            [],
            {"TRACEML_FINALIZE_TIMEOUT_SEC": "-1"},
            "TRACEML_FINALIZE_TIMEOUT_SEC must be a finite number > 0 (got '-1')",
        ),
    ],
)
def test_bad_options_are_one_error_line_and_exit_code_2(
    tmp_path, monkeypatch, extra, env, expected
):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    args = ["--run-dir", str(tmp_path / "r"), "--run-name", "cli", *extra]
    result = run_aggregator(args, tmp_path)
    assert result.returncode == 2
    assert result.stderr == f"traceml-aggregator: error: {expected}\n"
    assert result.stdout == ""
    assert not (tmp_path / "r").exists()


def test_a_malformed_value_is_one_error_line(tmp_path):
    args = ["--run-dir", str(tmp_path), "--run-name", "x", "--port", "abc"]
    result = run_aggregator(args, tmp_path)
    assert result.returncode == 2
    assert result.stderr.startswith("traceml-aggregator: error: Invalid value for '--port': ")
    assert result.stderr.count("\n") == 1


def test_a_missing_required_option_is_one_error_line(tmp_path):
    result = run_aggregator(["--run-dir", str(tmp_path / "r")], tmp_path)
    assert (result.returncode, result.stderr) == (
        2,
        "traceml-aggregator: error: Missing option '--run-name'.\n",
    )


def test_a_bad_run_name_is_refused(tmp_path):
    result = run_aggregator(["--run-dir", str(tmp_path / "r"), "--run-name", "a/b"], tmp_path)
    assert result.returncode == 2
    assert result.stderr.startswith("traceml-aggregator: error: run name 'a/b'")
    assert result.stderr.count("\n") == 1


def _write_store_of_version(path, version: str) -> None:
    Store(path).close()
    with sqlite3.connect(path) as db:
        db.execute("UPDATE meta SET value = ? WHERE key = 'schema_version'", (version,))
    db.close()


def test_the_store_refuses_another_schema_version(tmp_path):
    path = tmp_path / "telemetry.sqlite"
    _write_store_of_version(path, "1")
    with pytest.raises(StoreVersionError) as caught:
        Store(path)
    assert str(caught.value) == (
        f"{path} has store schema version 1, this TraceML writes version {SCHEMA_VERSION}: "
        "use a new run directory (or the TraceML that wrote it)"
    )
    Store(tmp_path / "fresh.sqlite").close()  # a new file has no version yet: accepted
    store = Store(tmp_path / "fresh.sqlite")  # and reopening our own version is fine
    assert store.meta()["schema_version"] == str(SCHEMA_VERSION)
    store.close()


def test_the_aggregator_refuses_a_store_of_another_version_in_one_line(tmp_path):
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    _write_store_of_version(run_dir / "telemetry.sqlite", "999")
    result = run_aggregator(["--run-dir", str(run_dir), "--run-name", "old"], tmp_path)
    assert result.returncode == 2
    assert result.stderr == (
        f"traceml-aggregator: error: {run_dir / 'telemetry.sqlite'} has store schema version "
        f"999, this TraceML writes version {SCHEMA_VERSION}: use a new run directory (or the "
        "TraceML that wrote it)\n"
    )
