"""``traceml-aggregator``: the telemetry aggregator as a standalone command.

Usage::

    traceml-aggregator --run-dir logs/my-run --run-name my-run --world-size 8 \\
        [--port 29765] [--bind-host 127.0.0.1] [--html-report] [--finalize-timeout-sec 300] \\
        [--nnodes N] [--no-summary-at-stop] [--run-token TOKEN] [--tls-cert PEM --tls-key PEM]
        [--max-concurrent-rpcs N] [--max-queued-bytes N]

``--nnodes`` (set by ``traceml run``) makes finalization also wait, briefly, for each node
launcher's report of its torchrun's exit; ranks under plain torchrun have no launcher, so a
standalone aggregator leaves it out.

It serves until SIGTERM or SIGINT. ``traceml run`` starts it on node 0; run it yourself to use
the SDK under plain ``torchrun`` (export ``TRACEML_AGGREGATOR=host:port`` and
``TRACEML_RUN_NAME`` to the ranks), then stop it with Ctrl-C or SIGTERM: it writes
``final_summary.*`` when it stops, unless a launcher already asked for them.

Every call but the health check must carry the run token: ``--run-token``, else
``TRACEML_RUN_TOKEN``, else a fresh random one written to ``<run-dir>/run_token`` (mode 0600;
the aggregator prints where). Give the ranks the same token through ``TRACEML_RUN_TOKEN``.
Prefer the variable to the flag: every user of the host sees a flag's value in ``ps``.
``--tls-cert``/``--tls-key`` (or ``TRACEML_TLS_CERT``/``TRACEML_TLS_KEY``) serve TLS; clients
then need ``TRACEML_TLS_CA``.
Exit codes: 0 after a clean stop, 2 for bad options or a port that cannot be bound.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
from pathlib import Path

from traceml import settings
from traceml.core import transport
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
        "--run-token",
        default=None,
        help=f"the run's token (default ${settings.RUN_TOKEN.name}, else a new one in "
        f"RUN_DIR/{transport.TOKEN_FILE_NAME}); prefer the variable: ps shows flags",
    )
    p.add_argument("--tls-cert", type=Path, default=None, help="TLS certificate, PEM")
    p.add_argument("--tls-key", type=Path, default=None, help="TLS private key, PEM")
    p.add_argument(
        "--max-concurrent-rpcs",
        type=int,
        default=None,
        help="calls in flight at most; more are answered RESOURCE_EXHAUSTED (default 1024)",
    )
    p.add_argument(
        "--max-queued-bytes",
        type=int,
        default=None,
        help="bound of the writer's queue, bytes; beyond it Push is answered RESOURCE_EXHAUSTED "
        "with a retry-after (default 256 MiB)",
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
    from traceml_aggregator.server import MAX_CONCURRENT_RPCS, BindError, ServerConfig, serve
    from traceml_aggregator.writer import MAX_QUEUED_BYTES

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
    tls_cert = args.tls_cert or _env_path(settings.TLS_CERT)
    tls_key = args.tls_key or _env_path(settings.TLS_KEY)
    if not error and (tls_cert is None) != (tls_key is None):
        error = "--tls-cert and --tls-key go together"
    for path in (tls_cert, tls_key):
        if not error and path is not None and not path.is_file():
            error = f"TLS file {path} not found"
    for flag, value in (("--max-concurrent-rpcs", args.max_concurrent_rpcs),
                        ("--max-queued-bytes", args.max_queued_bytes)):
        if not error and value is not None and value < 1:
            error = f"{flag} {value} must be >= 1"
    if error:
        print(f"traceml-aggregator: error: {error}", file=sys.stderr)
        return 2
    token = args.run_token or settings.env_str(settings.RUN_TOKEN)
    if not token:
        token = transport.new_token()
        token_file = args.run_dir / transport.TOKEN_FILE_NAME
        try:
            args.run_dir.mkdir(parents=True, exist_ok=True)
            transport.write_token_file(token_file, token)
        except OSError as exc:
            print(f"traceml-aggregator: error: cannot write {token_file}: {exc}", file=sys.stderr)
            return 2
        print(
            f"traceml-aggregator: run token written to {token_file} (mode 0600); give it to "
            f"the ranks: export {settings.RUN_TOKEN.name}=$(cat {token_file})",
            file=sys.stderr,
            flush=True,
        )
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
        run_token=token,
        tls_cert=tls_cert,
        tls_key=tls_key,
        max_concurrent_rpcs=args.max_concurrent_rpcs or MAX_CONCURRENT_RPCS,
        max_queued_bytes=args.max_queued_bytes or MAX_QUEUED_BYTES,
    )

    def ready(port: int) -> None:
        print(
            f"traceml-aggregator: serving run {args.run_name!r} on "
            f"{args.bind_host}:{port}{' (TLS)' if tls_cert else ''}, store {args.run_dir}",
            file=sys.stderr,
            flush=True,
        )

    try:
        return asyncio.run(serve(config, ready))
    except BindError as exc:
        print(f"traceml-aggregator: error: {exc}", file=sys.stderr)
        return 2


def _env_path(setting: settings.Setting) -> Path | None:
    value = settings.env_str(setting)
    return Path(value) if value else None


if __name__ == "__main__":
    sys.exit(main())
