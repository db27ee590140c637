"""The frameworks people train with, unmodified, under ``traceml run --nproc-per-node=2``.

Real libraries (the test extras install them), gloo on CPU, tiny models: the Hugging Face
``Trainer`` (a 1-layer GPT-2 built from a config: no download), Lightning's ``Trainer`` with
``strategy="ddp"``, an Accelerate loop, and a plain DDP loop that never imports TraceML, each
with exact step counts per rank and every CPU phase measured; the HF and Lightning callbacks
give the same steps without zero-code instrumentation (``--no-auto-instrument``). The plain
DDP loop's phases match its planted sleeps within 0.5 ms. Throughput and MFU: each run's
samples and tokens per step are its batch shape exactly, samples/s and model TFLOP/s are
what the stored steps give, the FLOPs of the MLPs are 2 x batch x in x out per layer exactly,
MFU is null on CPU, and with ``--peak-tflops`` the plain loop's samples/s and MFU match its
own clock.
"""

from __future__ import annotations

import json
import statistics

import pytest
from conftest import SCRIPTS, free_port, load_summary, query, run_traceml

pytestmark = [pytest.mark.slow, pytest.mark.torchrun]

#: Optimizer steps per run: enough for a verdict (MIN_WINDOW_STEPS = 10 after warm-up).
STEPS = 12
PHASES = ("input_wait", "forward", "backward", "optimizer")


