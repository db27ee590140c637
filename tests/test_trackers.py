"""TraceML's verdict and figures in W&B, MLflow and TensorBoard (``traceml.integrations``).

One real 2-rank ``traceml run`` (tests/scripts/trackers_train.py) logs to the three real
libraries at once: W&B offline (its run file read back record by record), MLflow on a file
store (read back with ``MlflowClient``), TensorBoard event files (read back with the
``EventAccumulator``). Each tracker has one live point at a known step (the script holds rank
0 until each has logged it) and the end-of-run write at the last step, whose figures and words
are the final summary's exactly (``flatten`` of final_summary.json; float32 in TensorBoard),
but for findings from the node's samples stored after that write (:func:`assert_final_figures`).
The other tests need no job: what importing the helpers loads, and a missing tracker library.
"""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import struct
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from conftest import SCRIPTS, free_port, load_summary, run_traceml, traceml_env

from traceml.analysis.findings import KINDS
from traceml.report.flat import flatten

PREFIX = "traceml/"
STEPS = 40
HOLD_AT = 19  # the script holds rank 0 after this step index: one live point at step 20
#: The marks of the tests that read the real job.
JOB = (pytest.mark.slow, pytest.mark.torchrun)


def job(test):
    for mark in JOB:
        test = mark(test)
    return test


def _final_flat(summary: dict) -> tuple[dict, dict]:
    metrics, labels = flatten(summary)
    return (
        {PREFIX + k: v for k, v in metrics.items()},
        {PREFIX + k: v for k, v in labels.items()},
    )


#: The findings counts among the figures.
COUNTS = tuple(PREFIX + f"findings_{level}" for level in ("warning", "critical"))
#: (section, kinds) of the findings made from the node sampler's samples (a node's CPU, RAM or
#: GPUs: every ``system`` finding; a rank's host memory: HOST_MEMORY_CREEP; the other
#: ``memory`` findings come from the ranks' steps). Samples stored after the tracker's last call
#: can add such a finding to the final summary (ci26: HIGH_CPU, likely, on the loaded machine:
#: one more warning in the summary than in all three trackers) or take one away (stop 50's CI:
#: one warning fewer in the summary than in all three, HIGH_CPU's median pulled under its
#: threshold, likely). Each kind is at most one finding.
SAMPLED_FINDINGS = (("system", KINDS["system"]), ("memory", ("HOST_MEMORY_CREEP",)))


def assert_final_figures(logged: dict, summary: dict, as_logged=lambda v: v) -> None:
    """``logged`` (figure -> the tracker's last value; ``as_logged`` turns a summary value into
    how the tracker keeps it) is the final summary's flat figures exactly, except the findings
    counts: each holds the summary's findings of that severity that are not of
    :data:`SAMPLED_FINDINGS`, plus at most one finding of each sampled kind."""
    numbers, _ = _final_flat(summary)
    assert set(logged) == set(numbers)
    assert {k: v for k, v in logged.items() if k not in COUNTS} == {
        k: as_logged(v) for k, v in numbers.items() if k not in COUNTS
    }
    sampled_kinds = sum(len(kinds) for _, kinds in SAMPLED_FINDINGS)
    for name in COUNTS:
        level = name.rsplit("_", 1)[1]
        sampled = sum(
            f["severity"] == level and f["kind"] in kinds
            for section, kinds in SAMPLED_FINDINGS
            for f in summary["findings"][section]
        )
        of_steps = numbers[name] - sampled
        assert as_logged(of_steps) <= logged[name] <= as_logged(of_steps + sampled_kinds), name


