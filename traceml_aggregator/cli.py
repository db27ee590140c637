"""``traceml-aggregator``: the telemetry aggregator as a standalone command (typer).

Usage::

    traceml-aggregator --run-dir logs/my-run --run-name my-run --world-size 8 \\
        [--port P] [--bind-host H] [--html-report] [--finalize-timeout-sec S] \\
        [--nnodes N [--master-port P]] [--no-summary-at-stop] \\
        [--metrics-port P [--metrics-bind-host H]] [--otlp-endpoint URL] [--dashboard-port P]

``--nnodes`` (set by ``traceml run``) makes finalization also wait, briefly, for each node
launcher's report of its torchrun's exit; ranks under plain torchrun have no launcher, so a
standalone aggregator leaves it out. ``--master-port`` (also set by ``traceml run``: node 0's
rendezvous port) refuses a node launcher's claim made with another.

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
serving: exit code 2 (one line, nothing created) when ``--run-dir`` holds no store, the store
is not a database, is damaged, is held by a running aggregator or records another run name,
1 if the summary cannot be written otherwise.

Every call but the health check must carry the run token: ``--run-token``, else
``TRACEML_RUN_TOKEN``, else the one in ``<run-dir>/run_token`` (a restart on the run's
directory: its ranks keep theirs), else a fresh random one written there (mode 0600; the
aggregator prints where, never the token). Give the ranks the same token through
``TRACEML_RUN_TOKEN``.
Prefer the variable to the flag: every user of the host sees a flag's value in ``ps``.
``--tls-cert``/``--tls-key`` (or ``TRACEML_TLS_CERT``/``TRACEML_TLS_KEY``) serve TLS; clients
then need ``TRACEML_TLS_CA``.

``--otlp-endpoint URL`` (or the standard ``OTEL_EXPORTER_OTLP_METRICS_ENDPOINT`` /
``OTEL_EXPORTER_OTLP_ENDPOINT``) pushes the ``/metrics`` series to an OpenTelemetry collector
(:mod:`traceml_aggregator.otlp`); without the ``otlp`` extra installed that is one line and
the aggregator serves on without it.
"""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path

import typer

