"""Zero-code runs: ``traceml run`` on a script that never imports TraceML.

By default each rank starts as ``python -m traceml.sdk.autorun SCRIPT ARGS``: steps come from
the optimizer, and the script sees exactly what plain torchrun gives it (argv, ``__file__``,
``__main__``, tracebacks, exit codes). With auto-instrumentation off the launcher's node
sampler still streams system samples and each worker's CPU and RSS (found through torchrun's
``RANK``/``TORCHELASTIC_RESTART_COUNT``), and the run ends normally with a summary even though
no step was ever traced.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import torch
from conftest import SCRIPTS, load_summary, query, run_traceml, traceml_env
from helpers.jobs import run_args

from traceml.sdk import auto, instrumentation
from traceml.sdk.step import StepTracer


def zero_code_run(tmp_path, port, *script_args, traceml_args=(), env=None, name="zero"):
    """``traceml run tests/scripts/zero_code.py --nproc-per-node=2 ... -- SCRIPT_ARGS``."""
    return run_traceml(
        run_args(tmp_path, SCRIPTS / "zero_code.py", name, port, *traceml_args, "--", *script_args),
        cwd=tmp_path,
        env=env,
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "off", [["--no-auto-instrument"], {"TRACEML_AUTO_INSTRUMENT": "0"}], ids=["flag", "env"]
)
@pytest.mark.slow
@pytest.mark.torchrun
def test_without_auto_instrument_only_system_and_process_rows(tmp_path, port, off):
    flags, env = (off, {}) if isinstance(off, list) else ([], off)
    result = zero_code_run(
        tmp_path, port, traceml_args=flags, env={"TRACEML_SAMPLE_INTERVAL_SEC": "0.2", **env}
    )
    assert result.returncode == 0, result.stderr
    run_dir = tmp_path / "logs" / "zero"
    assert (run_dir / "final_summary.json").is_file()
    # The script prints nothing on stdout: the node's log is there all the same, empty.
    assert (run_dir / "nodes" / "node_0" / "training.stdout.log").read_bytes() == b""

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
        (0, "completed"),
        (1, "completed"),
    ]


STEPS = 10


@pytest.mark.torchrun
@pytest.mark.slow
@pytest.mark.parametrize(
    "trace_from", [None, 0, 3], ids=["zero-code", "explicit", "explicit-from-3"]
)
def test_steps_are_counted_once_whoever_marks_them(tmp_path, port, trace_from):
    """Zero-code steps are the optimizer's steps; an explicit trace_step takes over from its
    first step on, and the zero-code step open then is dropped, never counted twice."""
    extra = [] if trace_from is None else ["--trace-from", str(trace_from)]
    result = zero_code_run(tmp_path, port, "--steps", str(STEPS), *extra)
    assert result.returncode == 0, result.stderr
    assert "traceml:" not in result.stderr.replace("traceml: summary:", "")  # no warning
    run_dir = tmp_path / "logs" / "zero"
    for rank in (0, 1):
        steps = query(
            run_dir,
            "SELECT step, forward_us, backward_us, optimizer_us FROM steps "
            "WHERE rank = ? ORDER BY step",
            (rank,),
        )
        assert [s[0] for s in steps] == list(range(STEPS))
        # Every step has backward and optimizer; forward from step 1 on (step 0's forward
        # ran before zero-code steps found the model: its first backward opened the step).
        assert all(s[2] is not None and s[3] is not None for s in steps)
        assert all(s[1] is not None for s in steps[1:])
    assert query(run_dir, "SELECT rank, steps_completed FROM rank_finish ORDER BY rank") == [
        (0, STEPS),
        (1, STEPS),
    ]
    assert [r["steps_completed"] for r in load_summary(run_dir)["ranks"]] == [STEPS, STEPS]


def _both_ways(tmp_path, port, *script_args):
    """Run zero_code_main.py on one rank under plain torchrun (in ``tmp_path/plain``), then
    under traceml run (in ``tmp_path/traced``), with the same arguments."""
    for kind in ("plain", "traced"):
        (tmp_path / kind).mkdir()
    script_args = [*script_args, "--out", "facts"]
    plain = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node=1",
            str(SCRIPTS / "zero_code_main.py"),
            *script_args,
        ],
        cwd=tmp_path / "plain",
        env=traceml_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    traced = run_traceml(
        [
            "run",
            str(SCRIPTS / "zero_code_main.py"),
            "--aggregator-port",
            str(port),
            "--logs-dir",
            str(tmp_path / "logs"),
            "--run-name",
            "main",
            "--",
            *script_args,
        ],
        cwd=tmp_path / "traced",
    )
    return plain, traced


@pytest.mark.torchrun
@pytest.mark.slow
def test_the_script_runs_as_main_exactly_as_under_torchrun(tmp_path, port):
    plain, traced = _both_ways(tmp_path, port)
    assert (plain.returncode, traced.returncode) == (0, 0), traced.stderr
    seen = [
        json.loads((tmp_path / kind / "facts.0.json").read_text()) for kind in ("plain", "traced")
    ]
    assert seen[0] == seen[1]
    facts = seen[0]
    assert facts["argv"][0] == str(SCRIPTS / "zero_code_main.py")
    assert facts["file"] == str(SCRIPTS / "zero_code_main.py")
    assert (facts["name"], facts["package"], facts["path0"]) == ("__main__", None, str(SCRIPTS))
    assert facts["spec_is_none"] and facts["main_is_me"] and facts["pickles"] == 3
    assert facts["annotation"] == "<class 'int'>"  # no __future__ flag leaked into the script
    assert plain.stdout == "" and "traceml: summary:" in traced.stderr


def _traceback(stderr: str) -> list[str]:
    """The rank's traceback: its lines from "Traceback" to the planted error."""
    lines = stderr.splitlines()
    end = next(i for i, line in enumerate(lines) if line.startswith("ValueError: planted"))
    start = max(i for i in range(end) if lines[i].startswith("Traceback"))
    return lines[start : end + 1]


