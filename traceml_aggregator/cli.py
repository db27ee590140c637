"""``traceml-aggregator``: the telemetry aggregator as a standalone command (typer).

Usage::

    traceml-aggregator --run-dir logs/my-run --run-name my-run --world-size 8 \\
        [--port 29765] [--bind-host 127.0.0.1] [--html-report] [--finalize-timeout-sec 300] \\
        [--nnodes N] [--no-summary-at-stop] [--metrics-port P] [--dashboard-port P]

``--nnodes`` (set by ``traceml run``) makes finalization also wait, briefly, for each node
launcher's report of its torchrun's exit; ranks under plain torchrun have no launcher, so a
standalone aggregator leaves it out.

It serves until SIGTERM or SIGINT. ``traceml run`` starts it on node 0; run it yourself to use
the SDK under plain ``torchrun`` (export ``TRACEML_AGGREGATOR=host:port`` and
``TRACEML_RUN_NAME`` to the ranks), then stop it with Ctrl-C or SIGTERM: it writes
``final_summary.*`` when it stops, unless a launcher already asked for them.
Exit codes: 0 after a clean stop, 2 for bad options, a port that cannot be bound, or a store
that cannot be opened (another TraceML version's, or not a database).

``--owned`` is how ``traceml run`` starts it: the launcher owns its lifetime (it stops when
its standard input, the launcher's pipe, closes; SIGTERM and SIGINT are noted, not obeyed).
``--restart-reason``/``--down-since-unix-s`` mark a restart on the same store after the
previous aggregator died; ``--finalize-only`` writes the summary from the store without
serving (exit code 1 if it cannot).

Every call but the health check must carry the run token: ``--run-token``, else
``TRACEML_RUN_TOKEN``, else a fresh random one written to ``<run-dir>/run_token`` (mode 0600;
the aggregator prints where). Give the ranks the same token through ``TRACEML_RUN_TOKEN``.
Prefer the variable to the flag: every user of the host sees a flag's value in ``ps``.
``--tls-cert``/``--tls-key`` (or ``TRACEML_TLS_CERT``/``TRACEML_TLS_KEY``) serve TLS; clients
then need ``TRACEML_TLS_CA``.
"""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path
from typing import Optional

import typer

from traceml import settings
from traceml.core import endpoint, log, transport
from traceml.core.rundir import validate_run_name

_log = log.get("aggregator")

