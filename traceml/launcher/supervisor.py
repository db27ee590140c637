"""Node 0's aggregator process, supervised: started, waited for, restarted, stopped.

:class:`AggregatorSupervisor` owns the process and its health, the run manifest's
``aggregator`` field, whose ``status`` moves through :data:`~traceml.launcher.states.
AGGREGATOR_TRANSITIONS`. Once training has started, nothing here changes the training's
outcome: an aggregator that does not serve, or dies for good, is a warning and a manifest
event, and the summary is then written from the store (:mod:`traceml.launcher.finalization`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from traceml.core import disk_reserve, log
from traceml.core.rundir import Manifest, RunDir
from traceml.launcher import aggregator
from traceml.launcher.config import LaunchConfig
from traceml.launcher.states import AGGREGATOR_TRANSITIONS, AggregatorStatus, Machine
from traceml.launcher.torchrun import exit_code

_log = log.get("launcher")


class AggregatorSupervisor:
    """Node 0's aggregator (see the module docstring).

    Args:
        config: the launch's flags.
        run_dir: the run directory (its store, its stderr log).
    """

    def __init__(self, config: LaunchConfig, run_dir: RunDir) -> None:
        self.config = config
        self.run_dir = run_dir
        self.process = None
        self._status = Machine("aggregator", AGGREGATOR_TRANSITIONS, AggregatorStatus.NOT_STARTED)
        #: As the run manifest records it; ``restarts`` lists each replacement:
        #: ``{"reason", "gap_s"}`` (s from the death seen to serving again).
        self.health = {
            "status": AggregatorStatus.NOT_STARTED.value,
            "reason": None,
            "pid": None,
            "exit_code": None,
            "restarts": [],
        }
        #: True once it served (there is a store to summarize).
        self.served = False
        #: When the run lost it for good (:meth:`lost`; Unix s: the death that ended the
        #: telemetry), None while it was not: the summary written from the store says so.
        self.lost_unix_s: float | None = None
        #: Called with the reason once the run has lost it for good (:meth:`lost`): node 0's
        #: relay then tells its senders to stop (:meth:`NodeRelay.upstream_gone
        #: <traceml.launcher.relay.NodeRelay.upstream_gone>`); None: nobody to tell.
        self.on_lost: Callable[[str], None] | None = None

    @property
    def status(self) -> AggregatorStatus:
        return self._status.state

    def _move(self, status: AggregatorStatus, **fields) -> None:
        self._status.to(status)
        self.health.update(status=status.value, **fields)

    def exited(self) -> bool:
        """True once the process has exited."""
        return self.process.poll() is not None

    def start(self) -> None:
        """Start the process; :meth:`wait_serving` waits for it."""
        self.process = aggregator.start(self.config, self.run_dir)
        self._move(AggregatorStatus.STARTING, pid=self.process.pid)

    def wait_serving(self, manifest: Manifest) -> None:
        """Wait (at most ``TRACEML_AGGREGATOR_START_SEC``) until it serves. Training has
        already started: one that never serves is stopped, recorded and reported, and the run
        goes on without telemetry."""
        if not self._wait(self.config.aggregator_start_sec):
            self.stop()
            self.lost(manifest, f"did not serve ({self.health['reason']})", time.time())
            return
        self._move(AggregatorStatus.SERVING)
        self.served = True
        manifest.event("aggregator_serving", aggregator=self.health)

    def _wait(self, timeout_s: float) -> bool:
        """True once it serves within ``timeout_s``; else False, the reason in the health."""
        try:
            aggregator.wait_serving(self.config.launcher_target, timeout_s, self.process)
        except Exception as exc:  # fail-open: AggregatorUnavailable, or gRPC failing to load
            self.health["reason"] = str(exc)
            return False
        return True

    def watch(self, manifest: Manifest) -> None:
        """Restart it on the run's store when its process has exited while serving, up to
        ``--aggregator-max-restarts`` times (the ranks and samplers resend what it had not
        acknowledged); past that, record and report (once) that it is lost. Its exit code is
        a shell's (137: killed by SIGKILL)."""
        returncode = self.process.poll()
        if returncode is None or self.status is not AggregatorStatus.SERVING:
            return
        down_since = time.time()
        disk_reserve.release(self.run_dir.disk_reserve)  # room for its replacement's store
        code = exit_code(returncode)
        self.health["exit_code"] = code
        reason = f"exited with code {code} during the run"
        while len(self.health["restarts"]) < self.config.aggregator_max_restarts:
            if self._restart(manifest, reason, down_since):
                return
            reason = self.health["reason"]
        self.lost(manifest, reason, down_since)

    def _restart(self, manifest: Manifest, reason: str, down_since: float) -> bool:
        """Start a replacement on the same store; True once it serves."""
        config = self.config
        restarts = self.health["restarts"]
        self.process = aggregator.start(
            config, self.run_dir, restart_reason=reason, down_since_unix_s=down_since
        )
        restarts.append({"reason": reason, "gap_s": None})
        self._move(AggregatorStatus.STARTING, pid=self.process.pid, exit_code=None)
        if not self._wait(config.aggregator_start_sec):
            self.halt(2.0)
            reason = f"restart did not serve ({self.health['reason']})"
            self._move(AggregatorStatus.FAILED, reason=reason)
            return False
        gap_s = round(time.time() - down_since, 3)
        restarts[-1]["gap_s"] = gap_s
        self._move(AggregatorStatus.SERVING, reason=None)
        manifest.event("aggregator_restarted", aggregator=self.health)
        _log.warning(
            f"warning: the aggregator {reason}; restarted it on the run's store after "
            f"{gap_s:.1f} s (restart {len(restarts)} of {config.aggregator_max_restarts}, "
            f"--aggregator-max-restarts); the ranks resend what it had not stored"
        )
        return True

    def lost(self, manifest: Manifest, reason: str, since_unix_s: float) -> None:
        """It is not serving (``reason``) since ``since_unix_s`` (Unix s) and will not be
        restarted: record it and warn; training goes on, and the summary is written from the
        store at the end (saying that it covers only what was stored until then)."""
        self.lost_unix_s = since_unix_s
        self._move(AggregatorStatus.FAILED, reason=reason)
        manifest.event("aggregator_failed", aggregator=self.health)
        _log.warning(
            f"warning: the aggregator {reason}; training continues without telemetry; the "
            f"summary will hold what was stored until now (see {self.run_dir.aggregator_stderr})"
        )
        if self.on_lost is not None:
            self.on_lost(reason)

    def fail(self, reason: str, silent_since_unix_s: float | None = None) -> None:
        """It serves but could not write the summary (``reason``); with
        ``silent_since_unix_s`` (Unix s), it gave no answer at all since then: lost then, as
        :meth:`lost` records it (the summary written from the store says what it lacks)."""
        if silent_since_unix_s is not None:
            self.lost_unix_s = silent_since_unix_s
        self._move(AggregatorStatus.FAILED, reason=reason)

    def halt(self, timeout_s: float) -> None:
        """Close its pipe (it drains and stops), SIGKILL it after ``timeout_s``; its exit code
        goes into the health fields, and the disk room it held is given back (one it killed
        could not: :mod:`traceml.core.disk_reserve`)."""
        self.health["exit_code"] = exit_code(aggregator.stop(self.process, timeout_s))
        disk_reserve.release(self.run_dir.disk_reserve)

    def stop(self, timeout_s: float = 10.0) -> None:
        """:meth:`halt`; one that served is ``stopped``."""
        self.halt(timeout_s)
        if self.status is AggregatorStatus.SERVING:
            self._move(AggregatorStatus.STOPPED)

    def abandon(self) -> None:
        """A second signal: :meth:`halt` within 2 s, whatever its state (no summary)."""
        self.halt(2.0)
        self._move(AggregatorStatus.STOPPED)
