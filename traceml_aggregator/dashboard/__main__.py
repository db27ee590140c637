"""``python -m traceml_aggregator.dashboard RUN_DIR``: the dashboard over a stored run
(what ``traceml view RUN_DIR --serve`` runs).

It reads the run's store once, read-only (a running aggregator's store is refused: SQLite
reports it locked), and serves the page on ``--bind-host:--port`` until SIGINT or SIGTERM,
printing its URL on stderr, without the token: the link with it is written, mode 0600, to
``RUN_DIR/dashboard_link`` (or, when the run directory is not writable, to a file of this
user's temporary directory; the line names which). The token is ``TRACEML_RUN_TOKEN`` when
set, else a fresh one for this process. Exit codes: 0 after a stop by a signal, 2 for a bad
option, a run directory
without a readable store, or a port that cannot be bound.
"""

from __future__ import annotations

import asyncio
import signal
import tempfile
from pathlib import Path

import typer

from traceml import settings
from traceml.core import endpoint, log, transport
from traceml.core.cli import option
from traceml.core.rundir import DASHBOARD_LINK_FILE_NAME

_log = log.get("view")  # lines as `traceml: ...`: the user ran `traceml view --serve`

app = typer.Typer(
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)


@app.command(help="Serve the TraceML dashboard of a stored run.")
def serve_stored(
    run_dir: Path = typer.Argument(..., help="the run's directory (holds telemetry.sqlite)"),
    port: int = option(settings.DASHBOARD_PORT, "--port"),
    bind_host: str = typer.Option("127.0.0.1", help="address to listen on"),
) -> int:
    """Serve until SIGINT/SIGTERM; the exit code (see the module docstring)."""
    from traceml_aggregator.dashboard import app as dashboard_app
    from traceml_aggregator.dashboard.sources import StoredSource
    from traceml_aggregator.store import StoreUnavailable

    try:
        settings.resolve(settings.DASHBOARD_PORT, port, "--port")
    except settings.KnobError as exc:
        _log.error(f"error: {exc}")
        return 2
    try:
        source = StoredSource(run_dir)
    except (OSError, StoreUnavailable) as exc:
        _log.error(f"error: {exc}")
        return 2
    token = settings.env_str(settings.RUN_TOKEN) or transport.new_token()

    async def serve() -> int:
        try:
            runner = await dashboard_app.start(source, bind_host, port, token)
        except OSError as exc:
            _log.error(
                f"error: cannot serve the dashboard on {endpoint.target(bind_host, port)}: {exc}"
            )
            return 2
        url = endpoint.dashboard_url(bind_host, port)
        link_file = run_dir / DASHBOARD_LINK_FILE_NAME
        try:
            dashboard_app.write_link(link_file, url, token)
        except OSError:  # a run directory of another user, read-only: a private one of ours
            link_file = Path(tempfile.mkdtemp(prefix="traceml-view-")) / link_file.name
            dashboard_app.write_link(link_file, url, token)
        _log.info(
            f"dashboard of the stored run {run_dir}: {url} (open the link in {link_file}, "
            "mode 0600: it holds the token; Ctrl-C stops it)"
        )
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await runner.cleanup()
        return 0

    return asyncio.run(serve())


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit code."""
    from traceml.core.cli import run_app

    return run_app(app, _log, "traceml view --serve", argv)


if __name__ == "__main__":
    import sys

    sys.exit(main())
