"""Launch parameters of ``traceml run`` and their validation (before anything starts)."""

from __future__ import annotations

import secrets
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from traceml import settings
from traceml.core import endpoint, transport
from traceml.core.peaks import peak_tflops_error
from traceml.core.rundir import validate_run_name

MODES = ("summary", "cli", "dashboard")


class LaunchError(ValueError):
    """Bad input to ``traceml run``: reported as one line, exit code 2, nothing started."""


def generated_run_name() -> str:
    """A fresh run name for single-node runs: ``run-YYYYmmdd-HHMMSS-xxxx``."""
    return time.strftime("run-%Y%m%d-%H%M%S-") + secrets.token_hex(2)


def _seconds(value: float | None, setting: settings.Setting, flag: str = "") -> float:
    """A duration (s): ``value`` (from ``flag``) when given, else ``setting`` from the environment.

    Raises:
        LaunchError: the value is not a finite number > 0 (the message names its source).
    """
    if value is None:
        try:
            return settings.env_float(setting, strict=True)
        except ValueError as exc:
            raise LaunchError(str(exc)) from None
    error = endpoint.seconds_error(flag, value)
    if error:
        raise LaunchError(error)
    return value


@dataclass
class LaunchConfig:
    """Everything ``traceml run`` was asked to do (the flags, after defaults).

    ``aggregator_host`` and ``aggregator_bind_host`` are None until :meth:`resolve` fills
    their defaults (``master_addr``; 127.0.0.1 on one node, 0.0.0.0 on several); so are the
    durations (seconds), which come from their flag, else their ``TRACEML_*`` variable, else
    the default in :mod:`traceml.settings`.
    """

    script: str
    script_args: list[str] = field(default_factory=list)
    nproc_per_node: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    #: None: 29500 on several nodes; on one node torchrun picks a free port.
    master_port: int | None = None
    run_name: str | None = None
    aggregator_host: str | None = None
    aggregator_port: int = endpoint.DEFAULT_PORT
    aggregator_bind_host: str | None = None
    mode: str = "summary"
    #: Node 0, ``--mode dashboard``: the page's HTTP port, on ``aggregator_bind_host``.
    dashboard_port: int = endpoint.DASHBOARD_PORT
    logs_dir: Path = Path("logs")
    html_report: bool = False
    #: Budget of node 0's finalization, s (``--finalize-timeout-sec``, wins over the env).
    finalize_timeout_sec: float | None = None
    #: A live rank without a completed step this long is hung, s (``--hang-timeout-sec``).
    hang_timeout_sec: float | None = None
    #: How long node r > 0 waits for node 0's aggregator, s (env only).
    aggregator_wait_sec: float | None = None
    #: How long node 0 waits for its own aggregator to serve, s (env only).
    aggregator_start_sec: float | None = None
    max_restarts: int = 0
    #: Times node 0 restarts an aggregator that died during the run
    #: (``--aggregator-max-restarts``, else ``TRACEML_AGGREGATOR_MAX_RESTARTS``, else 3).
    aggregator_max_restarts: int | None = None
    #: Also write torchrun's output to ``nodes/node_<r>/training.*.log``
    #: (``--[no-]save-training-output``, else ``TRACEML_SAVE_TRAINING_OUTPUT``, else on).
    save_training_output: bool | None = None
    #: Zero-code steps: ranks start as ``python -m traceml.sdk.autorun SCRIPT`` (see
    #: ``--no-auto-instrument``; None until :meth:`resolve`: ``TRACEML_AUTO_INSTRUMENT``).
    auto_instrument: bool | None = None
    torchrun_args: list[str] = field(default_factory=list)
    #: The run token (``--run-token``, else ``TRACEML_RUN_TOKEN``; None: node 0 makes one,
    #: the others read node 0's token file). Never in the manifest, never on a command line.
    run_token: str | None = field(default=None, repr=False)
    #: Node 0: the aggregator's TLS certificate and key, PEM (``--tls-cert``/``--tls-key``,
    #: else ``TRACEML_TLS_CERT``/``TRACEML_TLS_KEY``).
    tls_cert: Path | None = None
    tls_key: Path | None = None
    #: The CA certificate clients check the aggregator's against (``--tls-ca``, else
    #: ``TRACEML_TLS_CA``; node 0 defaults it to its own, self-signed, ``--tls-cert``).
    tls_ca: Path | None = None
    #: Peak TFLOPS of one rank's device for MFU (``--peak-tflops``, else
    #: ``TRACEML_PEAK_TFLOPS``; None: the GPU table, no MFU on CPU).
    peak_tflops: float | None = None

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

    def resolve(self) -> "LaunchConfig":
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
        for name, value in (("--nproc-per-node", self.nproc_per_node), ("--nnodes", self.nnodes)):
            if value < 1:
                raise LaunchError(f"{name} must be >= 1 (got {value})")
        if not 0 <= self.node_rank < self.nnodes:
            raise LaunchError(
                f"--node-rank {self.node_rank} must be in 0..{self.nnodes - 1} for --nnodes {self.nnodes}"
            )
        for name, port in (
            ("--master-port", self.master_port),
            ("--aggregator-port", self.aggregator_port),
            ("--dashboard-port", self.dashboard_port),
        ):
            error = endpoint.port_error(name, port)
            if error:
                raise LaunchError(error)
        if self.mode not in MODES:
            raise LaunchError(f"--mode must be one of {', '.join(MODES)} (got {self.mode!r})")
        self.finalize_timeout_sec = _seconds(
            self.finalize_timeout_sec, settings.FINALIZE_TIMEOUT_SEC, "--finalize-timeout-sec"
        )
        self.hang_timeout_sec = _seconds(
            self.hang_timeout_sec, settings.HANG_TIMEOUT_SEC, "--hang-timeout-sec"
        )
        self.aggregator_wait_sec = _seconds(self.aggregator_wait_sec, settings.AGGREGATOR_WAIT_SEC)
        self.aggregator_start_sec = _seconds(
            self.aggregator_start_sec, settings.AGGREGATOR_START_SEC
        )
        if self.auto_instrument is None:
            self.auto_instrument = settings.env_bool(settings.AUTO_INSTRUMENT)
        if self.max_restarts < 0:
            raise LaunchError(f"--max-restarts must be >= 0 (got {self.max_restarts})")
        if self.aggregator_max_restarts is None:
            setting = settings.AGGREGATOR_MAX_RESTARTS
            raw = settings.env_str(setting)
            try:
                self.aggregator_max_restarts = int(raw)
            except ValueError:
                raise LaunchError(f"{setting.name}={raw!r}: not an integer") from None
            if self.aggregator_max_restarts < 0:
                raise LaunchError(f"{setting.name}={raw!r}: must be an integer >= 0")
        elif self.aggregator_max_restarts < 0:
            raise LaunchError(
                f"--aggregator-max-restarts must be >= 0 (got {self.aggregator_max_restarts})"
            )
        if self.save_training_output is None:
            self.save_training_output = settings.env_bool(settings.SAVE_TRAINING_OUTPUT)
        self._resolve_peak()
        if self.run_name is None:
            if self.nnodes > 1:
                raise LaunchError(
                    "--run-name is required with --nnodes > 1 (the same name on every node)"
                )
            self.run_name = generated_run_name()
        error = validate_run_name(self.run_name)
        if error:
            raise LaunchError(error)
        if self.aggregator_bind_host is None:
            self.aggregator_bind_host = "0.0.0.0" if self.nnodes > 1 else "127.0.0.1"
        if self.aggregator_host is None:
            self.aggregator_host = self.master_addr
        if self.master_port is None and self.nnodes > 1:
            self.master_port = 29500
        if self.owns_aggregator and self.master_port == self.aggregator_port:
            raise LaunchError(
                f"--master-port and --aggregator-port are both {self.aggregator_port}: node 0 "
                "listens on each, so they must differ"
            )
        if self.owns_aggregator and self.mode == "dashboard" and self.dashboard_port in (
            self.aggregator_port, self.master_port
        ):
            raise LaunchError(
                f"--dashboard-port {self.dashboard_port} is also the aggregator's or the "
                "rendezvous port: node 0 listens on each, so they must differ"
            )
        self._resolve_credentials()
        return self

    @property
    def dashboard_url(self) -> str:
        """Node 0, ``--mode dashboard``: the page's URL, the run token in it."""
        return endpoint.dashboard_url(
            str(self.aggregator_bind_host), self.dashboard_port, str(self.run_token)
        )

    def _resolve_peak(self) -> None:
        """``peak_tflops`` from its flag, else ``TRACEML_PEAK_TFLOPS``.

        Raises:
            LaunchError: the value is not a finite number > 0.
        """
        if self.peak_tflops is not None:
            error = peak_tflops_error("--peak-tflops", self.peak_tflops)
        else:
            raw = settings.env_str(settings.PEAK_TFLOPS).strip()
            error = peak_tflops_error(settings.PEAK_TFLOPS.name, raw) if raw else ""
            self.peak_tflops = float(raw) if raw and not error else None
        if error:
            raise LaunchError(error)

    def _resolve_credentials(self) -> None:
        """The token and TLS files from their flags, else their variables; checked here.

        Raises:
            LaunchError: an empty token, a certificate without its key, a missing file.
        """
        if self.run_token is None:
            self.run_token = settings.env_str(settings.RUN_TOKEN) or None
        elif not self.run_token.strip():
            raise LaunchError("--run-token must not be empty")
        try:
            tls = transport.TlsFiles.resolve(
                self.tls_cert, self.tls_key, self.tls_ca, serves=self.owns_aggregator,
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
