"""Every knob is declared once, in traceml/settings.py, and everything else derives from it.

* every option of every command is a declared knob (its flag, default and help derived by
  ``traceml.core.cli.option``) or is listed in :data:`NOT_KNOBS` with the reason;
* no source declares a knob again: no ``TRACEML_*`` name outside settings.py, no constant or
  config field of a knob with a literal default, no argparse;
* ``--help`` shows each knob's declared default;
* the launcher's argv for its aggregator parses, by the aggregator's own command, back to the
  launcher's values;
* a bad value is one line, ``<flag or variable> must be <expected> (got <value>)``, the same
  for every kind, flag or variable, launcher or aggregator.
"""

from __future__ import annotations

import ast
import math
import re
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest
import typer
from conftest import SCRIPTS, free_port, run_traceml, traceml_env
from helpers.aggregator import aggregator_cmd
from typer.testing import CliRunner

from traceml import settings
from traceml.core.rundir import RunDir
from traceml.launcher import aggregator as launcher_aggregator
from traceml.launcher import cli as launcher_cli
from traceml.launcher.config import KNOBS, LaunchConfig
from traceml_aggregator import cli as aggregator_cli
from traceml_aggregator.dashboard import __main__ as dashboard_main
from traceml_aggregator.server import ServerConfig

ROOT = Path(__file__).resolve().parent.parent
#: The shipped sources, without the generated protobuf code (traceml/wire/v1/).
SOURCES = [
    path
    for tree in ("traceml", "traceml_aggregator")
    for path in sorted((ROOT / tree).rglob("*.py"))
    if "v1" not in path.parts
]

#: The command-line parameters that are not knobs, per command, and why. A new option must be
#: a knob of traceml/settings.py or be added here with its reason.
NOT_KNOBS = {
    "traceml run": {
        "script": "the job itself",
        "nproc_per_node": "topology of the job, given per job",
        "nnodes": "topology of the job, given per job",
        "node_rank": "topology of the job, given per node",
        "master_addr": "topology of the job: node 0's address",
        "run_name": "the job's identity",
        "session_id": "alias of --run-name",
        "aggregator_host": "topology of the job: defaults to --master-addr",
        "aggregator_bind_host": "network interface: defaults from --nnodes",
        "mode": "what to show, one of three (validated against MODES)",
        "logs_dir": "where the job's files go",
        "use_slurm": "where the topology comes from",
    },
    "traceml view": {
        "summary": "the input file",
        "html": "an output file",
        "serve": "what to do",
        "bind_host": "network interface",
    },
    "traceml compare": {
        "baseline": "an input file",
        "candidate": "an input file",
        "out_dir": "where the outputs go",
        "fail_on_regression": "a CI policy, off unless given",
    },
    "traceml-aggregator": {
        "run_dir": "the run's directory (set by traceml run)",
        "run_name": "the run's identity (set by traceml run)",
        "bind_host": "network interface (set by traceml run)",
        "world_size": "topology of the run (set by traceml run)",
        "nnodes": "topology of the run (set by traceml run)",
        "master_port": "topology of the run (set by traceml run)",
        "no_summary_at_stop": "the launcher's protocol with its aggregator",
        "owned": "the launcher's protocol with its aggregator",
        "restart_reason": "the launcher's protocol with its aggregator",
        "down_since_unix_s": "the launcher's protocol with its aggregator",
        "finalize_only": "the launcher's protocol with its aggregator",
        "node_exit_file": "the launcher's protocol with its aggregator",
        "lost_reason": "the launcher's protocol with its aggregator",
        "lost_unix_s": "the launcher's protocol with its aggregator",
    },
    "python -m traceml_aggregator.dashboard": {
        "run_dir": "the input directory",
        "bind_host": "network interface",
    },
}


def commands() -> dict:
    """``{name: click command}`` of every command that takes options."""
    launcher = typer.main.get_command(launcher_cli.app)
    return {
        "traceml run": launcher.commands["run"],
        "traceml view": launcher.commands["view"],
        "traceml compare": launcher.commands["compare"],
        "traceml-aggregator": typer.main.get_command(aggregator_cli.app),
        "python -m traceml_aggregator.dashboard": typer.main.get_command(dashboard_main.app),
    }


def knob_of(param) -> settings.Setting | None:
    """The knob an option was derived from (its help starts with the knob's doc), or None."""
    for knob in settings.ALL:
        if (getattr(param, "help", None) or "").startswith(knob.doc):
            return knob
    return None


