"""``traceml run``: one node's whole launch, from validated flags to torchrun's exit code.

Node 0::

    check port -> run dir -> aggregator (wait SERVING) -> node sampler -> torchrun -> wait
    -> report node exit -> Finalize (bounded) -> print summary -> stop aggregator -> exit code

Node r > 0::

    run dir -> wait for node 0's aggregator (bounded) -> node sampler -> torchrun -> wait
    -> report node exit -> exit code

The exit code is torchrun's, always. Once training has started, a telemetry failure is a
warning on stderr and a field in the manifest, never a different exit code.
"""

from __future__ import annotations

import errno
import socket
import sys

import grpc

from traceml import __version__, settings
from traceml.launcher import aggregator
from traceml.launcher.config import LaunchConfig, LaunchError
from traceml.launcher.rundir import Manifest, RunDir
from traceml.launcher.torchrun import TorchrunProcess, exit_code, install_signal_forwarding


def say(message: str) -> None:
    """One ``traceml:`` line on stderr."""
    print(f"traceml: {message}", file=sys.stderr, flush=True)


def check_port_free(host: str, port: int) -> None:
    """Raise :class:`LaunchError` when ``host:port`` cannot be bound right now."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError as exc:
            why = "already in use" if exc.errno == errno.EADDRINUSE else exc.strerror
            raise LaunchError(
                f"aggregator port {host}:{port} is not available ({why}); "
                "pick another with --aggregator-port"
            ) from None


def preflight(config: LaunchConfig) -> None:
    """Checks that need the outside world, before anything starts (raises LaunchError)."""
    if config.owns_aggregator:
        if (config.run_dir / "telemetry.sqlite").exists():
            raise LaunchError(
                f"{config.run_dir} already holds a run's telemetry; use another --run-name"
            )
        check_port_free(config.aggregator_bind_host, config.aggregator_port)


class Launch:
    """One node's launch (see the module docstring)."""

    def __init__(self, config: LaunchConfig) -> None:
        self.config = config
        self.run_dir = RunDir(config.run_dir, config.node_rank)
        self.aggregator_process = None
        self.health = {"status": "not_started", "reason": None, "pid": None, "exit_code": None}
        self.sampler = None

    def run(self) -> int:
        """Launch, wait, finish; returns the exit code for the launcher."""
        config, run_dir = self.config, self.run_dir
        owner = config.owns_aggregator
        run_dir.create(owner=owner)
        node_manifest = Manifest(
            run_dir.node_manifest,
            {
                "traceml_version": __version__,
                "node_rank": config.node_rank,
                "hostname": socket.gethostname(),
                "launch": config.to_manifest(),
                "status": "starting",
                "artifacts": {
                    "training_stdout": str(run_dir.training_stdout),
                    "training_stderr": str(run_dir.training_stderr),
                },
            },
        )
        node_manifest.event("started")
        run_manifest = None
        if owner:
            run_manifest = Manifest(
                run_dir.run_manifest,
                {
                    "traceml_version": __version__,
                    "run_name": config.run_name,
                    "launch": config.to_manifest(),
                    "status": "starting",
                    "aggregator": self.health,
                    "artifacts": {
                        "database": str(run_dir.database),
                        "aggregator_stderr": str(run_dir.aggregator_stderr),
                        "nodes": str(run_dir.root / "nodes"),
                    },
                },
            )
            run_manifest.event("started")
            if not self._start_aggregator(run_manifest):
                node_manifest.event("ended", status="aggregator_failed")
                return 1
        elif not self._wait_for_owner():
            node_manifest.event("ended", status="aggregator_unreachable")
            return 1

        self._start_sampler()
        torchrun = TorchrunProcess(config, run_dir)
        torchrun.start()
        install_signal_forwarding(torchrun)
        node_manifest.event("training_started", status="training", torchrun_pid=torchrun.process.pid)
        if run_manifest:
            run_manifest.event("training_started", status="training")
        returncode = torchrun.wait()
        code = exit_code(returncode)
        self._stop_sampler()
        report = torchrun.node_exit(returncode)
        node_manifest.event(
            "training_ended",
            status="finalizing" if owner else "reporting",
            torchrun_exit_code=code,
            ranks=[_rank_end_json(r) for r in report.ranks],
        )
        telemetry_ok = self._report_node_exit(report)
        if owner:
            self._finalize(run_manifest)
            self.health["exit_code"] = aggregator.stop(self.aggregator_process)
            if self.health["status"] == "serving":
                self.health["status"] = "stopped"
            run_manifest.event(
                "ended", status="completed" if code == 0 else "failed", exit_code=code
            )
        node_manifest.event(
            "ended",
            status="completed" if code == 0 else "failed",
            exit_code=code,
            telemetry_reported=telemetry_ok,
        )
        return code

    # --- steps -------------------------------------------------------------------------------
    def _start_aggregator(self, manifest: Manifest) -> bool:
        config = self.config
        self.aggregator_process = aggregator.start(config, self.run_dir)
        self.health.update(status="starting", pid=self.aggregator_process.pid)
        try:
            aggregator.wait_serving(
                config.launcher_target,
                settings.env_float(settings.AGGREGATOR_START_SEC),
                self.aggregator_process,
            )
        except aggregator.AggregatorUnavailable as exc:
            self.health.update(status="failed", reason=str(exc))
            self.health["exit_code"] = aggregator.stop(self.aggregator_process)
            manifest.event("ended", status="aggregator_failed", aggregator=self.health)
            say(f"error: {exc}; see {self.run_dir.aggregator_stderr}")
            return False
        self.health.update(status="serving")
        manifest.event("aggregator_serving", aggregator=self.health)
        return True

    def _wait_for_owner(self) -> bool:
        wait_s = settings.env_float(settings.AGGREGATOR_WAIT_SEC)
        target = self.config.aggregator_target
        say(f"node {self.config.node_rank}: waiting up to {wait_s:g} s for node 0's aggregator at {target}")
        try:
            aggregator.wait_serving(target, wait_s)
        except aggregator.AggregatorUnavailable as exc:
            say(
                f"error: {exc} (is node 0 running `traceml run` with the same --run-name, "
                f"and is port {self.config.aggregator_port} reachable? raise the wait with "
                f"{settings.AGGREGATOR_WAIT_SEC.name})"
            )
            return False
        return True

    def _start_sampler(self) -> None:
        """Start this node's system/process sampler (a no-op until samplers exist)."""
        try:
            from traceml.sdk.samplers import start_node_sampler
        except ImportError:
            return
        try:
            self.sampler = start_node_sampler(self.config)
        except Exception as exc:
            say(f"warning: node sampler not started ({exc})")

    def _stop_sampler(self) -> None:
        if self.sampler is not None:
            try:
                self.sampler.close()
            except Exception as exc:
                say(f"warning: node sampler did not stop cleanly ({exc})")

    def _report_node_exit(self, report) -> bool:
        try:
            aggregator.report_node_exit(self.config.launcher_target, report)
            return True
        except grpc.RpcError as exc:
            say(f"warning: could not report this node's exit to the aggregator ({exc.code().name})")
            return False

    def _finalize(self, manifest: Manifest) -> None:
        config = self.config
        try:
            reply = aggregator.finalize(
                config.launcher_target, str(config.run_name), config.finalize_timeout_sec
            )
        except grpc.RpcError as exc:
            self.health.update(status="failed", reason=f"finalize failed: {exc.code().name}")
            manifest.update(aggregator=self.health)
            say(f"warning: no final summary: the aggregator failed ({exc.code().name})")
            return
        if reply.error:
            self.health.update(status="failed", reason=reply.error)
            say(f"warning: no final summary: {reply.error}")
        else:
            sys.stdout.write(reply.summary_text)
            sys.stdout.flush()
            if reply.missing_ranks:
                say(f"partial summary: ranks {list(reply.missing_ranks)} never finished")
            say(f"summary: {reply.summary_json_path}")
        artifacts = dict(manifest.data["artifacts"])
        for key, path in (
            ("final_summary_json", reply.summary_json_path),
            ("final_summary_txt", reply.summary_text_path),
            ("final_summary_html", reply.summary_html_path),
        ):
            if path:
                artifacts[key] = path
        manifest.event(
            "finalized",
            status="finalized",
            aggregator=self.health,
            artifacts=artifacts,
            complete=reply.complete,
            missing_ranks=list(reply.missing_ranks),
        )


def _rank_end_json(end) -> dict:
    from traceml import wire

    return {
        "rank": end.rank,
        "local_rank": end.local_rank,
        "end_state": wire.end_state_name(end.end_state),
        "exit_code": end.exit_code if end.HasField("exit_code") else None,
        "signal": end.signal if end.HasField("signal") else None,
        "reason": end.reason or None,
    }
