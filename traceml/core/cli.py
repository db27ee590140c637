"""What the two commands (``traceml``, ``traceml-aggregator``) share around typer: running an
app so that a usage error is one ``<prog>: error: <message>`` line and exit code 2."""

from __future__ import annotations

import logging

import typer


def run_app(
    app: typer.Typer, logger: logging.Logger, prog: str | None = None, argv: list[str] | None = None
) -> int:
    """Run ``app`` on ``argv`` (default ``sys.argv[1:]``) as ``prog`` (default: click's name
    from ``sys.argv[0]``); its exit code.

    The command's return value (an int) or its ``typer.Exit`` code is the exit code; Ctrl-C is
    130; a usage error (unknown option, missing or malformed value) is one ``error: ...`` line
    on ``logger`` and click's exit code (2). Any other exception propagates.
    """
    try:
        code = app(args=argv, prog_name=prog, standalone_mode=False)
    except typer.Abort:
        code = 130
    except Exception as exc:
        # typer's usage errors (click's, vendored or not) carry format_message and exit_code.
        format_message = getattr(exc, "format_message", None)
        if format_message is None:
            raise
        message = format_message().replace("\n", " ").strip()
        if message:
            logger.error(f"error: {message}")
        code = getattr(exc, "exit_code", 2)
    return code if isinstance(code, int) else 0