def test_every_option_is_a_declared_knob_or_says_why_not():
    derived, wrong = set(), []
    for name, command in commands().items():
        exempt = NOT_KNOBS[name]
        for param in command.params:
            knob = knob_of(param)
            if knob is None:
                if param.name not in exempt:
                    wrong.append(f"{name} {param.opts}: neither a knob nor in NOT_KNOBS")
                continue
            derived.add(knob.label)
            # A knob without a variable that this command leaves None unless given: the help
            # says what happens then ("off", or where its default applies).
            unset = not knob.name and param.default is None
            default = None if knob.name or unset else knob.value
            if param.default != default:
                wrong.append(f"{name} {param.opts}: default {param.default!r}, not {default!r}")
            shown = re.fullmatch(r".*\[default: ([^]]*)\]", param.help)
            if unset:
                ok = shown and (shown[1] == "off" or shown[1].startswith(knob.default))
            else:
                ok = shown and shown[1] == knob.default_text()
            if not ok:
                wrong.append(f"{name} {param.opts}: help {param.help!r}")
            if param.name in exempt:
                wrong.append(f"{name} {param.name}: a knob, yet in NOT_KNOBS")
        names = {p.name for p in command.params}
        wrong += [
            f"{name} {stale}: in NOT_KNOBS, not a parameter" for stale in exempt.keys() - names
        ]
    assert wrong == []
    assert derived == {k.label for k in settings.ALL if k.flag}


#: ``TRACEML_*`` variables that are not knobs: the launcher's protocol with its torchrun wrapper
#: (traceml/launcher/torchrun_main.py), and the wrapper's with its ranks
#: (traceml/core/orphans.py). ``TRACEML_TEST_*`` are test hooks, never a user's.
NOT_KNOB_VARIABLES = {"TRACEML_RANK_ENDS_FILE", "TRACEML_LAUNCHER_PID", "TRACEML_TORCHRUN_PID"}


def _knob_names() -> set[str]:
    """The Python names a knob with a default could be declared under again: its constant in
    settings.py, its config field, upper-cased too, and in seconds' ``_s`` spelling."""
    with_default = [k for k in settings.ALL if k.default]
    names = {n for n, v in vars(settings).items() if isinstance(v, settings.Setting) and v.default}
    fields_ = {k.field for k in with_default}
    fields_ |= {f.removesuffix("_sec") + "_s" for f in fields_ if f.endswith("_sec")}
    names |= fields_ | {f.upper() for f in fields_}
    return names | {"DEFAULT_PORT"}  # the aggregator port's name before it was a knob


def test_no_source_declares_a_knob_again():
    """Outside settings.py: no string that is a ``TRACEML_*`` name (an environment variable
    read or set by its own spelling), no assignment of a literal to a knob's name, no field or
    parameter of a knob's name with a literal default, no argparse."""
    names = _knob_names()
    wrong = []
    for path in SOURCES:
        if path == ROOT / "traceml" / "settings.py":
            continue
        where = path.relative_to(ROOT)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                variable = re.fullmatch(r"TRACEML_(?!TEST_)[A-Z0-9_]+", node.value)
                if variable and node.value not in NOT_KNOB_VARIABLES:
                    wrong.append(f"{where}:{node.lineno}: {node.value!r}")
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    named = isinstance(target, ast.Name) and target.id in names
                    if named and _literal(node.value):
                        wrong.append(f"{where}:{node.lineno}: {target.id} = a literal")
            elif isinstance(node, ast.arguments):
                args = node.posonlyargs + node.args
                pairs = list(
                    zip(args[len(args) - len(node.defaults) :], node.defaults, strict=True)
                )
                keyword = zip(node.kwonlyargs, node.kw_defaults, strict=True)
                pairs += [(a, d) for a, d in keyword if d]
                for arg, default in pairs:
                    if arg.arg in names and _literal(default):
                        wrong.append(f"{where}:{arg.lineno}: parameter {arg.arg} = a literal")
            elif isinstance(node, ast.Attribute) and node.attr == "add_argument":
                wrong.append(f"{where}:{node.lineno}: argparse (derive options from settings)")
    assert wrong == []


def _literal(node) -> bool:
    """A number, string or boolean written in the source (None is "not given", not a value)."""
    return (isinstance(node, ast.Constant) and node.value is not None) or (
        isinstance(node, ast.UnaryOp) and isinstance(node.operand, ast.Constant)
    )