@pytest.fixture(scope="module")
def tracked(tmp_path_factory):
    """The finished run: ``(summary, ids)``, ids as the script wrote them."""
    missing = [m for m in ("wandb", "mlflow", "tensorboard") if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"not installed (the test extra has them): {', '.join(missing)}")
    base = tmp_path_factory.mktemp("trackers")
    out = base / "out"
    out.mkdir()
    proc = run_traceml(
        [
            "run",
            str(SCRIPTS / "trackers_train.py"),
            "--nproc-per-node=2",
            f"--aggregator-port={free_port()}",
            f"--logs-dir={base / 'logs'}",
            "--run-name=trackers",
            "--",
            "--out",
            str(out),
            "--steps",
            str(STEPS),
            "--hold-at",
            str(HOLD_AT),
        ],
        cwd=base,
        env={
            "WANDB_MODE": "offline",
            "WANDB_SILENT": "true",
            "MLFLOW_TRACKING_URI": (base / "mlruns").as_uri(),
            # MLflow 3 refuses its file store unless asked: it is the store that needs no server.
            "MLFLOW_ALLOW_FILE_STORE": "true",
        },
        timeout=400,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    ids = json.loads((out / "ids.json").read_text())
    ids["mlflow_uri"] = (base / "mlruns").as_uri()
    ids["stderr"] = proc.stderr
    ids["out"] = str(out)
    return load_summary(base / "logs" / "trackers"), ids


def assert_points(steps: list[int]) -> None:
    """A tracker's points, in the order written: the training step never goes back, the live
    point the script held for is there, the last is the end-of-run write at the last step. (A
    live point may precede the final one at the same step: it had fewer of rank 1's steps.)"""
    assert steps == sorted(steps) and set(steps) <= set(range(1, STEPS + 1)), steps
    assert HOLD_AT + 1 in steps and steps[-1] == STEPS, steps


@job
def test_the_run_is_the_one_the_trackers_describe(tracked):
    summary, _ = tracked
    assert [r["rank"] for r in summary["ranks"]] == [0, 1]
    assert [r["steps_completed"] for r in summary["ranks"]] == [STEPS, STEPS]
    assert summary["run"]["world_size"] == 2
    # the planted straggler (rank 1 sleeps 30 ms more a step) is the rank the verdict names,
    # and so the trackers' ``traceml/ranks`` below
    assert summary["primary_diagnosis"]["ranks"] == [1]
    assert _final_flat(summary)[1][PREFIX + "ranks"] == "1"


@job
def test_a_failing_tracker_is_two_warning_lines_and_the_run_goes_on(tracked):
    """Rank 0's full-disk writer failed at least twice live (the script held for it) and once
    at the end: one line for the live failures, one for the end; every other tracker logged
    (the tests below); rank 1's tracker made no log directory."""
    _, ids = tracked
    ours = [line for line in ids["stderr"].splitlines() if "traceml.integrations" in line]
    why = "OSError: [Errno 28] No space left on device"
    assert [line.split("traceml: ", 1)[1] for line in ours] == [
        f"traceml.integrations.tensorboard: a live write failed ({why}); training continues",
        f"traceml.integrations.tensorboard failed ({why}); training continues",
    ], ids["stderr"][-3000:]
    assert not (Path(ids["out"]) / "tensorboard-rank1").exists()


# --- W&B -----------------------------------------------------------------------------------

_BLOCK = 32 * 1024  # the run file is a LevelDB-style log: 32 KiB blocks of 7-byte-headed chunks


def _wandb_records(path: str) -> list:
    """The records of a W&B run file (``run-<id>.wandb``), in order."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B"
    pos, chunks, records = 7, b"", []
    while pos + 7 <= len(data):
        if _BLOCK - pos % _BLOCK < 7:  # a block's tail too short for a header is padding
            pos += _BLOCK - pos % _BLOCK
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:  # zeroed padding up to the block's end
            pos += _BLOCK - pos % _BLOCK
            continue
        chunks += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            record = pb.Record()
            record.ParseFromString(chunks)
            records.append(record)
            chunks = b""
    return records


def _wandb_run(run_files_dir: str) -> tuple[list[dict], dict, list]:
    """``(history rows, summary, metric definitions)`` of an offline run."""
    (path,) = glob.glob(os.path.join(os.path.dirname(run_files_dir), "run-*.wandb"))
    rows, summary, metrics = [], {}, []
    for record in _wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            items = record.history.item
            rows.append({"/".join(i.nested_key): json.loads(i.value_json) for i in items})
        elif kind == "summary":
            for item in record.summary.update:
                summary[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
        elif kind == "metric":
            metrics.append(record.metric)
    return rows, summary, metrics


@job
def test_wandb_gets_live_and_final_figures_against_the_training_step(tracked):
    summary, ids = tracked
    numbers, words = _final_flat(summary)
    rows, run_summary, definitions = _wandb_run(ids["wandb_dir"])
    ours = [r for r in rows if PREFIX + "step" in r]
    steps = [r[PREFIX + "step"] for r in ours]
    assert_points(steps)
    final = {k: v for k, v in ours[-1].items() if k.startswith(PREFIX)}
    assert final.pop(PREFIX + "step") == STEPS
    assert_final_figures(final, summary)
    assert {k: run_summary[k] for k in words} == words  # verdict, severity, ranks, ... as fields
    assert run_summary[PREFIX + "verdict"] == summary["primary_diagnosis"]["kind"]
    assert run_summary[PREFIX + "step"] == STEPS
    glob_defs = [(d.glob_name, d.step_metric) for d in definitions if d.glob_name]
    assert glob_defs == [(PREFIX + "*", PREFIX + "step")]


# --- MLflow --------------------------------------------------------------------------------


@job
def test_mlflow_gets_metrics_at_the_training_step_and_the_verdict_as_tags(tracked, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # as the job had it

    summary, ids = tracked
    numbers, words = _final_flat(summary)
    client = MlflowClient(ids["mlflow_uri"])
    run = client.get_run(ids["mlflow_run_id"])
    assert {k: v for k, v in run.data.tags.items() if k.startswith(PREFIX)} == words
    assert run.data.tags[PREFIX + "verdict"] == summary["primary_diagnosis"]["kind"]
    assert_final_figures(run.data.metrics, summary)  # each one's latest value: the final write's
    history = client.get_metric_history(run.info.run_id, PREFIX + "step_time_ms")
    steps = [m.step for m in history]
    assert_points(steps)
    for name in numbers:
        history = client.get_metric_history(run.info.run_id, name)
        assert max(m.step for m in history) == STEPS, name


# --- TensorBoard ---------------------------------------------------------------------------


def _float32(value: float) -> float:
    return struct.unpack("f", struct.pack("f", value))[0]


@job
def test_tensorboard_gets_scalars_at_the_training_step_and_the_verdict_as_text(tracked):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    summary, ids = tracked
    numbers, words = _final_flat(summary)
    acc = EventAccumulator(ids["tensorboard_dir"], size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    assert set(acc.Tags()["scalars"]) == set(numbers)
    steps = [e.step for e in acc.Scalars(PREFIX + "step_time_ms")]
    assert_points(steps)
    last = {name: acc.Scalars(name)[-1] for name in numbers}
    assert {event.step for event in last.values()} == {STEPS}
    assert_final_figures({name: e.value for name, e in last.items()}, summary, _float32)
    # add_text writes a string tensor under "<tag>/text_summary"; the latest is the final word
    for name, word in words.items():
        latest = acc.Tensors(f"{name}/text_summary")[-1]
        assert latest.tensor_proto.string_val[0].decode() == word, name


# --- without a job -------------------------------------------------------------------------


def _python(code: str, env: dict | None = None, cwd: Path | None = None):
    return subprocess.run(
        [sys.executable, "-c", code],
        env=traceml_env(env),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
    )


def test_importing_the_helpers_imports_no_tracker():
    code = (
        "import sys, traceml, traceml.integrations.wandb, traceml.integrations.mlflow, "
        "traceml.integrations.tensorboard; "
        "print(sorted(m for m in ('wandb', 'mlflow', 'tensorboard', 'torch') "
        "if m in sys.modules))"
    )
    proc = _python(code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


@pytest.mark.parametrize(
    "tracker, call",
    [
        ("wandb", "track()"),
        ("mlflow", "track()"),
        ("tensorboard", "track('tb')"),
    ],
)
def test_a_missing_tracker_is_one_warning_line_and_nothing_logged(tracker, call, tmp_path):
    """The library made unimportable (``sys.modules[name] = None``: ``import`` raises
    ImportError, as when it is not installed): one line, an inert tracker, exit 0; under
    TRACEML_STRICT=1 the ImportError with the same line."""
    code = (
        f"import sys; sys.modules[{tracker!r}] = None\n"
        f"from traceml.integrations import {tracker} as helper\n"
        f"t = helper.{call}\n"
        "t.finish()\n"
        "print(t.logged_step)\n"
    )
    line = (
        f"traceml.integrations.{tracker}: {tracker} is not installed "
        f"(pip install 'traceml-insight[{tracker}]'); nothing is logged to it"
    )
    proc = _python(code, cwd=tmp_path)
    assert (proc.returncode, proc.stdout) == (0, "None\n"), proc.stderr
    assert proc.stderr.splitlines() == [f"traceml: {line}"]
    strict = _python(code, {"TRACEML_STRICT": "1"}, tmp_path)
    assert strict.returncode == 1
    assert strict.stderr.splitlines()[-1] == f"ImportError: {line}"


# --- track() in this process: arguments, ranks and set-up failures (no job, no torchrun) ------


def _warnings(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("traceml:")]


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """The real libraries, offline in tmp_path; no TraceML rank state in this process (rank
    from ``RANK``, set per test); not strict."""
    from traceml.sdk import rank_state

    assert rank_state.current() is None
    for name in ("RANK", "TRACEML_STRICT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _finished_wandb_run(tmp_path):
    wandb = pytest.importorskip("wandb")
    run = wandb.init(project="traceml-test", mode="offline", dir=str(tmp_path))
    run.finish()
    return run


@pytest.mark.parametrize(
    "make_run, why",
    [
        (lambda _: "my-project", "AttributeError: 'str' object has no attribute 'define_metric'"),
        (lambda _: object(), "AttributeError: 'object' object has no attribute 'define_metric'"),
        (_finished_wandb_run, "UsageError: "),
    ],
    ids=["a-string", "an-object", "a-finished-run"],
)
def test_a_wandb_run_that_refuses_the_set_up_is_one_warning_line(
    make_run, why, offline, capsys, monkeypatch
):
    """Rank 0: one line and an inert tracker, nothing raised into training; rank 1: inert and
    silent, the run not touched; ``TRACEML_STRICT=1``: the exception itself."""
    from traceml.integrations import wandb as helper

    run = make_run(offline)
    capsys.readouterr()
    tracker = helper.track(run, every_s=None)
    tracker.finish()
    assert tracker.logged_step is None
    [line] = _warnings(capsys)
    head = "traceml: traceml.integrations.wandb: setting it up failed ("
    assert line.startswith(head + why), line
    assert line.endswith("); nothing is logged to it"), line

    monkeypatch.setenv("RANK", "1")
    tracker = helper.track(run, every_s=None)
    tracker.finish()
    assert (tracker.logged_step, _warnings(capsys)) == (None, [])

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("TRACEML_STRICT", "1")
    with pytest.raises(Exception, match=why.split(": ", 1)[1] or "."):
        helper.track(run, every_s=None)


def _tb_dir(tmp_path):
    pytest.importorskip("tensorboard")
    return tmp_path / "tb"


@pytest.mark.parametrize("rank", ["0", "1"])
@pytest.mark.parametrize(
    "tracker, call, message",
    [
        ("tensorboard", "track(tb, every_s=0)", "every_s must be a positive number"),
        ("tensorboard", "track(tb, every_s='5')", "every_s must be a positive number"),
        ("tensorboard", "track(tb, every_s=True)", "every_s must be a positive number"),
        ("tensorboard", "track(None)", "writer must be a SummaryWriter"),
        ("tensorboard", "track(42)", "writer must be a SummaryWriter"),
        ("wandb", "track('my-project', every_s=-1)", "every_s must be a positive number"),
        ("mlflow", "track(every_s=float('nan'))", "every_s must be a positive number"),
    ],
)
def test_a_wrong_argument_is_a_value_error_on_every_rank(
    tracker, call, message, rank, offline, monkeypatch
):
    """The script's mistake raises on rank 1 as on rank 0 (the rank decides nothing here), and
    nothing is created: no log directory, no thread."""
    import importlib

    helper = importlib.import_module(f"traceml.integrations.{tracker}")
    tb = offline / "tb"
    monkeypatch.setenv("RANK", rank)
    with pytest.raises(ValueError, match=message):
        eval(f"helper.{call}", {"helper": helper, "tb": tb})
    assert not tb.exists()
    # (other tests of this process may leave their own threads: a client's, another tracker's)
    assert [t.name for t in threading.enumerate() if t.name == f"traceml-{tracker}"] == []


def test_before_init_the_rank_is_torchruns(offline, capsys, monkeypatch):
    """``track(dir)`` before ``traceml.init()`` on torchrun's rank 1: no event file, no live
    thread, no line; on rank 0 (``RANK=0``) the writer is opened and its thread runs."""
    from traceml.integrations import tensorboard as helper

    tb = _tb_dir(offline)
    monkeypatch.setenv("RANK", "1")
    tracker = helper.track(tb, every_s=60)
    assert not tb.exists()
    assert [t.name for t in threading.enumerate() if t.name == "traceml-tensorboard"] == []
    tracker.finish()
    monkeypatch.setenv("RANK", "0")
    tracker = helper.track(tb, every_s=60)
    live = [t for t in threading.enumerate() if t.name == "traceml-tensorboard"]
    assert len(live) == 1
    assert len(list(tb.glob("events.out.tfevents.*"))) == 1
    tracker._stop.set()  # no summary to ask for here: stop the thread without a final write
    tracker._close()
    live[0].join(timeout=10)
    assert not live[0].is_alive()
    assert _warnings(capsys) == []


def test_mlflow_without_a_run_warns_on_rank_0_only(offline, capsys, monkeypatch):
    pytest.importorskip("mlflow")
    from traceml.integrations import mlflow as helper

    line = (
        "traceml: traceml.integrations.mlflow: no active MLflow run (call mlflow.start_run() "
        "first); nothing is logged to it"
    )
    for rank, expected in (("1", []), ("0", [line])):
        monkeypatch.setenv("RANK", rank)
        tracker = helper.track(every_s=None)
        tracker.finish()
        assert (tracker.logged_step, _warnings(capsys)) == (None, expected), rank
