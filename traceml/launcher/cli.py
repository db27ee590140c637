"""The ``traceml`` command (typer): ``traceml run SCRIPT [ARGS]`` and friends.

``traceml run`` flags may stand before or after the script; every other argument after the
script goes to the script, in order. Put ``--`` before script arguments that look like
``traceml run`` flags: everything after ``--`` reaches the script untouched.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import typer

from traceml import settings
from traceml.core import log, otlp
from traceml.core.cli import option

app = typer.Typer(
    name="traceml",
    help="Find out why PyTorch training is slow.",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


_log = log.get("launcher")


def _error(message: str) -> None:
    """One ``traceml: error: <message>`` line (the ``traceml.launcher`` logger)."""
    _log.error(f"error: {message}")


@app.callback()
def _root() -> None:
    """Find out why PyTorch training is slow."""


def _environment_help() -> str:
    """The ``traceml run --help`` epilog: every ``TRACEML_*`` variable, its default and doc
    (:data:`traceml.settings.ALL`), one paragraph each."""
    lines = ["Environment variables [default]:"]
    for setting in settings.ALL:
        if setting.name:
            default = f" [{setting.default}]" if setting.default else ""
            lines.append(f"{setting.name}{default}: {setting.doc}")
    return "\n\n".join(lines)


@app.command(
    "run",
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    epilog=_environment_help(),
)
def run_command(
    ctx: typer.Context,
    script: str = typer.Argument(..., help="training script, run once per rank by torchrun"),
    nproc_per_node: int = typer.Option(1, help="ranks (workers) on this node"),
    nnodes: int = typer.Option(1, help="number of nodes"),
    node_rank: int = typer.Option(0, help="this node's rank, 0..nnodes-1"),
    master_addr: str = typer.Option("127.0.0.1", help="address of node 0 (rendezvous)"),
    master_port: int | None = option(
        settings.MASTER_PORT, unset=f"{settings.MASTER_PORT.default} on several nodes"
    ),
    run_name: str | None = typer.Option(
        None, help="run name; required with --nnodes > 1, the same on every node"
    ),
    session_id: str | None = typer.Option(None, help="alias of --run-name"),
    aggregator_host: str | None = typer.Option(
        None, help="address ranks use to reach the aggregator [default: --master-addr]"
    ),
    aggregator_port: int = option(settings.AGGREGATOR_PORT),
    aggregator_bind_host: str | None = typer.Option(
        None,
        help="address node 0's aggregator listens on "
        "[default: 127.0.0.1; 0.0.0.0 with --nnodes > 1]",
    ),
    mode: str = typer.Option(
        "summary", help="summary | cli | dashboard (a page served by node 0: see --dashboard-port)"
    ),
    dashboard_port: int = option(settings.DASHBOARD_PORT),
    logs_dir: Path = typer.Option(Path("logs"), help="parent of the run directory"),
    html_report: bool = option(settings.HTML_REPORT),
    finalize_timeout_sec: float | None = option(settings.FINALIZE_TIMEOUT_SEC),
    hang_timeout_sec: float | None = option(settings.HANG_TIMEOUT_SEC),
    max_restarts: int = option(settings.MAX_RESTARTS),
    aggregator_max_restarts: int | None = option(settings.AGGREGATOR_MAX_RESTARTS),
    save_training_output: bool | None = option(settings.SAVE_TRAINING_OUTPUT),
    node_relay: bool | None = option(settings.NODE_RELAY),
    keep_all_steps: bool = option(settings.KEEP_ALL_STEPS),
    run_token: str | None = option(settings.RUN_TOKEN),
    tls_cert: Path | None = option(settings.TLS_CERT),
    tls_key: Path | None = option(settings.TLS_KEY),
    tls_ca: Path | None = option(settings.TLS_CA),
    auto_instrument: bool | None = option(settings.AUTO_INSTRUMENT),
    peak_tflops: float | None = option(settings.PEAK_TFLOPS),
    metrics_port: int | None = option(settings.METRICS_PORT, unset="off"),
    metrics_bind_host: str = option(settings.METRICS_BIND_HOST),
    otlp_endpoint: str | None = option(settings.OTLP_ENDPOINT, unset=otlp.DEFAULT_TEXT),
    use_slurm: bool = typer.Option(
        False,
        "--slurm",
        help="inside srun: derive --nnodes, --node-rank, --nproc-per-node, --master-addr and "
        "--run-name from the job step's SLURM_* variables (flags given win)",
    ),
) -> None:
    """Run SCRIPT under torchrun with TraceML telemetry; exits with torchrun's exit code."""
    from traceml.launcher import claim, slurm
    from traceml.launcher.config import LaunchConfig, LaunchError
    from traceml.launcher.run import Launch, preflight

    if run_name and session_id and run_name != session_id:
        _error(f"--run-name {run_name!r} and --session-id {session_id!r} differ; give one")
        raise typer.Exit(2)
    config = LaunchConfig(
        script=script,
        script_args=list(ctx.args),
        nproc_per_node=nproc_per_node,
        nnodes=nnodes,
        node_rank=node_rank,
        master_addr=master_addr,
        master_port=master_port,
        run_name=run_name if run_name is not None else session_id,
        aggregator_host=aggregator_host,
        aggregator_port=aggregator_port,
        aggregator_bind_host=aggregator_bind_host,
        mode=mode,
        dashboard_port=dashboard_port,
        logs_dir=logs_dir,
        html_report=html_report,
        finalize_timeout_sec=finalize_timeout_sec,
        hang_timeout_sec=hang_timeout_sec,
        max_restarts=max_restarts,
        aggregator_max_restarts=aggregator_max_restarts,
        save_training_output=save_training_output,
        node_relay=node_relay,
        keep_all_steps=keep_all_steps,
        run_token=run_token,
        tls_cert=tls_cert,
        tls_key=tls_key,
        tls_ca=tls_ca,
        auto_instrument=auto_instrument,
        peak_tflops=peak_tflops,
        metrics_port=metrics_port,
        metrics_bind_host=metrics_bind_host,
        otlp_endpoint=otlp_endpoint,
    )
    try:
        step = slurm.SlurmStep.from_env(os.environ)
        note = slurm.apply(config, _typed(ctx), step) if use_slurm else slurm.hint(config, step)
        if note:
            _log.info(note)
        config.resolve()
        preflight(config)
        for line in config.node0_notes():
            _log.info(line)
    except claim.ClaimError as exc:
        _error(str(exc))
        _log.info(claim.report_refusal(config, str(exc)))
        raise typer.Exit(2) from None
    except LaunchError as exc:
        _error(str(exc))
        raise typer.Exit(2) from None
    _exit_now(Launch(config).run())