app = typer.Typer(
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _seconds(value: float | None, setting: settings.Setting, flag: str) -> tuple[float, str]:
    """``(seconds, "")`` from ``flag``'s ``value``, else from ``setting``'s environment
    variable; ``(0.0, error)`` when that is not a finite number > 0."""
    if value is None:
        try:
            return settings.env_float(setting, strict=True), ""
        except ValueError as exc:
            return 0.0, str(exc)
    return value, endpoint.seconds_error(flag, value)


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
    dashboard_port: Optional[int] = typer.Option(
        None,
        help="serve the browser dashboard on this port of --bind-host (traceml run --mode "
        f"dashboard sets it; {endpoint.DASHBOARD_PORT} there) [default: off]",
    ),
    finalize_timeout_sec: Optional[float] = typer.Option(
        None,
        help=f"finalization budget, s [default: ${settings.FINALIZE_TIMEOUT_SEC.name} or "
        f"{settings.FINALIZE_TIMEOUT_SEC.default}]",
    ),
    hang_timeout_sec: Optional[float] = typer.Option(
        None,
        help="seconds without a completed step before a live rank is reported as hung "
        f"[default: ${settings.HANG_TIMEOUT_SEC.name} or {settings.HANG_TIMEOUT_SEC.default}]",
    ),
    owned: bool = typer.Option(
        False,
        "--owned",
        help="a launcher owns this process (traceml run sets it): stop at end of file on "
        "stdin, note SIGTERM/SIGINT instead of stopping",
    ),
    restart_reason: str = typer.Option(
        "", help="this aggregator replaces one that died for this reason (recorded in the store)"
    ),
    down_since_unix_s: Optional[float] = typer.Option(
        None, help="with --restart-reason: when the run lost its aggregator (Unix s)"
    ),
    finalize_only: bool = typer.Option(
        False,
        "--finalize-only",
        help="do not serve: write final_summary.* from the store in --run-dir, then exit",
    ),
    node_exit_file: Optional[Path] = typer.Option(
        None, help="with --finalize-only: a serialized NodeExit to store first (the launcher's)"
    ),
    run_token: Optional[str] = typer.Option(
        None,
        help=f"the run's token [default: ${settings.RUN_TOKEN.name}, else a new one in "
        f"RUN_DIR/{transport.TOKEN_FILE_NAME}]; prefer the variable: ps shows flags",
    ),
    tls_cert: Optional[Path] = typer.Option(None, help="TLS certificate, PEM"),
    tls_key: Optional[Path] = typer.Option(None, help="TLS private key, PEM"),
    max_concurrent_rpcs: Optional[int] = typer.Option(
        None,
        help="calls in flight at most, each sender's open stream included; more are answered "
        "RESOURCE_EXHAUSTED [default: 16384]",
    ),
    max_queued_bytes: Optional[int] = typer.Option(
        None,
        help="bound of the writer's queue, bytes; beyond it a batch is pushed back "
        "with a retry-after [default: 256 MiB]",
    ),
) -> int:
    """Serve until SIGTERM/SIGINT; the exit code (see the module docstring)."""
    from traceml_aggregator.server import (
        MAX_CONCURRENT_RPCS,
        BindError,
        ServerConfig,
        finalize_offline,
        serve,
    )
    from traceml_aggregator.writer import MAX_QUEUED_BYTES
    from traceml_aggregator.store import StoreVersionError

    error = (
        validate_run_name(run_name)
        or endpoint.port_error("--port", port)
        or endpoint.port_error("--metrics-port", metrics_port)
        or endpoint.port_error("--dashboard-port", dashboard_port)
    )
    if not error and world_size is not None and world_size < 1:
        error = f"--world-size {world_size} must be >= 1"
    if not error and nnodes is not None and nnodes < 1:
        error = f"--nnodes {nnodes} must be >= 1"
    timeout, bad = _seconds(
        finalize_timeout_sec, settings.FINALIZE_TIMEOUT_SEC, "--finalize-timeout-sec"
    )
    error = error or bad
    hang_timeout, bad = _seconds(hang_timeout_sec, settings.HANG_TIMEOUT_SEC, "--hang-timeout-sec")
    error = error or bad
    try:
        tls = transport.TlsFiles.resolve(tls_cert, tls_key, serves=True, reads_ca=False)
    except transport.TlsFilesError as exc:
        tls, error = transport.TlsFiles(), error or str(exc)
    tls_cert, tls_key = tls.cert, tls.key
    for flag, value in (
        ("--max-concurrent-rpcs", max_concurrent_rpcs),
        ("--max-queued-bytes", max_queued_bytes),
    ):
        if not error and value is not None and value < 1:
            error = f"{flag} {value} must be >= 1"
    if error:
        _log.error(f"error: {error}")
        return 2
    token = run_token or settings.env_str(settings.RUN_TOKEN)
    if not token and not finalize_only:
        token = transport.new_token()
        token_file = run_dir / transport.TOKEN_FILE_NAME
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            transport.write_token_file(token_file, token)
        except OSError as exc:
            _log.error(f"error: cannot write {token_file}: {exc}")
            return 2
        _log.info(
            f"run token written to {token_file} (mode 0600); give it to "
            f"the ranks: export {settings.RUN_TOKEN.name}=$(cat {token_file})"
        )
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
        hang_timeout_s=hang_timeout,
        owned=owned,
        restart_reason=restart_reason,
        down_since_unix_s=down_since_unix_s,
        run_token=token,
        tls_cert=tls_cert,
        tls_key=tls_key,
        max_concurrent_rpcs=max_concurrent_rpcs or MAX_CONCURRENT_RPCS,
        max_queued_bytes=max_queued_bytes or MAX_QUEUED_BYTES,
        metrics_port=metrics_port,
        dashboard_port=dashboard_port,
    )
    if finalize_only:
        return finalize_offline(config, node_exit_file)

    def ready(bound: int) -> None:
        _log.info(
            f"serving run {run_name!r} on {bind_host}:{bound}{' (TLS)' if tls_cert else ''}, "
            f"store {run_dir}"
        )

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
