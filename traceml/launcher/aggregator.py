"""The launcher's side of the aggregator: start it (node 0), wait for it, call it.

Readiness is the standard gRPC health check (``grpc.health.v1.Health/Check`` == SERVING),
never a bare TCP connect. Every channel carries the run token and, when set, TLS
(:func:`traceml.core.transport.open_channel`, from this process's environment, which the
launcher sets: see :mod:`traceml.launcher.credentials`). The aggregator gets the token through
its environment, never its command line (``ps`` shows that to every user).

gRPC and the wire code are imported by the calls that use them: starting the aggregator and
torchrun does not wait for their 0.2 s of imports.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from traceml import settings
from traceml.launcher.config import LaunchConfig
from traceml.core.rundir import RunDir


class AggregatorUnavailable(RuntimeError):
    """The aggregator did not answer its health check within the allowed time."""


def start(config: LaunchConfig, run_dir: RunDir) -> subprocess.Popen:
    """Start ``traceml-aggregator`` for this run in its own process group (node 0 only).

    Its stdout and stderr go to ``aggregator/process.stderr.log``.
    """
    argv = [
        sys.executable,
        "-m",
        "traceml_aggregator",
        "--run-dir",
        str(run_dir.root),
        "--run-name",
        str(config.run_name),
        "--port",
        str(config.aggregator_port),
        "--bind-host",
        str(config.aggregator_bind_host),
        "--world-size",
        str(config.world_size),
        "--nnodes",
        str(config.nnodes),
        "--finalize-timeout-sec",
        str(config.finalize_timeout_sec),
        "--no-summary-at-stop",  # this launcher asks for the summary (Finalize) itself
    ]
    if config.html_report:
        argv.append("--html-report")
    if config.tls_cert:
        argv += ["--tls-cert", str(config.tls_cert), "--tls-key", str(config.tls_key)]
    log = open(run_dir.aggregator_stderr, "ab")
    try:
        return subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            start_new_session=True,
            env={**os.environ, settings.RUN_TOKEN.name: config.run_token},
        )
    finally:
        log.close()


def wait_serving(target: str, timeout_s: float, process: subprocess.Popen | None = None) -> None:
    """Poll the health service at ``target`` until SERVING.

    Raises:
        AggregatorUnavailable: not SERVING within ``timeout_s``, or ``process`` exited.
    """
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from traceml.core.transport import open_channel

    deadline = time.monotonic() + timeout_s
    # After a refused connection gRPC waits its reconnect backoff (1 s, then 1.6 s, ...) before
    # trying again, and every Check meanwhile fails at once: without short backoffs, an
    # aggregator that starts in 0.9 s would be seen serving at 1 s or 2.6 s.
    options = [
        ("grpc.initial_reconnect_backoff_ms", 50),
        ("grpc.min_reconnect_backoff_ms", 50),
        ("grpc.max_reconnect_backoff_ms", 100),
    ]
    with open_channel(target, options) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            if process is not None and process.poll() is not None:
                raise AggregatorUnavailable(
                    f"aggregator exited with code {process.returncode} before serving"
                )
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() >= deadline:
                raise AggregatorUnavailable(
                    f"no TraceML aggregator serving at {target} after {timeout_s:g} s"
                )
            time.sleep(0.05)


def _call(target: str, method: str, request, timeout_s: float):
    """One unary RPC ``method`` of the aggregator at ``target``, on a channel of its own.

    Raises:
        grpc.RpcError: the call failed or timed out.
    """
    from traceml import wire
    from traceml.core.transport import open_channel

    with open_channel(target) as channel:
        return getattr(wire.AggregatorStub(channel), method)(request, timeout=timeout_s)


def report_node_exit(target: str, report, timeout_s: float = 10.0) -> None:
    """Send this node's NodeExit. Raises grpc.RpcError on failure."""
    _call(target, "ReportNodeExit", report, timeout_s)


def register_node(target: str, claim, timeout_s: float = 10.0):
    """Send this node's NodeClaim; returns the NodeClaimReply. Raises grpc.RpcError."""
    return _call(target, "RegisterNode", claim, timeout_s)


def summarize(target: str, run_name: str, timeout_s: float):
    """The verdict so far (a SummarizeReply), for the live views. Raises grpc.RpcError."""
    from traceml import wire

    return _call(target, "Summarize", wire.SummarizeRequest(run_name=run_name), timeout_s)


def finalize(target: str, run_name: str, budget_s: float):
    """Ask for the final summary; returns the FinalizeReply. Raises grpc.RpcError."""
    from traceml import wire

    request = wire.FinalizeRequest(run_name=run_name, timeout_s=budget_s)
    return _call(target, "Finalize", request, budget_s + 30.0)


def stop(process: subprocess.Popen, timeout_s: float = 10.0) -> int:
    """SIGTERM the aggregator, SIGKILL it after ``timeout_s``; its exit code."""
    if process.poll() is None:
        try:
            os.killpg(process.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    return process.returncode
