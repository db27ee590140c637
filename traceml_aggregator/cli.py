"""``traceml-aggregator``: the telemetry aggregator as a standalone command (typer).

Usage::

    traceml-aggregator --run-dir logs/my-run --run-name my-run --world-size 8 \\
        [--port 29765] [--bind-host 127.0.0.1] [--html-report] [--finalize-timeout-sec 300] \\
        [--nnodes N] [--no-summary-at-stop]

``--nnodes`` (set by ``traceml run``) makes finalization also wait, briefly, for each node
launcher's report of its torchrun's exit; ranks under plain torchrun have no launcher, so a
standalone aggregator leaves it out.

It serves until SIGTERM or SIGINT. ``traceml run`` starts it on node 0; run it yourself to use
the SDK under plain ``torchrun`` (export ``TRACEML_AGGREGATOR=host:port`` and
``TRACEML_RUN_NAME`` to the ranks), then stop it with Ctrl-C or SIGTERM: it writes
``final_summary.*`` when it stops, unless a launcher already asked for them.
Exit codes: 0 after a clean stop, 2 for bad options, a port that cannot be bound, or a store
that cannot be opened (another TraceML version's, or not a database).
"""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path
from typing import Optional

import typer

from traceml import settings
from traceml.core import endpoint, log
from traceml.core.rundir import validate_run_name

_log = log.get("aggregator")

app = typer.Typer(
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)


@app.command(help="TraceML telemetry aggregator (gRPC + SQLite).")
def serve_command(
    run_dir: Path = typer.Option(..., help="directory of the run's files"),
    run_name: str = typer.Option(..., help="accept telemetry of this run only"),
    port: int = typer.Option(endpoint.DEFAULT_PORT, help="gRPC port"),
    bind_host: str = typer.Option("127.0.0.1", help="address to listen on"),
    world_size: Optional[int] = typer.Option(None, help="number of ranks expected"),
    nnodes: Optional[int] = typer.Option(
        None, help="node launchers that report their torchrun's exit (set by `traceml run`)"
    ),
    html_report: bool = typer.Option(False, "--html-report", help="also write final_summary.html"),
    no_summary_at_stop: bool = typer.Option(
        False,
        "--no-summary-at-stop",
        help="do not write the reports when stopped without a Finalize (traceml run sets it)",
    ),
    metrics_port: Optional[int] = typer.Option(
        None, help="serve Prometheus /metrics on this port of --bind-host [default: off]"
    ),
    finalize_timeout_sec: Optional[float] = typer.Option(
        None,
        help=f"finalization budget, s [default: ${settings.FINALIZE_TIMEOUT_SEC.name} or "
        f"{settings.FINALIZE_TIMEOUT_SEC.default}]",
    ),
) -> int:
    """Serve until SIGTERM/SIGINT; the exit code (see the module docstring)."""
    from traceml_aggregator.server import BindError, ServerConfig, serve
    from traceml_aggregator.store import StoreVersionError

    error = (
        validate_run_name(run_name)
        or endpoint.port_error("--port", port)
        or endpoint.port_error("--metrics-port", metrics_port)
    )
    if not error and world_size is not None and world_size < 1:
        error = f"--world-size {world_size} must be >= 1"
    if not error and nnodes is not None and nnodes < 1:
        error = f"--nnodes {nnodes} must be >= 1"
    timeout = finalize_timeout_sec
    if timeout is None:
        try:
            timeout = settings.env_float(settings.FINALIZE_TIMEOUT_SEC, strict=True)
        except ValueError as exc:
            error = error or str(exc)
    else:
        error = error or endpoint.seconds_error("--finalize-timeout-sec", timeout)
    if error:
        _log.error(f"error: {error}")
        return 2
    config = ServerConfig(
        run_dir=run_dir,
        run_name=run_name,
        port=port,
        bind_host=bind_host,
        world_size=world_size,
        nnodes=nnodes,
        html_report=html_report,
        summary_at_stop=not no_summary_at_stop,
        finalize_timeout_s=timeout,
        metrics_port=metrics_port,
    )

    def ready(bound: int) -> None:
        _log.info(f"serving run {run_name!r} on {bind_host}:{bound}, store {run_dir}")

    try:
        return asyncio.run(serve(config, ready))
    except (BindError, StoreVersionError) as exc:
        _log.error(f"error: {exc}")
    except sqlite3.DatabaseError as exc:
        _log.error(f"error: cannot open the store in {run_dir}: {exc}")
    return 2


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``traceml-aggregator``; returns the exit code."""
    from traceml.core.cli import run_app

    return run_app(app, _log, "traceml-aggregator", argv)


if __name__ == "__main__":
    import sys

    sys.exit(main())