@pytest.mark.torchrun
@pytest.mark.slow
def test_a_failing_script_has_the_traceback_and_exit_code_of_plain_torchrun(tmp_path, port):
    plain, traced = _both_ways(tmp_path, port, "--raise")
    assert plain.returncode == traced.returncode == 1
    assert _traceback(traced.stderr) == _traceback(plain.stderr)
    banner = f"{SCRIPTS / 'zero_code_main.py'} FAILED"  # torchrun's, naming the script
    assert banner in plain.stderr.splitlines() and banner in traced.stderr.splitlines()
    assert [line.split(", in ")[-1] for line in _traceback(traced.stderr)[1::2][:3]] == [
        "<module>",
        "main",
        "outer",
    ]
    assert query(tmp_path / "logs" / "main", "SELECT rank, end_state, reason FROM rank_finish") == [
        (0, "failed", "ValueError: planted failure")
    ]


@pytest.mark.torchrun
@pytest.mark.slow
def test_sys_exit_code_reaches_torchrun_as_under_plain_torchrun(tmp_path, port):
    plain, traced = _both_ways(tmp_path, port, "--exit", "3")
    assert plain.returncode == traced.returncode == 1  # torchrun: a rank failed
    assert query(tmp_path / "logs" / "main", "SELECT rank, exit_code FROM rank_ends") == [(0, 3)]


