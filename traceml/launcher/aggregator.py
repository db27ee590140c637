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
from traceml.core import endpoint
from traceml.core.rundir import RunDir
from traceml.launcher.config import LaunchConfig


class AggregatorUnavailable(RuntimeError):
    """The aggregator did not answer its health check within the allowed time."""


def start(
    config: LaunchConfig,
    run_dir: RunDir,
    *,
    restart_reason: str = "",
    down_since_unix_s: float = 0.0,
) -> subprocess.Popen:
    """Start ``traceml-aggregator --owned`` for this run in its own session (node 0 only).

    The launcher owns its lifetime: its standard input is a pipe from the launcher, and it
    stops when that pipe closes (:func:`stop`, or the launcher dying in any way); SIGTERM and
    SIGINT (an scancel signals every process of the job) leave it serving until then. Its
    stdout and stderr go to ``aggregator/process.stderr.log``. ``restart_reason`` (with the
    Unix time the run lost its aggregator) starts a replacement on the same store.
    """
    argv = aggregator_argv(config, run_dir) + ["--owned", "--no-summary-at-stop"]
    if restart_reason:
        argv += [
            "--restart-reason",
            restart_reason,
            "--down-since-unix-s",
            f"{down_since_unix_s:.3f}",
        ]
    log = open(run_dir.aggregator_stderr, "ab")
    try:
        return subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=log,
            stderr=log,
            start_new_session=True,
            env={**os.environ, settings.RUN_TOKEN.name: config.run_token},
        )
    finally:
        log.close()


def aggregator_argv(config: LaunchConfig, run_dir: RunDir) -> list[str]:
    """``python -m traceml_aggregator`` with this run's store, name, bind address, sizes and
    rendezvous port (several nodes), and the value of every knob the launcher passes on
    (:attr:`Setting.passed_as`: a boolean as its bare flag when on, a value unless it is
    None)."""
    argv = [sys.executable, "-m", "traceml_aggregator"]
    for flag, value in (
        ("--run-dir", run_dir.root),
        ("--run-name", config.run_name),
        ("--bind-host", config.aggregator_bind_host),
        ("--world-size", config.world_size),
        ("--nnodes", config.nnodes),
        ("--master-port", config.master_port),
    ):
        if value is not None:
            argv += [flag, str(value)]
    for knob in settings.ALL:
        value = getattr(config, knob.field) if knob.passed_as else None
        if value is True:
            argv.append(knob.passed_as)
        elif value is not None and value is not False:
            argv += [knob.passed_as, str(value)]
    if config.mode == "dashboard":
        argv += [settings.DASHBOARD_PORT.flag, str(config.dashboard_port)]
    return argv


def finalize_offline(
    config: LaunchConfig,
    run_dir: RunDir,
    node_exit_file,
    timeout_s: float,
    *,
    lost_reason: str = "",
    lost_unix_s: float | None = None,
) -> int:
    """Write the summary from the store with ``traceml-aggregator --finalize-only`` (the run's
    aggregator is dead and may not be restarted); its exit code (0: written). ``lost_reason``
    (with when it was lost, Unix s) says why the run lost its aggregator: the summary records
    it and warns that telemetry sent after it was not received.

    Raises:
        subprocess.TimeoutExpired: it ran longer than ``timeout_s`` (it is killed first).
    """
    argv = aggregator_argv(config, run_dir) + [
        "--finalize-only",
        "--node-exit-file",
        str(node_exit_file),
    ]
    if lost_reason:
        argv += ["--lost-reason", lost_reason]
        if lost_unix_s is not None:
            argv += ["--lost-unix-s", f"{lost_unix_s:.3f}"]
    with open(run_dir.aggregator_stderr, "ab") as log:
        return subprocess.run(
            argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, timeout=timeout_s
        ).returncode


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


def summarize(target: str, run_name: str, timeout_s: float):
    """The verdict so far with one row per rank (a SummarizeReply with ``ranks``), for the
    live views. Raises grpc.RpcError."""
    from traceml import wire

    request = wire.SummarizeRequest(run_name=run_name, with_ranks=True)
    return endpoint.call(target, "Summarize", request, timeout_s)


def stop(process: subprocess.Popen, timeout_s: float = 10.0) -> int:
    """Close the aggregator's pipe (it drains and stops), SIGKILL it after ``timeout_s``;
    its exit code."""
    if process.stdin is not None and not process.stdin.closed:
        try:
            process.stdin.close()
        except OSError:  # it died first: the pipe is broken
            pass
    try:
        process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait()
    return process.returncode
