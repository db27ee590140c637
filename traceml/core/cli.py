"""What the commands (``traceml``, ``traceml-aggregator``) share around typer: running an
app so that a usage error is one ``<prog>: error: <message>`` line and exit code 2, and the
option of a knob, derived from its declaration in :mod:`traceml.settings`."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import typer

if TYPE_CHECKING:
    from traceml.settings import Setting


def option(
    setting: Setting, flag: str = "", *, negatable: bool = True, unset: str = ""
) -> Any:  # what typer.Option returns (typer declares it Any: it stands for the value)
    """The ``typer.Option`` of the knob ``setting``: its flag, default and help.

    A knob with a ``TRACEML_*`` variable defaults to None (not given: the command reads the
    variable, else the default, with :func:`traceml.settings.resolve`); one without defaults
    to its declared value. The help is the knob's doc and ``[default: ...]``
    (:meth:`~traceml.settings.Setting.default_text`).

    Args:
        flag: this command's spelling of the flag (default: the declared one).
        negatable: a boolean knob also takes ``--no-<flag>``.
        unset: for a knob this command leaves None unless the flag is given, what it does
            then (the help's ``[default: ...]``, e.g. ``off``).
    """
    flag = flag or setting.flag
    if setting.kind.type is bool and negatable:
        flag = f"{flag}/--no-{flag[2:]}"
    default = None if setting.name or unset else setting.value
    shown = unset or setting.default_text()
    return typer.Option(
        default, flag, help=f"{setting.doc}  [default: {shown}]", show_default=False
    )


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
