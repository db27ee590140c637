"""The offline library is pure: ``traceml.analysis``, ``traceml.report`` and the ``traceml view``
and ``traceml compare`` of a saved summary load no transport (gRPC, protobuf, the wire), so a
notebook or a report pays for none of it (docs/architecture.md). Import-linter's contract in
pyproject.toml forbids the imports statically; these tests check what a fresh interpreter really
loads, and that the end states the offline library declares are the wire's."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import ROOT, traceml_env

from traceml import wire
from traceml.core.ends import REPORTED_END_STATES
from traceml.report import read_summary
from traceml.report.text import render_text

#: Packages of the transport: none may be in ``sys.modules`` after the offline library loads.
TRANSPORT = ("grpc", "google.protobuf", "traceml.wire")
#: Also absent from ``traceml view``/``compare`` of a summary: the training stack and the
#: analysis engine's NumPy (about 0.1 s of the command's start-up; benchmarks/view_startup.py).
HEAVY = ("torch", "numpy")

SUMMARY = ROOT / "tests" / "golden" / "cpu_input_straggler.json"

#: Runs the ``traceml`` command (``python -m traceml``) with the arguments after the first,
#: then writes the names in ``sys.modules`` at exit, as JSON, to the file named first.
_COMMAND_THEN_MODULES = """
import atexit, json, runpy, sys
out = sys.argv.pop(1)
atexit.register(lambda: open(out, "w").write(json.dumps(sorted(sys.modules))))
runpy.run_module("traceml", run_name="__main__", alter_sys=True)
"""


def loaded(modules: list[str], packages: tuple[str, ...]) -> list[str]:
    """The names of ``modules`` that are one of ``packages`` or inside one."""
    return [m for m in modules if any(m == p or m.startswith(p + ".") for p in packages)]


def test_every_module_of_the_offline_library_loads_without_the_transport():
    code = (
        "import importlib, json, pkgutil, sys\n"
        "import traceml.analysis, traceml.report\n"
        "names = [m.name for p in (traceml.analysis, traceml.report)\n"
        "         for m in pkgutil.walk_packages(p.__path__, p.__name__ + '.')]\n"
        "for name in names:\n"
        "    importlib.import_module(name)\n"
        "print(json.dumps({'imported': names, 'modules': sorted(sys.modules)}))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=traceml_env(), timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    # Every module really was imported (a walk that found nothing would prove nothing).
    assert {
        "traceml.analysis.rundata",
        "traceml.analysis.summary",
        "traceml.report.html",
        "traceml.report.compare",
    } <= set(result["imported"])
    assert loaded(result["modules"], TRANSPORT) == []


@pytest.mark.parametrize("command", ["view", "compare"])
def test_view_and_compare_of_a_summary_load_neither_the_transport_nor_numpy(command, tmp_path):
    out = tmp_path / "modules.json"
    args = (
        ["view", str(SUMMARY)]
        if command == "view"
        else ["compare", str(SUMMARY), str(SUMMARY), "--out-dir", str(tmp_path)]
    )
    proc = subprocess.run(
        [sys.executable, "-c", _COMMAND_THEN_MODULES, str(out), *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=traceml_env(launcher=True),
        timeout=120,
    )
    assert (proc.returncode, proc.stderr) == (0, "")
    if command == "view":
        assert proc.stdout == render_text(read_summary(SUMMARY))
    else:
        assert proc.stdout == (tmp_path / "compare.txt").read_text()
        assert proc.stdout.splitlines()[2].split() == ["VERDICT", "EQUIVALENT"]  # run vs itself
    modules = json.loads(out.read_text())
    assert f"traceml.report.{'text' if command == 'view' else 'compare'}" in modules
    assert loaded(modules, TRANSPORT + HEAVY) == []


def test_the_end_states_of_the_offline_library_are_the_wires():
    """Each ``EndState`` number of finish.proto converts (``wire.end_state_name``) to the name
    at its place in ``REPORTED_END_STATES``: the one declaration the analysis reads."""
    numbers = [(v.number, wire.end_state_name(v.number)) for v in wire.EndState.DESCRIPTOR.values]
    assert numbers == [(0, "unspecified"), *enumerate(REPORTED_END_STATES, start=1)]
