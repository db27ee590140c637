"""``traceml-aggregator``: the telemetry aggregator as a standalone command.

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
Exit codes: 0 after a clean stop, 2 for bad options or a port that cannot be bound.

``--owned`` is how ``traceml run`` starts it: the launcher owns its lifetime (it stops when
its standard input, the launcher's pipe, closes; SIGTERM and SIGINT are noted, not obeyed).
``--restart-reason``/``--down-since-unix-s`` mark a restart on the same store after the
previous aggregator died; ``--finalize-only`` writes the summary from the store without
serving (exit code 1 if it cannot).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
from pathlib import Path

from traceml import settings
from traceml.core.rundir import validate_run_name


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="traceml-aggregator", description="TraceML telemetry aggregator (gRPC + SQLite)."
    )
    p.add_argument("--run-dir", required=True, type=Path, help="directory of the run's files")
    p.add_argument("--run-name", required=True, help="accept telemetry of this run only")
    p.add_argument("--port", type=int, default=29765, help="gRPC port (default 29765)")
    p.add_argument("--bind-host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--world-size", type=int, default=None, help="number of ranks expected")
    p.add_argument(
        "--nnodes",
        type=int,
        default=None,
        help="node launchers that report their torchrun's exit (set by `traceml run`)",
    )
    p.add_argument("--html-report", action="store_true", help="also write final_summary.html")
    p.add_argument(
        "--no-summary-at-stop",
        dest="summary_at_stop",
        action="store_false",
        help="do not write the reports when stopped without a Finalize (traceml run sets it)",
    )
    p.add_argument(
        "--owned",
        action="store_true",
        help="a launcher owns this process (traceml run sets it): stop at end of file on "
        "stdin, note SIGTERM/SIGINT instead of stopping",
    )
    p.add_argument(
        "--restart-reason",
        default="",
        help="this aggregator replaces one that died for this reason (recorded in the store)",
    )
    p.add_argument(
        "--down-since-unix-s",
        type=float,
        default=None,
        help="with --restart-reason: when the run lost its aggregator (Unix s)",
    )
    p.add_argument(
        "--finalize-only",
        action="store_true",
        help="do not serve: write final_summary.* from the store in --run-dir, then exit",
    )
    p.add_argument(
        "--node-exit-file",
        type=Path,
        default=None,
        help="with --finalize-only: a serialized NodeExit to store first (the launcher's)",
    )
    p.add_argument(
        "--finalize-timeout-sec",
        type=float,
        default=None,
        help=f"finalization budget, s (default ${settings.FINALIZE_TIMEOUT_SEC.name} or "
        f"{settings.FINALIZE_TIMEOUT_SEC.default})",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``traceml-aggregator``; returns the exit code."""
    from traceml_aggregator.server import BindError, ServerConfig, finalize_offline, serve

    args = _parser().parse_args(argv)
    error = validate_run_name(args.run_name)
    if not error and not 0 < args.port < 65536:
        error = f"--port {args.port} is not a TCP port (1-65535)"
    if not error and args.world_size is not None and args.world_size < 1:
        error = f"--world-size {args.world_size} must be >= 1"
    if not error and args.nnodes is not None and args.nnodes < 1:
        error = f"--nnodes {args.nnodes} must be >= 1"
    timeout = args.finalize_timeout_sec
    if timeout is None:
        try:
            timeout = settings.env_float(settings.FINALIZE_TIMEOUT_SEC, strict=True)
        except ValueError as exc:
            error = error or str(exc)
    elif not (math.isfinite(timeout) and timeout > 0):
        error = error or f"--finalize-timeout-sec {timeout} must be a finite number > 0"
    if error:
        print(f"traceml-aggregator: error: {error}", file=sys.stderr)
        return 2
    config = ServerConfig(
        run_dir=args.run_dir,
        run_name=args.run_name,
        port=args.port,
        bind_host=args.bind_host,
        world_size=args.world_size,
        nnodes=args.nnodes,
        html_report=args.html_report,
        summary_at_stop=args.summary_at_stop,
        finalize_timeout_s=timeout,
        owned=args.owned,
        restart_reason=args.restart_reason,
        down_since_unix_s=args.down_since_unix_s,
    )
    if args.finalize_only:
        return finalize_offline(config, args.node_exit_file)

    def ready(port: int) -> None:
        print(
            f"traceml-aggregator: serving run {args.run_name!r} on "
            f"{args.bind_host}:{port}, store {args.run_dir}",
            file=sys.stderr,
            flush=True,
        )

    try:
        return asyncio.run(serve(config, ready))
    except BindError as exc:
        print(f"traceml-aggregator: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