from traceml import settings
from traceml.core import log, otlp, transport
from traceml.core.cli import option
from traceml.core.rundir import TOKEN_FILE_NAME, validate_run_name

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
    port: int = option(settings.AGGREGATOR_PORT, "--port"),
    bind_host: str = typer.Option("127.0.0.1", help="address to listen on"),
    world_size: int | None = typer.Option(None, help="number of ranks expected"),
    nnodes: int | None = typer.Option(
        None, help="node launchers that report their torchrun's exit (set by `traceml run`)"
    ),
    master_port: int | None = typer.Option(
        None,
        help="node 0's rendezvous port: a node launcher's claim with another is refused (set "
        "by `traceml run`)",
    ),
    html_report: bool = option(settings.HTML_REPORT, negatable=False),
    no_summary_at_stop: bool = typer.Option(
        False,
        "--no-summary-at-stop",
        help="do not write the reports when stopped without a Finalize (traceml run sets it)",
    ),
    metrics_port: int | None = option(settings.METRICS_PORT, unset="off"),
    metrics_bind_host: str = option(settings.METRICS_BIND_HOST),
    otlp_endpoint: str | None = option(settings.OTLP_ENDPOINT, unset=otlp.DEFAULT_TEXT),
    dashboard_port: int | None = option(settings.DASHBOARD_PORT, unset="off"),
    finalize_timeout_sec: float | None = option(settings.FINALIZE_TIMEOUT_SEC),
    hang_timeout_sec: float | None = option(settings.HANG_TIMEOUT_SEC),
    owned: bool = typer.Option(
        False,
        "--owned",
        help="a launcher owns this process (traceml run sets it): stop at end of file on "
        "stdin, note SIGTERM/SIGINT instead of stopping",
    ),
    restart_reason: str = typer.Option(
        "", help="this aggregator replaces one that died for this reason (recorded in the store)"
    ),
    down_since_unix_s: float | None = typer.Option(
        None, help="with --restart-reason: when the run lost its aggregator (Unix s)"
    ),
    finalize_only: bool = typer.Option(
        False,
        "--finalize-only",
        help="do not serve: write final_summary.* from the store in --run-dir, then exit",
    ),
    node_exit_file: Path | None = typer.Option(
        None, help="with --finalize-only: a serialized NodeExit to store first (the launcher's)"
    ),
    lost_reason: str = typer.Option(
        "",
        help="with --finalize-only: the run's aggregator was lost for good for this reason "
        "(recorded in the store; the summary says it covers only what was stored before)",
    ),
    lost_unix_s: float | None = typer.Option(
        None, help="with --lost-reason: when the launcher saw it lost (Unix s)"
    ),
    run_token: str | None = option(settings.RUN_TOKEN),
    tls_cert: Path | None = option(settings.TLS_CERT),
    tls_key: Path | None = option(settings.TLS_KEY),
    max_concurrent_rpcs: int = option(settings.MAX_CONCURRENT_RPCS),
    max_queued_bytes: int = option(settings.MAX_QUEUED_BYTES),
    keep_all_steps: bool = option(settings.KEEP_ALL_STEPS, negatable=False),
) -> int:
    """Serve until SIGTERM/SIGINT; the exit code (see the module docstring)."""
    from traceml_aggregator.server import BindError, ServerConfig, finalize_offline, serve
    from traceml_aggregator.store import StoreVersionError

    error = validate_run_name(run_name)
    try:
        for flag, value in (("--world-size", world_size), ("--nnodes", nnodes)):
            settings.COUNT.check(flag, value)
        settings.PORT.check("--master-port", master_port)
        settings.resolve(settings.METRICS_PORT, metrics_port)
        settings.resolve(settings.AGGREGATOR_PORT, port, "--port")
        settings.resolve(settings.DASHBOARD_PORT, dashboard_port)
        finalize_timeout_sec = settings.resolve(settings.FINALIZE_TIMEOUT_SEC, finalize_timeout_sec)
        hang_timeout_sec = settings.resolve(settings.HANG_TIMEOUT_SEC, hang_timeout_sec)
        settings.resolve(settings.MAX_CONCURRENT_RPCS, max_concurrent_rpcs)
        settings.resolve(settings.MAX_QUEUED_BYTES, max_queued_bytes)
        tls = transport.TlsFiles.resolve(tls_cert, tls_key, serves=True, reads_ca=False)
        if not finalize_only:
            otlp.check(otlp_endpoint)
    except (settings.KnobError, transport.TlsFilesError, ValueError) as exc:
        error = error or str(exc)
    if error:
        _log.error(f"error: {error}")
        return 2
    tls_cert, tls_key = tls.cert, tls.key
    token = run_token or settings.env_str(settings.RUN_TOKEN)
    if not token and not finalize_only:
        token_file = run_dir / TOKEN_FILE_NAME
        try:
            # A restart on the run's directory keeps its token: its ranks still send with it.
            token = transport.read_token_file(token_file)
        except transport.TokenFileError as exc:
            _log.error(f"error: {exc}")
            return 2
        if token is not None:
            _log.info(f"run token read from {token_file} (this run directory's)")
        else:
            token = transport.new_token()
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
        master_port=master_port,
        html_report=html_report,
        summary_at_stop=not no_summary_at_stop,
        finalize_timeout_s=finalize_timeout_sec,
        hang_timeout_s=hang_timeout_sec,
        owned=owned,
        restart_reason=restart_reason,
        down_since_unix_s=down_since_unix_s,
        lost_reason=lost_reason,
        lost_unix_s=lost_unix_s,
        run_token=token,
        tls_cert=tls_cert,
        tls_key=tls_key,
        max_concurrent_rpcs=max_concurrent_rpcs,
        max_queued_bytes=max_queued_bytes,
        keep_all_steps=keep_all_steps,
        metrics_port=metrics_port,
        metrics_bind_host=metrics_bind_host,
        dashboard_port=dashboard_port,
        otlp_endpoint=otlp_endpoint,
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
