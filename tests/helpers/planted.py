"""Real 2-rank runs of tests/scripts/planted_ddp.py under `traceml run`, one per scenario.

Each run costs tens of seconds on a 2-core machine, so a run is made once per session (with
xdist: per worker) by the ``planted`` fixture (tests/conftest.py) and shared by every test
that asks for it (diagnosis, reports, compare, summary()); those tests are one xdist group,
so one worker makes each scenario once.
"""

from __future__ import annotations

import importlib.util
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from helpers.aggregator import free_port
from helpers.jobs import SCRIPTS, load_summary, run_traceml, start_traceml

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


def run_planted(scenario: str, base: Path) -> PlantedRun:
    """Run ``scenario`` under ``base`` (its ``logs`` directory) and return the finished run;
    fails (AssertionError, with the launcher's stderr) unless it exits 0."""
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
    return PlantedRun(scenario, run.run_dir, proc)


def side_by_side(
    script: str,
    runs: dict[str, tuple[int, list[str]]],
    base: Path,
    at_once: int,
    env: dict | None = None,
    timeout_s: float = 600,
) -> None:
    """Run ``traceml run tests/scripts/<script>`` once per entry of ``runs`` (name -> (ranks
    per node, script arguments; ``--clock-out base/<name>`` is added)), at most ``at_once`` at
    a time, each with run name ``name`` under ``base/logs``, the launcher's output in
    ``base/<name>/launcher.out|err``; returns when all succeeded.

    Raises:
        AssertionError: a run failed (its launcher's stderr), or they took over ``timeout_s``.
    """
    procs: dict[str, subprocess.Popen] = {}

    def start(name: str) -> None:
        ranks, args = runs[name]
        (base / name).mkdir()
        procs[name] = start_traceml(
            [
                "run",
                str(SCRIPTS / script),
                f"--nproc-per-node={ranks}",
                f"--aggregator-port={free_port()}",
                f"--run-name={name}",
                f"--logs-dir={base / 'logs'}",
                "--",
                *args,
                "--clock-out",
                str(base / name),
            ],
            base,
            base / name / "launcher",
            env=env,
        )

    waiting = list(runs)
    deadline = time.monotonic() + timeout_s
    try:
        while waiting or any(p.poll() is None for p in procs.values()):
            assert time.monotonic() < deadline, f"planted runs did not finish in {timeout_s} s"
            while waiting and sum(p.poll() is None for p in procs.values()) < at_once:
                start(waiting.pop(0))
            time.sleep(0.5)
        for name, proc in procs.items():
            assert proc.returncode == 0, (base / name / "launcher.err").read_text()[-3000:]
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