def traceml_run(tmp_path, script: str, *script_args, traceml_args=()) -> dict:
    """Run ``script`` on 2 ranks; its final summary (after checking the run succeeded)."""
    result = run_traceml(
        [
            "run",
            str(SCRIPTS / script),
            "--nproc-per-node=2",
            f"--aggregator-port={free_port()}",
            f"--logs-dir={tmp_path / 'logs'}",
            "--run-name=fw",
            *traceml_args,
            "--",
            *script_args,
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


def assert_throughput(
    tmp_path,
    summary: dict,
    samples: int,
    tokens: int | None,
    forward_flops: int | None,
    peak_tflops: float | None = None,
) -> None:
    """Per rank: samples (tokens) per step are the batch's, samples/s (tokens/s, TFLOP/s) the
    window's totals over its stored step times; the forward's FLOPs are ``forward_flops``
    (None: any positive count) and a step's 3 x that; MFU against ``peak_tflops``, else null
    (CPU)."""
    window = summary["analysis"]["window"]
    for rank in summary["ranks"]:
        t = rank["throughput"]
        assert (t["samples_per_step"], t["tokens_per_step"]) == (samples, tokens)
        rows = query(
            tmp_path / "logs" / "fw",
            "SELECT step_us, samples, tokens FROM steps WHERE rank = ? AND step BETWEEN ? AND ?",
            (rank["rank"], window["first_step"], window["last_step"]),
        )
        step_us, counts, token_counts = zip(*rows, strict=True)
        wall_s = sum(step_us) / 1e6
        # every batch of the window counted once (HF's loader fetches one ahead: at an epoch's
        # end one step fetches none and the next two)
        assert sum(c or 0 for c in counts) == samples * window["steps"] == samples * len(rows)
        assert t["steps"] == sum(c is not None for c in counts)
        assert t["samples_per_s"] == pytest.approx(samples * len(rows) / wall_s, abs=1e-3)
        if tokens is None:
            assert t["tokens_per_s"] is None and set(token_counts) == {None}
        else:
            assert sum(c or 0 for c in token_counts) == tokens * len(rows)
            assert t["tokens_per_s"] == pytest.approx(tokens * len(rows) / wall_s, abs=1e-3)
        m = t["mfu"]
        assert (m["counted_step"], m["dtype"], m["device_name"]) == (1, "fp32", "cpu")
        if forward_flops is None:
            assert m["forward_flops"] > 0
        else:
            assert m["forward_flops"] == forward_flops
        assert m["flops_per_step"] == 3 * m["forward_flops"]
        achieved = m["flops_per_step"] * len(rows) / wall_s / 1e12
        assert m["achieved_tflops"] == pytest.approx(achieved, abs=1e-6)
        assert m["count_ms"] > 0
        if peak_tflops is None:
            assert m["mfu_pct"] is None and m["peak_tflops"] is None
            assert "no peak for a cpu device" in m["unavailable_reason"]
        else:
            assert (m["peak_tflops"], m["peak_source"]) == (peak_tflops, "--peak-tflops")
            assert m["mfu_pct"] == pytest.approx(100 * achieved / peak_tflops, abs=1e-3)
    job = summary["analysis"]["throughput"]
    assert job["samples_per_s"] == pytest.approx(
        sum(r["throughput"]["samples_per_s"] for r in summary["ranks"]), abs=1e-2
    )
    assert (job["mfu_pct"] is None) == (peak_tflops is None)


@pytest.mark.parametrize("callback", [False, True], ids=["zero-code", "callback"])
@pytest.mark.parametrize(
    "library, script",
    [("transformers", "fw_hf.py"), ("lightning", "fw_lightning.py")],
    ids=["hf-trainer", "lightning-ddp"],
)
def test_trainer(tmp_path, library, script, callback):
    """The Trainer unmodified (zero-code), or with TraceML's callback and zero-code off."""
    pytest.importorskip(library)
    args = ["--steps", str(STEPS), "--out", str(tmp_path / "out")]
    summary = traceml_run(
        tmp_path,
        script,
        *args,
        *(["--callback"] if callback else []),
        traceml_args=["--no-auto-instrument"] if callback else [],
    )
    assert_steps_and_phases(tmp_path, summary)
    if library == "transformers":  # 4 sequences of 16 token ids a step; GPT-2's FLOPs
        assert_throughput(tmp_path, summary, 4, 4 * 16, None)
    else:  # 8 samples through Linear(16, 32), Linear(32, 1)
        assert_throughput(tmp_path, summary, 8, None, 2 * 8 * (16 * 32 + 32 * 1))


def test_accelerate_loop(tmp_path):
    pytest.importorskip("accelerate")
    assert_steps_and_phases(
        tmp_path, traceml_run(tmp_path, "fw_accelerate.py", "--steps", str(STEPS))
    )


PLANTED_STEPS = 20
#: The steps' column of each planted phase -> what the script timed (truth key), nominal ms.
PLANTED = {
    "input_wait_us": ("input", 10.0),
    "forward_us": ("forward", 20.0),
    "optimizer_us": ("optimizer", 5.0),
}


#: The plain loop's --peak-tflops: a CPU run gets an MFU against the peak the user gives.
PEAK_TFLOPS = 1e-6


def test_plain_ddp_loop_phases_match_the_planted_sleeps(tmp_path):
    summary = traceml_run(
        tmp_path,
        "planted_zero_code.py",
        "--steps",
        str(PLANTED_STEPS),
        "--truth-dir",
        str(tmp_path),
        traceml_args=["--peak-tflops", str(PEAK_TFLOPS)],
    )
    assert_steps_and_phases(tmp_path, summary, PLANTED_STEPS)
    # 8 samples a step through Linear(16, 1): 2 x 8 x 16 x 1 FLOPs a forward
    assert_throughput(tmp_path, summary, 8, None, 2 * 8 * 16, PEAK_TFLOPS)
    window = summary["analysis"]["window"]
    for rank in summary["ranks"]:
        # the script's own clock: its window steps' wall time, end of step first-1 to last
        ends = json.loads((tmp_path / f"truth_{rank['rank']}.json").read_text())["step_end"]
        wall_s = (ends[window["last_step"]] - ends[window["first_step"] - 1]) / 1e9
        t = rank["throughput"]
        assert t["samples_per_s"] == pytest.approx(8 * window["steps"] / wall_s, rel=0.03)
        clock_mfu = 100 * 3 * 256 * window["steps"] / wall_s / (PEAK_TFLOPS * 1e12)
        assert t["mfu"]["mfu_pct"] == pytest.approx(clock_mfu, rel=0.03)
    for rank in (0, 1):
        truth = json.loads((tmp_path / f"truth_{rank}.json").read_text())
        for column, (part, nominal_ms) in PLANTED.items():
            measured = query(
                tmp_path / "logs" / "fw",
                f"SELECT {column} FROM steps WHERE rank = ? AND step > 0",
                (rank,),
            )
            planted_us = statistics.median(ns / 1000 for ns in truth[part][1:])
            measured_us = statistics.median(row[0] for row in measured)
            assert planted_us >= nominal_ms * 1000  # the sleep happened
            assert abs(measured_us - planted_us) <= 500, (rank, column, measured_us, planted_us)