def test_the_configs_take_their_defaults_from_the_declarations():
    launch = {f.name: f.default for f in fields(LaunchConfig)}
    for knob in KNOBS:
        # None: resolve() fills it (from the variable; MASTER_PORT's only on several nodes)
        assert launch[knob.field] in ((None,) if knob.name else (knob.value, None)), knob.label
    assert (launch["aggregator_port"], launch["max_restarts"], launch["master_port"]) == (
        29765,
        0,
        None,
    )
    assert {k.label for k in KNOBS} == {
        k.label for k in settings.ALL if "launcher" in k.readers and k.field in launch
    }
    server = {f.name: f.default for f in fields(ServerConfig)}
    for name, knob in (
        ("port", settings.AGGREGATOR_PORT),
        ("html_report", settings.HTML_REPORT),
        ("finalize_timeout_s", settings.FINALIZE_TIMEOUT_SEC),
        ("hang_timeout_s", settings.HANG_TIMEOUT_SEC),
        ("max_concurrent_rpcs", settings.MAX_CONCURRENT_RPCS),
        ("max_queued_bytes", settings.MAX_QUEUED_BYTES),
    ):
        assert server[name] == knob.value, name
    assert (server["port"], server["finalize_timeout_s"], server["max_queued_bytes"]) == (
        29765,
        300.0,
        256 * 2**20,
    )


def test_each_knob_names_its_readers():
    """``readers`` says what reads it: a package that reads the knob by name (the launcher:
    traceml/launcher, the aggregator: traceml_aggregator, a rank: traceml/sdk) is among them.
    (The launcher's LaunchConfig knobs are read by one loop over KNOBS, which is derived from
    ``readers`` itself.)"""
    package = {
        "launcher": "traceml/launcher",
        "aggregator": "traceml_aggregator",
        "rank": "traceml/sdk",
    }
    constants = {id(v): k for k, v in vars(settings).items() if isinstance(v, settings.Setting)}
    for knob in settings.ALL:
        assert knob.readers and set(knob.readers) <= set(settings.PROCESSES), knob.label
        const = constants[id(knob)]
        for process, tree in package.items():
            pattern = re.compile(rf"(read|resolve|env_str|option)\(settings\.{const}\b")
            named = any(pattern.search(p.read_text()) for p in (ROOT / tree).rglob("*.py"))
            if named:
                assert process in knob.readers, f"{knob.label} is read by the {process}"


def test_the_documented_flag_table_has_the_declared_defaults():
    """docs/distributed-training.md's table of `traceml run` flags: each knob's row states
    its declared default."""
    by_flag = {k.flag: k for k in settings.ALL if k.flag}
    text = (ROOT / "docs" / "distributed-training.md").read_text()
    table = text.split("\n## Flags\n")[1].strip().split("\n\n")[0]
    rows = re.findall(r"^\| `(--[a-z-]+)`[^|]*\| ([^|]+) \|", table, re.MULTILINE)
    checked = set()
    for flag, cell in rows:
        knob = by_flag.get(flag)
        if knob is None:
            continue
        shown = knob.default_text().split(" or ")[-1].removesuffix(" s")
        if not knob.default:
            shown = f"${knob.name}" if knob.name else "off"
        assert shown in cell, (flag, cell, shown)
        checked.add(flag)
    assert {
        "--finalize-timeout-sec",
        "--hang-timeout-sec",
        "--aggregator-port",
        "--dashboard-port",
        "--aggregator-max-restarts",
        "--peak-tflops",
        "--html-report",
        "--max-restarts",
        "--metrics-port",
        "--metrics-bind-host",
        "--otlp-endpoint",
    } <= checked


