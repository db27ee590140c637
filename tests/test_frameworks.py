"""The frameworks people train with, unmodified, under ``traceml run --nproc-per-node=2``.

Real libraries (the test extras install them), gloo on CPU, tiny models: the Hugging Face
``Trainer`` (a 1-layer GPT-2 built from a config: no download), Lightning's ``Trainer`` with
``strategy="ddp"``, an Accelerate loop, and a plain DDP loop that never imports TraceML, each
with exact step counts per rank and every CPU phase measured; the HF and Lightning callbacks
give the same steps without zero-code instrumentation (``--no-auto-instrument``). The plain
DDP loop's phases match its planted sleeps within 0.5 ms.
"""

from __future__ import annotations

import json
import statistics

import pytest

from conftest import SCRIPTS, free_port, load_summary, query, run_traceml

pytestmark = pytest.mark.slow

#: Optimizer steps per run: enough for a verdict (MIN_WINDOW_STEPS = 10 after warm-up).
STEPS = 12
PHASES = ("input_wait", "forward", "backward", "optimizer")


def traceml_run(tmp_path, script: str, *script_args, traceml_args=()) -> dict:
    """Run ``script`` on 2 ranks; its final summary (after checking the run succeeded)."""
    result = run_traceml(
        [
            "run", str(SCRIPTS / script), "--nproc-per-node=2",
            f"--aggregator-port={free_port()}", f"--logs-dir={tmp_path / 'logs'}",
            "--run-name=fw", *traceml_args, "--", *script_args,
        ],
        cwd=tmp_path,
        env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
        timeout=400,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return load_summary(tmp_path / "logs" / "fw")


def assert_steps_and_phases(tmp_path, summary: dict, steps: int = STEPS) -> None:
    """Exactly ``steps`` steps per rank, numbered from 0, each phase measured, a verdict."""
    assert [r["rank"] for r in summary["ranks"]] == [0, 1]
    for rank in summary["ranks"]:
        assert rank["steps_completed"] == steps
        assert rank["end"]["state"] == "completed"
        assert all(rank["phase_median_ms"][p] is not None for p in PHASES), rank
        assert rank["phase_median_ms"]["h2d"] is None  # CPU: not measured, never 0
    for rank in (0, 1):
        stored = query(
            tmp_path / "logs" / "fw",
            "SELECT step, input_wait_us, forward_us, backward_us, optimizer_us FROM steps "
            "WHERE rank = ? ORDER BY step",
            (rank,),
        )
        assert [row[0] for row in stored] == list(range(steps))
        assert all(None not in row for row in stored[1:])  # step 0 has no input wait
    assert summary["primary_diagnosis"]["kind"] != "INSUFFICIENT_DATA"
    assert query(tmp_path / "logs" / "fw", "SELECT DISTINCT parallelism FROM ranks") == [("ddp",)]


@pytest.mark.parametrize("callback", [False, True], ids=["zero-code", "callback"])
@pytest.mark.parametrize(
    "library, script", [("transformers", "fw_hf.py"), ("lightning", "fw_lightning.py")],
    ids=["hf-trainer", "lightning-ddp"],
)
def test_trainer(tmp_path, library, script, callback):
    """The Trainer unmodified (zero-code), or with TraceML's callback and zero-code off."""
    pytest.importorskip(library)
    args = ["--steps", str(STEPS), "--out", str(tmp_path / "out")]
    summary = traceml_run(
        tmp_path, script, *args, *(["--callback"] if callback else []),
        traceml_args=["--no-auto-instrument"] if callback else [],
    )
    assert_steps_and_phases(tmp_path, summary)


def test_accelerate_loop(tmp_path):
    pytest.importorskip("accelerate")
    assert_steps_and_phases(tmp_path, traceml_run(tmp_path, "fw_accelerate.py", "--steps", str(STEPS)))


PLANTED_STEPS = 20
#: The steps' column of each planted phase -> what the script timed (truth key), nominal ms.
PLANTED = {"input_wait_us": ("input", 10.0), "forward_us": ("forward", 20.0),
           "optimizer_us": ("optimizer", 5.0)}


def test_plain_ddp_loop_phases_match_the_planted_sleeps(tmp_path):
    summary = traceml_run(
        tmp_path, "planted_zero_code.py", "--steps", str(PLANTED_STEPS), "--truth-dir", str(tmp_path)
    )
    assert_steps_and_phases(tmp_path, summary, PLANTED_STEPS)
    for rank in (0, 1):
        truth = json.loads((tmp_path / f"truth_{rank}.json").read_text())
        for column, (part, nominal_ms) in PLANTED.items():
            measured = query(
                tmp_path / "logs" / "fw",
                f"SELECT {column} FROM steps WHERE rank = ? AND step > 0", (rank,),
            )
            planted_us = statistics.median(ns / 1000 for ns in truth[part][1:])
            measured_us = statistics.median(row[0] for row in measured)
            assert planted_us >= nominal_ms * 1000  # the sleep happened
            assert abs(measured_us - planted_us) <= 500, (rank, column, measured_us, planted_us)
