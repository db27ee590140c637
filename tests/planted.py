"""Real 2-rank runs of tests/scripts/planted_ddp.py under `traceml run`, one per scenario.

Each run costs tens of seconds on a 2-core machine, so a run is made once per pytest process
and shared by every test module that asks for it (diagnosis, reports, compare, summary()).
"""

from __future__ import annotations

import importlib.util
import subprocess
from dataclasses import dataclass
from pathlib import Path

from conftest import SCRIPTS, free_port, load_summary, run_traceml

#: Steps per run, and the planted delay (ms per step) of every scenario.
STEPS = 30
DELAY_MS = 20.0
HAS_TENSORBOARD = importlib.util.find_spec("tensorboard") is not None


@dataclass(frozen=True)
class PlantedRun:
    """One finished run: its directory, the launcher's process, its summaries."""

    scenario: str
    run_dir: Path
    process: subprocess.CompletedProcess

    @property
    def summary(self) -> dict:
        return load_summary(self.run_dir)

    @property
    def flat_path(self) -> Path:
        """``traceml.summary()`` as rank 0 saw it at the end of training (JSON)."""
        return self.run_dir.parent / f"{self.scenario}.summary.json"

    @property
    def tensorboard_dir(self) -> Path:
        return self.run_dir.parent / f"{self.scenario}.tensorboard"


_runs: dict[str, PlantedRun] = {}


def planted_run(scenario: str, base: Path) -> PlantedRun:
    """The run of ``scenario`` (made under ``base`` on first use in this process)."""
    if scenario not in _runs:
        base.mkdir(parents=True, exist_ok=True)
        run = PlantedRun(scenario, base / "logs" / scenario, None)  # paths only
        script_args = [
            "--scenario",
            scenario,
            "--steps",
            str(STEPS),
            "--delay-ms",
            str(DELAY_MS),
            "--summary-out",
            str(run.flat_path),
        ]
        if HAS_TENSORBOARD:
            script_args += ["--tensorboard-dir", str(run.tensorboard_dir)]
        proc = run_traceml(
            [
                "run",
                str(SCRIPTS / "planted_ddp.py"),
                "--nproc-per-node=2",
                f"--aggregator-port={free_port()}",
                f"--run-name={scenario}",
                f"--logs-dir={base / 'logs'}",
                "--html-report",
                "--",
                *script_args,
            ],
            cwd=base,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        _runs[scenario] = PlantedRun(scenario, run.run_dir, proc)
    return _runs[scenario]