def _exit_now(code: int) -> None:
    """End ``traceml run`` with ``code`` at once: flush stdout and stderr, then ``os._exit``.

    The launch has finished everything it owns (torchrun and the aggregator have exited, the
    manifests are written); what is left is the interpreter's teardown of typer, pydantic and
    gRPC, about 0.15 s of CPU at the end of every run.
    """
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed, or a broken pipe: nothing more can be said
            pass
    os._exit(code)


def _typed(ctx: typer.Context) -> set[str]:
    """Names of the parameters given on the command line (``session_id`` also as
    ``run_name``, its alias)."""
    typed = {name for name in ctx.params if ctx.get_parameter_source(name).name == "COMMANDLINE"}
    if "session_id" in typed:
        typed.add("run_name")
    return typed


@app.command("view")
def view_command(
    summary: Path = typer.Argument(..., help="final_summary.json (or its run directory)"),
    html: Path | None = typer.Option(None, help="write the HTML report to this file"),
    serve: bool = typer.Option(
        False, "--serve", help="serve the run's dashboard over its stored telemetry (Ctrl-C stops)"
    ),
    port: int = option(settings.DASHBOARD_PORT, "--port"),
    bind_host: str = typer.Option("127.0.0.1", help="with --serve: the address to listen on"),
) -> None:
    """Print a saved summary's text report, render its HTML report with --html, or serve its
    dashboard with --serve."""
    from traceml.core.rundir import write_atomic
    from traceml.report import SummaryFileError, read_summary

    if serve:
        _serve_stored(summary, port, bind_host)
    try:
        document = read_summary(summary)
    except SummaryFileError as exc:
        _error(str(exc))
        raise typer.Exit(2) from None
    if html is None:
        from traceml.report.text import render_text

        sys.stdout.write(render_text(document))
        return
    from traceml.report.html import render_html

    if html.is_dir() or not html.name:  # "", ".", "/", "..", an existing directory
        _error(f"--html {str(html)!r} is a directory: give the report's file name")
        raise typer.Exit(2)
    try:
        write_atomic(html, render_html(document))
    except OSError as exc:
        _error(f"cannot write {html}: {exc.strerror or exc}")
        raise typer.Exit(2) from None
    _log.info(f"wrote {html}")