def test_the_aggregators_argv_parses_back_to_the_launchers_values(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("pass\n")
    config = LaunchConfig(
        script=str(script),
        run_name="argv",
        aggregator_port=31001,
        hang_timeout_sec=7.5,
        finalize_timeout_sec=11.0,
        html_report=True,
        mode="dashboard",
        dashboard_port=31002,
        metrics_port=31003,
        otlp_endpoint="http://127.0.0.1:4317",
        master_port=31004,
    ).resolve()
    argv = launcher_aggregator.aggregator_argv(config, RunDir(tmp_path / "logs" / "argv", 0))
    assert argv[:3] == [sys.executable, "-m", "traceml_aggregator"]
    assert " ".join(argv[3:]) == (
        f"--run-dir {tmp_path / 'logs' / 'argv'} --run-name argv --bind-host 127.0.0.1 "
        "--world-size 1 --nnodes 1 --master-port 31004 --port 31001 --html-report "
        "--finalize-timeout-sec 11.0 --hang-timeout-sec 7.5 --metrics-port 31003 "
        "--metrics-bind-host 127.0.0.1 --otlp-endpoint http://127.0.0.1:4317 --dashboard-port 31002"
    )
    command = typer.main.get_command(aggregator_cli.app)
    params = command.make_context("traceml-aggregator", argv[3:]).params
    for knob in settings.ALL:
        if knob.passed_as:
            assert params[knob.passed_as[2:].replace("-", "_")] == getattr(config, knob.field)
    assert (params["dashboard_port"], params["master_port"]) == (31002, 31004)


KIND_CASES = [
    # (kind, text of a variable, the error's "must be ... (got ...)" or the value)
    (settings.POSITIVE, "2.5", 2.5),
    (settings.POSITIVE, "0", "must be a finite number > 0 (got '0')"),
    (settings.POSITIVE, "nan", "must be a finite number > 0 (got 'nan')"),
    (settings.POSITIVE, "inf", "must be a finite number > 0 (got 'inf')"),
    (settings.POSITIVE, "soon", "must be a finite number > 0 (got 'soon')"),
    (settings.COUNT, "3", 3),
    (settings.COUNT, "0", "must be an integer >= 1 (got '0')"),
    (settings.COUNT, "1.5", "must be an integer >= 1 (got '1.5')"),
    (settings.NON_NEGATIVE, "0", 0),
    (settings.NON_NEGATIVE, "-1", "must be an integer >= 0 (got '-1')"),
    (settings.PORT, "65535", 65535),
    (settings.PORT, "65536", "must be a TCP port, 1-65535 (got '65536')"),
    (settings.BOOL, "Yes", True),
    (settings.BOOL, "2", False),
    (settings.TEXT, " a b ", " a b "),
    (settings.PATH, "c.pem", Path("c.pem")),
]


@pytest.mark.parametrize("kind, raw, expected", KIND_CASES)
def test_one_validator_per_kind_with_one_error_style(kind, raw, expected):
    if isinstance(expected, str) and expected.startswith("must be"):
        with pytest.raises(settings.KnobError) as caught:
            kind.parse("TRACEML_X", raw)
        assert str(caught.value) == f"TRACEML_X {expected}"
    else:
        assert kind.parse("TRACEML_X", raw) == expected


def test_a_flags_value_is_checked_by_the_same_validator():
    with pytest.raises(settings.KnobError, match=r"^--x must be a finite number > 0 \(got nan\)$"):
        settings.POSITIVE.check("--x", math.nan)
    assert settings.POSITIVE.check("--x", 0.001) == 0.001
    assert settings.PORT.check("--x", None) is None  # not given


def test_a_rank_reads_a_bad_variable_as_the_default_with_one_warning(monkeypatch, capsys):
    monkeypatch.setenv("TRACEML_FLUSH_INTERVAL_SEC", "-2")
    assert settings.read(settings.FLUSH_INTERVAL_SEC) == 2.0
    assert capsys.readouterr().err == (
        "traceml: TRACEML_FLUSH_INTERVAL_SEC must be a finite number > 0 (got '-2'); "
        "using the default, 2.0\n"
    )
    monkeypatch.setenv("TRACEML_FLUSH_INTERVAL_SEC", "")  # empty is unset
    assert settings.read(settings.FLUSH_INTERVAL_SEC) == 2.0
    monkeypatch.setenv("TRACEML_FLUSH_INTERVAL_SEC", "0.25")
    assert settings.read(settings.FLUSH_INTERVAL_SEC) == 0.25
    assert capsys.readouterr().err == ""


def _help(app, args: list[str]) -> str:
    """The command's ``--help``, its whitespace runs made single spaces (undoes the wrapping)."""
    result = CliRunner().invoke(app, [*args, "--help"])
    assert result.exit_code == 0, result.output
    return " ".join(result.output.split())


def test_help_shows_each_knobs_declared_default():
    run = _help(launcher_cli.app, ["run"])
    aggregator = _help(aggregator_cli.app, [])
    for knob in settings.ALL:
        if not knob.flag:
            continue
        # (a knob a command leaves unset says more after its default: "29500 on several nodes")
        assert f"[default: {knob.default_text()}" in run + aggregator, knob.label
    assert (
        "--hang-timeout-sec <float> Seconds without a completed step before a live rank is "
        "reported as hung. [default: $TRACEML_HANG_TIMEOUT_SEC or 300 s]"
    ) in run
    assert "--aggregator-port <int> The aggregator's gRPC port on node 0. [default: 29765]" in run
    assert "picks a free one). [default: 29500 on several nodes]" in run
    assert "--max-queued-bytes <int>" in aggregator and "[default: 256 MiB]" in aggregator
    assert "--dashboard-port <int>" in aggregator and "[default: off]" in aggregator
    assert "TRACEML_HANG_TIMEOUT_SEC [300]: Seconds without a completed step" in run


LAUNCHER_REFUSALS = [
    (["--hang-timeout-sec", "0"], {}, "--hang-timeout-sec must be a finite number > 0 (got 0.0)"),
    (
        [],
        {"TRACEML_HANG_TIMEOUT_SEC": "soon"},
        "TRACEML_HANG_TIMEOUT_SEC must be a finite number > 0 (got 'soon')",
    ),
    (
        ["--aggregator-max-restarts", "-2"],
        {},
        "--aggregator-max-restarts must be an integer >= 0 (got -2)",
    ),
    (
        [],
        {"TRACEML_AGGREGATOR_MAX_RESTARTS": "1.5"},
        "TRACEML_AGGREGATOR_MAX_RESTARTS must be an integer >= 0 (got '1.5')",
    ),
    (["--max-restarts", "-1"], {}, "--max-restarts must be an integer >= 0 (got -1)"),
    (["--master-port", "70000"], {}, "--master-port must be a TCP port, 1-65535 (got 70000)"),
    (["--nnodes", "0"], {}, "--nnodes must be an integer >= 1 (got 0)"),
    (
        [],
        {"TRACEML_PEAK_TFLOPS": "-1"},
        "TRACEML_PEAK_TFLOPS must be a finite number > 0 (got '-1')",
    ),
    # node 0's aggregator's own variables (it would fall back to the default, in its log)
    (
        [],
        {"TRACEML_AGGREGATOR_CHECKPOINT_SEC": "abc"},
        "TRACEML_AGGREGATOR_CHECKPOINT_SEC must be a finite number > 0 (got 'abc')",
    ),
    (
        [],
        {"TRACEML_STORE_SAMPLE_EVERY": "0"},
        "TRACEML_STORE_SAMPLE_EVERY must be an integer >= 1 (got '0')",
    ),
]


@pytest.mark.torchrun
@pytest.mark.parametrize("flags, env, expected", LAUNCHER_REFUSALS, ids=lambda v: str(v)[:40])
def test_traceml_run_refuses_a_bad_knob_in_one_line(tmp_path, flags, env, expected):
    port = str(free_port())
    args = ["run", str(SCRIPTS / "faulty_ddp.py"), "--aggregator-port", port, *flags]
    result = run_traceml(args, tmp_path, timeout=60, env=env)
    assert (result.returncode, result.stderr, result.stdout) == (
        2,
        f"traceml: error: {expected}\n",
        "",
    )
    assert list(tmp_path.iterdir()) == []


AGGREGATOR_REFUSALS = [
    (["--hang-timeout-sec", "-1"], {}, "--hang-timeout-sec must be a finite number > 0 (got -1.0)"),
    (
        [],
        {"TRACEML_HANG_TIMEOUT_SEC": "nan"},
        "TRACEML_HANG_TIMEOUT_SEC must be a finite number > 0 (got 'nan')",
    ),
    (["--max-queued-bytes", "0"], {}, "--max-queued-bytes must be an integer >= 1 (got 0)"),
    (["--max-concurrent-rpcs", "-3"], {}, "--max-concurrent-rpcs must be an integer >= 1 (got -3)"),
    (["--dashboard-port", "0"], {}, "--dashboard-port must be a TCP port, 1-65535 (got 0)"),
]


@pytest.mark.aggregator
@pytest.mark.parametrize("flags, env, expected", AGGREGATOR_REFUSALS, ids=lambda v: str(v)[:40])
def test_the_aggregator_refuses_a_bad_knob_in_one_line(tmp_path, flags, env, expected):
    result = subprocess.run(
        aggregator_cmd(tmp_path / "r", "knobs", *flags),
        env=traceml_env(env),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert (result.returncode, result.stderr, result.stdout) == (
        2,
        f"traceml-aggregator: error: {expected}\n",
        "",
    )
    assert not (tmp_path / "r").exists()
