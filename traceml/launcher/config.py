"""Launch parameters of ``traceml run`` and their validation (before anything starts)."""

from __future__ import annotations

import secrets
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from traceml import settings
from traceml.core import endpoint, otlp, transport
from traceml.core.rundir import validate_run_name

MODES = ("summary", "cli", "dashboard")


class LaunchError(ValueError):
    """Bad input to ``traceml run``: reported as one line, exit code 2, nothing started."""


def generated_run_name() -> str:
    """A fresh run name for single-node runs: ``run-YYYYmmdd-HHMMSS-xxxx``."""
    return time.strftime("run-%Y%m%d-%H%M%S-") + secrets.token_hex(2)


@dataclass
class LaunchConfig:
    """Everything ``traceml run`` was asked to do (the flags, after defaults).

    ``aggregator_host`` and ``aggregator_bind_host`` are None until :meth:`resolve` fills
    their defaults (``master_addr``; 127.0.0.1 on one node, 0.0.0.0 on several). A field
    named after a knob of :mod:`traceml.settings` (:data:`KNOBS`) is that knob: :meth:`resolve`
    fills it from its flag, else its ``TRACEML_*`` variable, else its declared default.
    """

    script: str
    script_args: list[str] = field(default_factory=list)
    nproc_per_node: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    #: None until resolve(): MASTER_PORT's default on several nodes; on one node, torchrun
    #: picks a free port.
    master_port: int | None = None
    run_name: str | None = None
    aggregator_host: str | None = None
    aggregator_port: int = settings.AGGREGATOR_PORT.value
    aggregator_bind_host: str | None = None
    mode: str = "summary"
    dashboard_port: int = settings.DASHBOARD_PORT.value
    logs_dir: Path = Path("logs")
    html_report: bool = settings.HTML_REPORT.value
    # The knobs with a TRACEML_* variable are None until resolve() (durations in s).
    finalize_timeout_sec: float | None = None
    hang_timeout_sec: float | None = None
    aggregator_wait_sec: float | None = None
    aggregator_start_sec: float | None = None
    rendezvous_warn_sec: float | None = None
    max_restarts: int = settings.MAX_RESTARTS.value
    aggregator_max_restarts: int | None = None
    save_training_output: bool | None = None
    #: ``--node-relay``: this node's ranks and sampler stream through its launcher's relay.
    node_relay: bool | None = None
    #: ``--keep-all-steps``: node 0's store keeps every step and sample row (no retention).
    keep_all_steps: bool = settings.KEEP_ALL_STEPS.value
    #: Zero-code steps: ranks start as ``python -m traceml.sdk.autorun SCRIPT``.
    auto_instrument: bool | None = None
    #: The run token (None after resolve(): node 0 makes one, the others read node 0's token
    #: file). Never in the manifest, never on a command line.
    run_token: str | None = field(default=None, repr=False)
    #: Node 0: the aggregator's TLS certificate and key, PEM.
    tls_cert: Path | None = None
    tls_key: Path | None = None
    #: The CA certificate clients check the aggregator's against (node 0 defaults it to its
    #: own, self-signed, ``tls_cert``).
    tls_ca: Path | None = None
    #: Peak TFLOPS of one rank's device for MFU (None: the GPU table, no MFU on CPU).
    peak_tflops: float | None = None
    #: Node 0: its aggregator serves Prometheus ``/metrics`` on this port (None: off) of
    #: ``metrics_bind_host``.
    metrics_port: int | None = settings.METRICS_PORT.value
    metrics_bind_host: str = settings.METRICS_BIND_HOST.value
    #: Node 0: its aggregator pushes the same series to this OTLP/gRPC collector (None: only
    #: when a standard ``OTEL_EXPORTER_OTLP_*ENDPOINT`` variable is set).
    otlp_endpoint: str | None = settings.OTLP_ENDPOINT.value

    @property
    def world_size(self) -> int:
        """Ranks in the job: nnodes × nproc_per_node."""
        return self.nnodes * self.nproc_per_node

    @property
    def owns_aggregator(self) -> bool:
        """Node 0 starts and finalizes the aggregator."""
        return self.node_rank == 0

    @property
    def run_dir(self) -> Path:
        """``<logs-dir>/<run-name>``."""
        return self.logs_dir / str(self.run_name)

    @property
    def aggregator_target(self) -> str:
        """``host:port`` the ranks and launchers connect to."""
        return endpoint.target(self.aggregator_host or self.master_addr, self.aggregator_port)

    @property
    def launcher_target(self) -> str:
        """``host:port`` this node's launcher calls: node 0 reaches its own aggregator locally
        (it may not be reachable from itself through the public address), others the target."""
        if not self.owns_aggregator:
            return self.aggregator_target
        return endpoint.local_target(self.aggregator_bind_host or "127.0.0.1", self.aggregator_port)

    def resolve(self) -> LaunchConfig:
        """Validate and fill the defaults that depend on other flags.

        Raises:
            LaunchError: one of the flags is invalid (the message names it).
        """
        script = Path(self.script)
        if self.script.startswith("-"):
            raise LaunchError(
                f"unknown option {self.script!r} before the script (see `traceml run --help`; "
                "torchrun's underscore spellings are written with dashes here)"
            )
        if script.is_dir():
            raise LaunchError(f"training script {self.script!r} is a directory, not a file")
        if not script.is_file():
            raise LaunchError(f"training script {self.script!r} not found")
        if self.run_token is not None and not self.run_token.strip():
            raise LaunchError("--run-token must not be empty")
        try:
            settings.COUNT.check("--nproc-per-node", self.nproc_per_node)
            settings.COUNT.check("--nnodes", self.nnodes)
            for knob in KNOBS:
                setattr(self, knob.field, settings.resolve(knob, getattr(self, knob.field)))
            if self.owns_aggregator:  # its own variables: refused here, not in its log
                for knob in AGGREGATOR_VARIABLES:
                    settings.resolve(knob)
        except settings.KnobError as exc:
            raise LaunchError(str(exc)) from None
        if not 0 <= self.node_rank < self.nnodes:
            raise LaunchError(
                f"--node-rank {self.node_rank} must be in 0..{self.nnodes - 1} for --nnodes "
                f"{self.nnodes}"
            )
        if self.mode not in MODES:
            raise LaunchError(f"--mode must be one of {', '.join(MODES)} (got {self.mode!r})")
        if self.run_name is None:
            if self.nnodes > 1:
                raise LaunchError(
                    "--run-name is required with --nnodes > 1 (the same name on every node)"
                )
            self.run_name = generated_run_name()
        error = validate_run_name(self.run_name)
        if error:
            raise LaunchError(error)
        if self.owns_aggregator:
            try:
                otlp.check(self.otlp_endpoint)
            except ValueError as exc:
                raise LaunchError(str(exc)) from None
        if self.aggregator_bind_host is None:
            self.aggregator_bind_host = "0.0.0.0" if self.nnodes > 1 else "127.0.0.1"
        if self.aggregator_host is None:
            self.aggregator_host = self.master_addr
        if self.master_port is None and self.nnodes > 1:
            self.master_port = settings.MASTER_PORT.value
        if self.owns_aggregator and self.master_port == self.aggregator_port:
            raise LaunchError(
                f"--master-port and --aggregator-port are both {self.aggregator_port}: node 0 "
                "listens on each, so they must differ"
            )
        if (
            self.owns_aggregator
            and self.mode == "dashboard"
            and self.dashboard_port in (self.aggregator_port, self.master_port)
        ):
            raise LaunchError(
                f"--dashboard-port {self.dashboard_port} is also the aggregator's or the "
                "rendezvous port: node 0 listens on each, so they must differ"
            )
        if (
            self.owns_aggregator
            and self.metrics_port is not None
            and self.metrics_port
            in (
                self.aggregator_port,
                self.master_port,
                self.dashboard_port if self.mode == "dashboard" else None,
            )
        ):
            raise LaunchError(
                f"--metrics-port {self.metrics_port} is also the aggregator's, the rendezvous "
                "or the dashboard's port: node 0 listens on each, so they must differ"
            )
        self._resolve_credentials()
        return self

    def node0_notes(self) -> list[str]:
        """What this node says about the flags that act on node 0's aggregator only
        (``--metrics-port``, ``--otlp-endpoint``): on another node, that it leaves them to
        node 0; on node 0, that the OTLP export is off when its packages are missing. One
        line each, [] when there is nothing to say; call after :meth:`resolve`."""
        if not self.owns_aggregator:
            given = [
                f"{knob.flag} {getattr(self, knob.field)}"
                for knob in (settings.METRICS_PORT, settings.OTLP_ENDPOINT)
                if getattr(self, knob.field) is not None
            ]
            if not given:
                return []
            return [
                f"note: {' and '.join(given)} act on node 0's aggregator only; node "
                f"{self.node_rank} leaves them to node 0"
            ]
        if otlp.requested(self.otlp_endpoint):
            missing = otlp.missing()
            return [missing] if missing else []
        return []

    @property
    def dashboard_url(self) -> str:
        """``--mode dashboard``: the page's URL on node 0, without the run token (the link
        with it is node 0's ``RUN_DIR/dashboard_link``, mode 0600); https when the run uses TLS
        (node 0's ``--tls-cert``, another node's ``--tls-ca``)."""
        host = (
            self.aggregator_bind_host
            if self.owns_aggregator
            else (self.aggregator_host or self.master_addr)
        )
        tls = (self.tls_cert if self.owns_aggregator else self.tls_ca) is not None
        return endpoint.dashboard_url(str(host), self.dashboard_port, tls)

    def _resolve_credentials(self) -> None:
        """The TLS files from their flags, else their variables; checked here.

        Raises:
            LaunchError: a certificate without its key, a missing file.
        """
        try:
            tls = transport.TlsFiles.resolve(
                self.tls_cert,
                self.tls_key,
                self.tls_ca,
                serves=self.owns_aggregator,
                reads_ca=True,
            )
        except transport.TlsFilesError as exc:
            raise LaunchError(str(exc)) from None
        self.tls_cert, self.tls_key, self.tls_ca = tls.cert, tls.key, tls.ca

    def to_manifest(self) -> dict:
        """The launch parameters as JSON-ready values."""
        data = asdict(self)
        del data["run_token"]  # a secret: the manifest may be shared
        data["logs_dir"] = str(self.logs_dir)
        for name in ("tls_cert", "tls_key", "tls_ca"):
            data[name] = None if data[name] is None else str(data[name])
        data["world_size"] = self.world_size
        return data


#: The knobs that are fields of :class:`LaunchConfig` (each named by :attr:`Setting.field`).
KNOBS: tuple[settings.Setting, ...] = tuple(
    knob
    for knob in settings.ALL
    if "launcher" in knob.readers and knob.field in {f.name for f in fields(LaunchConfig)}
)
#: The variables node 0's aggregator reads that the launcher does not pass on as flags: node
#: 0's launcher refuses a bad one before anything starts, as it refuses its own (the
#: aggregator would fall back to the default, saying so only in its log).
AGGREGATOR_VARIABLES: tuple[settings.Setting, ...] = tuple(
    knob
    for knob in settings.ALL
    if "aggregator" in knob.readers and knob.name and knob not in KNOBS and not knob.passed_as
)