def _serve_stored(path: Path, port: int, bind_host: str) -> None:
    """``traceml view RUN_DIR --serve``: become ``python -m traceml_aggregator.dashboard``
    (the launcher and the aggregator import each other in neither direction; exec'd, it gets
    Ctrl-C itself and its exit code is the command's)."""
    run_dir = path.parent if path.is_file() else path
    argv = [
        sys.executable,
        "-m",
        "traceml_aggregator.dashboard",
        str(run_dir),
        "--port",
        str(port),
        "--bind-host",
        bind_host,
    ]
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os.execv(sys.executable, argv)


@app.command("compare")
def compare_command(
    baseline: Path = typer.Argument(..., help="run A: final_summary.json (or its run directory)"),
    candidate: Path = typer.Argument(..., help="run B, compared with A"),
    out_dir: Path = typer.Option(Path("."), help="where compare.json and compare.txt go"),
    fail_on_regression: float | None = typer.Option(
        None,
        metavar="PCT",
        help="exit with code 3 when a key metric got worse by more than PCT percent (step "
        "time: its 95% bootstrap interval above 0 and its estimate above PCT; 5 is the "
        "documented CI default), and with 4 when the runs cannot be judged (INCONCLUSIVE)",
    ),
) -> None:
    """Compare two runs: per-metric deltas, the change of diagnosis, and a verdict."""
    from traceml.core.rundir import write_atomic
    from traceml.report import SummaryFileError, read_summary, to_json
    from traceml.report.compare import (
        INCONCLUSIVE_EXIT_CODE,
        REGRESSION_EXIT_CODE,
        compare,
        interval_text,
        regressions_beyond,
        render_compare_text,
    )

    if fail_on_regression is not None and not fail_on_regression >= 0:
        _error(f"--fail-on-regression {fail_on_regression} must be a percentage >= 0")
        raise typer.Exit(2)
    try:
        a, b = read_summary(baseline), read_summary(candidate)
    except SummaryFileError as exc:
        _error(str(exc))
        raise typer.Exit(2) from None
    document = compare(a, b, a_path=str(baseline), b_path=str(candidate))
    text = render_compare_text(document)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        write_atomic(out_dir / "compare.json", to_json(document))
        write_atomic(out_dir / "compare.txt", text)
    except OSError as exc:
        _error(f"cannot write to {out_dir}: {exc.strerror or exc}")
        raise typer.Exit(2) from None
    sys.stdout.write(text)
    if fail_on_regression is not None:
        if document["verdict"] == "INCONCLUSIVE":
            _error(f"cannot judge the candidate: {document['summary']}")
            raise typer.Exit(INCONCLUSIVE_EXIT_CODE)
        worse = regressions_beyond(document, fail_on_regression)
        if worse:
            names = ", ".join(
                f"{r['name']} {r['change_pct']:+.1f}%"
                + (f" ({interval_text(r)})" if interval_text(r) else "")
                for r in worse
            )
            _error(f"regression beyond {fail_on_regression:g}%: {names}")
            raise typer.Exit(REGRESSION_EXIT_CODE)


def main() -> None:
    """Console entry point: usage errors become one ``traceml: error:`` line, exit code 2."""
    from traceml.core.cli import run_app

    sys.exit(run_app(app, _log))