def test_a_failing_zero_code_hook_warns_once_and_training_goes_on(capfd):
    """A step tracer whose hand-off raises: one warning, zero-code steps stop, and the
    optimizer steps are exactly those of an untraced run."""

    def broken_emit(measurement):
        raise RuntimeError("planted telemetry failure")

    tracer = StepTracer(broken_emit, time.perf_counter_ns())
    instrumentation.install(tracer)
    tracer.auto = auto.AutoSteps(tracer, on_model=lambda model: None)
    try:
        weights = []
        for traced in (True, False):
            torch.manual_seed(0)
            model = torch.nn.Linear(4, 1)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            if not traced:
                instrumentation._tracer = None  # stop attributing time (the hooks pass through)
            for _ in range(3):
                optimizer.zero_grad()
                model(torch.ones(2, 4)).sum().backward()
                optimizer.step()
            weights.append(model.weight.detach().clone())
        assert torch.equal(weights[0], weights[1])
        assert tracer.auto is None and not tracer.in_step and "forward" not in model.__dict__
        warnings = [line for line in capfd.readouterr().err.splitlines() if "traceml" in line]
        assert warnings == [
            "traceml: zero-code step tracing failed (RuntimeError: planted telemetry failure); "
            "training continues"
        ]
    finally:
        instrumentation._tracer = None  # stop attributing time (the hooks pass through)


def test_an_explicit_step_after_a_zero_code_fetch_is_the_first_step():
    """A script that fetches its first batch and then opens trace_step: the zero-code step the
    fetch opened is forgotten, so step 0 is the explicit one, with no input wait (nothing came
    before it) and the fetch as its DataLoader time."""
    steps = []
    tracer = StepTracer(steps.append, time.perf_counter_ns())
    instrumentation.install(tracer)
    tracer.auto = auto.AutoSteps(tracer, on_model=lambda model: None)
    try:
        loader = torch.utils.data.DataLoader(_SlowItems(), batch_size=None)
        for x in loader:
            tracer.begin()
            x.sum()
            tracer.end()
        assert tracer.auto is None
        assert [m.step for m in steps] == [0, 1]
        assert steps[0].input_wait_ns is None and steps[0].dataloader_next_ns >= 10_000_000
        assert steps[1].input_wait_ns >= 10_000_000
    finally:
        instrumentation._tracer = None  # stop attributing time (the hooks pass through)


class _SlowItems(torch.utils.data.Dataset):
    """Two items, 10 ms each."""

    def __len__(self) -> int:
        return 2

    def __getitem__(self, i):
        time.sleep(0.01)
        return torch.ones(2)


def test_an_optimizer_step_counts_once_without_the_forward_and_backward_of_its_closure():
    """A subclass whose step() calls its base's (both hooked by torch) is one optimizer step,
    and the forward (200 ms) and backward its closure runs are theirs, not the optimizer's
    (5 ms of its own), as with LBFGS or Lightning's automatic optimization. (The forward's
    sleep is long so that the optimizer's bound, below it, holds on a loaded machine: 20 ms
    once took 25 ms there.)"""
    steps = []
    tracer = StepTracer(steps.append, time.perf_counter_ns())
    instrumentation.install(tracer)
    model = _SlowForward()
    torch.optim.SGD(model.parameters(), lr=0.1)  # torch hooks SGD.step as well

    class SlowSGD(torch.optim.SGD):
        def step(self, closure=None):
            time.sleep(0.005)
            return super().step(closure)

    optimizer = SlowSGD(model.parameters(), lr=0.1)

    def closure():
        optimizer.zero_grad()
        loss = model(torch.ones(2, 4)).sum()
        loss.backward()
        return loss

    timer = instrumentation.ForwardTimer(model)
    try:
        tracer.begin()
        timer.install()
        optimizer.step(closure)
        timer.remove()
        tracer.end()
    finally:
        instrumentation._tracer = None  # stop attributing time (the hooks pass through)
    [m] = steps
    forward_ns = int(_SlowForward.SLEEP_S * 1e9)
    assert m.forward_ns >= forward_ns and m.backward_ns > 0
    assert 5_000_000 <= m.optimizer_ns < forward_ns  # the closure's forward is not in it
    assert m.optimizer_ns + m.forward_ns + m.backward_ns <= m.step_ns


class _SlowForward(torch.nn.Module):
    #: The forward's planted sleep, s.
    SLEEP_S = 0.2

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 1)

    def forward(self, x):
        time.sleep(self.SLEEP_S)
        return self.linear(x)
