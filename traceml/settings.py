"""Every knob of TraceML, declared once: its ``TRACEML_*`` variable and/or flag, type, unit,
default, doc and the processes that read it.

A knob is a :class:`Setting`. The commands derive their options from it
(:func:`traceml.core.cli.option`: flag, default and the ``[default: ...]`` of the help), the
launcher derives the aggregator's command line from it (:attr:`Setting.passed_as`), and the
aggregator's :class:`~traceml_aggregator.server.ServerConfig` takes its defaults from
:attr:`Setting.value`. ``tests/test_knobs.py`` fails when a knob is declared anywhere else.

Each knob has a :class:`Kind`, the one validator of its type: a refused value is one
:class:`KnobError` line, ``<flag or variable> must be <what is expected> (got <value>)``.
Commands refuse a bad value before anything starts (:func:`resolve`); a rank reads its knobs
with :func:`read`, which falls back to the default with one warning instead of crashing
training.

The launcher exports ``TRACEML_RUN_NAME``/``TRACEML_AGGREGATOR``/``TRACEML_RELAY``/
``TRACEML_LAUNCHED``, the run token (``TRACEML_RUN_TOKEN``) and the TLS CA (``TRACEML_TLS_CA``)
to its torchrun; everything else is a knob a user may set.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from traceml.core import log

#: The processes that read knobs: a node's ``traceml run``, node 0's aggregator, a rank's SDK.
PROCESSES = ("launcher", "aggregator", "rank")

#: The words that turn a boolean variable on (any case); anything else is off.
TRUE_WORDS = frozenset({"1", "true", "yes", "on"})


class KnobError(ValueError):
    """A value a knob's :class:`Kind` refuses. Its message is one line:
    ``<flag or variable> must be <what is expected> (got <value>)``."""


@dataclass(frozen=True)
class Kind:
    """The type of a knob, and its one validator.

    ``type`` converts a variable's text (``bool``: :data:`TRUE_WORDS` are true, anything else
    false; ``str`` and ``Path`` take any text); ``admits`` is what a value must satisfy,
    ``expected`` says it in words for the error.
    """

    type: type
    expected: str = ""
    admits: Callable[[Any], bool] = lambda value: True

    def check(self, source: str, value):
        """``value`` (from flag or variable ``source``) when admitted, or None when not given.

        Raises:
            KnobError: ``<source> must be <expected> (got <value>)``.
        """
        if value is None or self.admits(value):
            return value
        raise KnobError(f"{source} must be {self.expected} (got {value})")

    def parse(self, source: str, raw: str):
        """The text ``raw`` of variable (or declaration) ``source`` as a value of this kind.

        Raises:
            KnobError: ``<source> must be <expected> (got '<raw>')``: not of the type, or
                not admitted.
        """
        text = raw.strip()
        if self.type is bool:
            return text.lower() in TRUE_WORDS
        if self.type is str:
            return raw
        try:
            value = self.type(text)
            if self.admits(value):
                return value
        except ValueError:
            pass
        raise KnobError(f"{source} must be {self.expected} (got {raw!r})")


# The kinds. A duration (s) and a peak (TFLOPS) are both POSITIVE: one validator per type.
POSITIVE = Kind(float, "a finite number > 0", lambda value: math.isfinite(value) and value > 0)
COUNT = Kind(int, "an integer >= 1", lambda value: value >= 1)
NON_NEGATIVE = Kind(int, "an integer >= 0", lambda value: value >= 0)
INTEGER = Kind(int, "an integer", lambda value: True)
PORT = Kind(int, "a TCP port, 1-65535", lambda value: 0 < value < 65536)
BOOL = Kind(bool)
TEXT = Kind(str)
PATH = Kind(Path)


@dataclass(frozen=True)
class Setting:
    """One knob.

    Attributes:
        name: its ``TRACEML_*`` environment variable; "" when only a flag sets it.
        default: its default as the variable's text ("": none, the value is None).
        doc: what it does, for ``--help`` (flag and variable alike).
        kind: its type and validator (required, by keyword).
        readers: which of :data:`PROCESSES` read it (required, by keyword; at least one).
        unit: of its value: "s", "bytes", "TFLOPS", "records", "steps"; "" when none.
        flag: the option that sets it on a command line ("" when none); it wins over the
            variable.
        passed_as: the ``traceml-aggregator`` option the launcher passes its value on with;
            "" when it does not.
    """

    name: str
    default: str
    doc: str
    kind: Kind = dataclasses.field(kw_only=True)
    readers: tuple[str, ...] = dataclasses.field(kw_only=True)
    unit: str = ""
    flag: str = ""
    passed_as: str = ""

    def __post_init__(self) -> None:
        """Raises ValueError when ``readers`` is empty or names another process."""
        if not self.readers or not set(self.readers) <= set(PROCESSES):
            raise ValueError(f"{self.label}: readers must be some of {PROCESSES}")

    @property
    def label(self) -> str:
        """The variable, else the flag: how messages name the knob."""
        return self.name or self.flag

    @property
    def value(self):
        """The default as a value of :attr:`kind` (None when there is none)."""
        return self.kind.parse(self.label, self.default) if self.default else None

    @property
    def field(self) -> str:
        """The name of the knob's field in a command's config: its flag's (``--hang-timeout-sec``:
        ``hang_timeout_sec``), else its variable's (``TRACEML_AGGREGATOR_WAIT_SEC``:
        ``aggregator_wait_sec``)."""
        if self.flag:
            return self.flag[2:].replace("-", "_")
        return self.name.removeprefix("TRACEML_").lower()

    def default_text(self) -> str:
        """The default as ``--help`` shows it: ``$TRACEML_X or 300 s``, ``$TRACEML_X`` (no
        default), ``29765``, ``on``/``off`` for a boolean."""
        if not self.default:
            shown = ""
        elif self.kind is BOOL:
            shown = "on" if self.value else "off"
        elif self.unit == "bytes" and self.value % 2**20 == 0:
            shown = f"{self.value // 2**20} MiB"
        else:
            shown = f"{self.default} {self.unit}".strip()
        if not self.name:
            return shown
        return f"${self.name} or {shown}" if shown else f"${self.name}"


_L, _A, _R = PROCESSES

# --- exported by the launcher to every rank ---------------------------------------------
RUN_NAME = Setting(
    "TRACEML_RUN_NAME", "", "Run name the rank reports under.", kind=TEXT, readers=(_R,)
)
AGGREGATOR = Setting(
    "TRACEML_AGGREGATOR",
    "",
    "host:port of the aggregator's gRPC endpoint.",
    kind=TEXT,
    readers=(_R,),
)
RELAY = Setting(
    "TRACEML_RELAY",
    "",
    "The node relay's local address (unix-abstract:NAME) the rank's stream goes to; unset: "
    "straight to TRACEML_AGGREGATOR.",
    kind=TEXT,
    readers=(_R,),
)
LAUNCHED = Setting(
    "TRACEML_LAUNCHED",
    "0",
    "1 when a `traceml run` launcher hosts the node sampler.",
    kind=BOOL,
    readers=(_R,),
)
RUN_TOKEN = Setting(
    "TRACEML_RUN_TOKEN",
    "",
    "The run's secret: every call to the aggregator carries it (node 0 makes one when unset, "
    "the other nodes read it from the run directory); prefer the variable: ps shows flags.",
    kind=TEXT,
    readers=(_L, _A, _R),
    flag="--run-token",
)
TLS_CA = Setting(
    "TRACEML_TLS_CA",
    "",
    "CA certificate (PEM file) of the aggregator's TLS; unset: no TLS (node 0: its --tls-cert).",
    kind=PATH,
    readers=(_L, _R),
    flag="--tls-ca",
)
TLS_CERT = Setting(
    "TRACEML_TLS_CERT",
    "",
    "Node 0: the aggregator's TLS certificate (PEM file, with --tls-key).",
    kind=PATH,
    readers=(_L, _A),
    flag="--tls-cert",
    passed_as="--tls-cert",
)
TLS_KEY = Setting(
    "TRACEML_TLS_KEY",
    "",
    "Node 0: the private key of TRACEML_TLS_CERT (PEM file).",
    kind=PATH,
    readers=(_L, _A),
    flag="--tls-key",
    passed_as="--tls-key",
)

# --- launcher ------------------------------------------------------------------------------
MASTER_PORT = Setting(
    "",
    "29500",
    "torchrun's rendezvous port on node 0 (on one node without the flag, torchrun picks a free "
    "one).",
    kind=PORT,
    readers=(_L,),
    flag="--master-port",
)
AGGREGATOR_PORT = Setting(
    "",
    "29765",
    "The aggregator's gRPC port on node 0.",
    kind=PORT,
    readers=(_L, _A),
    flag="--aggregator-port",
    passed_as="--port",
)
#: Two above the aggregator's port, as 29766 is the Prometheus ``--metrics-port`` of
#: docs/prometheus.md's examples; ``traceml view --serve`` takes it too.
DASHBOARD_PORT = Setting(
    "",
    "29767",
    "The dashboard's HTTP port: node 0's with --mode dashboard (on the aggregator's bind "
    "host); the stored run's with traceml view --serve.",
    kind=PORT,
    readers=(_L, _A),
    flag="--dashboard-port",
)
HTML_REPORT = Setting(
    "",
    "0",
    "Also write final_summary.html (node 0).",
    kind=BOOL,
    readers=(_L, _A),
    flag="--html-report",
    passed_as="--html-report",
)
MAX_RESTARTS = Setting(
    "",
    "0",
    "torchrun --max-restarts: times torchrun restarts the ranks after a failure.",
    kind=NON_NEGATIVE,
    readers=(_L,),
    flag="--max-restarts",
)
FINALIZE_TIMEOUT_SEC = Setting(
    "TRACEML_FINALIZE_TIMEOUT_SEC",
    "300",
    "Budget of node 0's finalization, s.",
    kind=POSITIVE,
    unit="s",
    readers=(_L, _A),
    flag="--finalize-timeout-sec",
    passed_as="--finalize-timeout-sec",
)
AGGREGATOR_WAIT_SEC = Setting(
    "TRACEML_AGGREGATOR_WAIT_SEC",
    "300",
    "How long a non-owner node waits for node 0's aggregator before giving up, s.",
    kind=POSITIVE,
    unit="s",
    readers=(_L,),
)
RENDEZVOUS_WARN_SEC = Setting(
    "TRACEML_RENDEZVOUS_WARN_SEC",
    "60",
    "How long torchrun may start no rank (still importing torch, or waiting in its "
    "rendezvous) before the launcher says so (and what it waits for), s.",
    kind=POSITIVE,
    unit="s",
    readers=(_L,),
)
LIVE_REFRESH_SEC = Setting(
    "TRACEML_LIVE_REFRESH_SEC",
    "5",
    "Seconds between refreshes of the --mode cli view.",
    kind=POSITIVE,
    unit="s",
    readers=(_L,),
)
HANG_TIMEOUT_SEC = Setting(
    "TRACEML_HANG_TIMEOUT_SEC",
    "300",
    "Seconds without a completed step before a live rank is reported as hung.",
    kind=POSITIVE,
    unit="s",
    readers=(_L, _A, _R),
    flag="--hang-timeout-sec",
    passed_as="--hang-timeout-sec",
)
SAVE_TRAINING_OUTPUT = Setting(
    "TRACEML_SAVE_TRAINING_OUTPUT",
    "1",
    "Each node also writes torchrun's output to nodes/node_<r>/training.*.log; off: console only.",
    kind=BOOL,
    readers=(_L,),
    flag="--save-training-output",
)
NODE_RELAY = Setting(
    "TRACEML_NODE_RELAY",
    "1",
    "Each node's launcher relays its ranks' and sampler's streams to node 0 on one call; off: "
    "each streams straight to node 0.",
    kind=BOOL,
    readers=(_L,),
    flag="--node-relay",
)
AGGREGATOR_MAX_RESTARTS = Setting(
    "TRACEML_AGGREGATOR_MAX_RESTARTS",
    "3",
    "How many times node 0 restarts an aggregator that died during the run.",
    kind=NON_NEGATIVE,
    readers=(_L,),
    flag="--aggregator-max-restarts",
)
AGGREGATOR_START_SEC = Setting(
    "TRACEML_AGGREGATOR_START_SEC",
    "60",
    "How long node 0 waits for its aggregator to serve, s.",
    kind=POSITIVE,
    unit="s",
    readers=(_L,),
)
AGGREGATOR_CHECKPOINT_SEC = Setting(
    "TRACEML_AGGREGATOR_CHECKPOINT_SEC",
    "30",
    "Time between two checkpoints of the aggregator's live aggregates (~120 KB a rank, "
    "written to the store): a replacement aggregator folds in only the steps stored after "
    "the latest one.",
    kind=POSITIVE,
    unit="s",
    readers=(_A,),
)

AGGREGATOR_MESSAGES_PER_SEC = Setting(
    "TRACEML_AGGREGATOR_MESSAGES_PER_SEC",
    "125",
    "Node 0's budget of messages a second: once its streams and node relays are more than "
    "this, the aggregator asks every rank and sampler to flush no more often than every 2, 4 "
    "or 8 s (traceml_aggregator/pace.py).",
    kind=POSITIVE,
    unit="messages/s",
    readers=(_A,),
)

# --- the store's retention (traceml_aggregator/retention.py, docs/storage.md) --------------
# The defaults keep a 3-day, 8,000-rank run at 2 steps/s and 1 sample/s under 20 GiB of steps
# and samples (benchmarks/retention.py prints the arithmetic from a real store's bytes per row).
KEEP_ALL_STEPS = Setting(
    "",
    "0",
    "Node 0's store keeps every step row and every sample row; off: each rank's first and "
    "last steps, the findings' evidence and a uniform sample, and each group's first and last "
    "samples and its series' sample times (docs/storage.md).",
    kind=BOOL,
    readers=(_L, _A),
    flag="--keep-all-steps",
    passed_as="--keep-all-steps",
)
STORE_FIRST_STEPS = Setting(
    "TRACEML_STORE_FIRST_STEPS",
    "1000",
    "Steps of each rank kept raw from its start (step index below this).",
    kind=NON_NEGATIVE,
    unit="steps",
    readers=(_A,),
)
STORE_LAST_STEPS = Setting(
    "TRACEML_STORE_LAST_STEPS",
    "1000",
    "Each rank's latest steps kept raw (never pruned while they are its latest).",
    kind=COUNT,
    unit="steps",
    readers=(_A,),
)
STORE_SAMPLE_EVERY = Setting(
    "TRACEML_STORE_SAMPLE_EVERY",
    "128",
    "Beyond the first and last steps, one step in this many (the same step indices on every "
    "rank) is kept raw.",
    kind=COUNT,
    unit="steps",
    readers=(_A,),
)
STORE_EVIDENCE_STEPS = Setting(
    "TRACEML_STORE_EVIDENCE_STEPS",
    "4096",
    "Most steps of each rank kept raw as a finding's evidence (spikes, an onset's "
    "neighbourhood) over the whole run (the count is stored, so it survives an aggregator "
    "restart).",
    kind=NON_NEGATIVE,
    unit="steps",
    readers=(_A,),
)
STORE_FIRST_SAMPLES = Setting(
    "TRACEML_STORE_FIRST_SAMPLES",
    "600",
    "Sample times of each group (a rank attempt's process samples, a node's system or GPU "
    "samples) kept raw from its start.",
    kind=NON_NEGATIVE,
    unit="samples",
    readers=(_A,),
)
STORE_LAST_SAMPLES = Setting(
    "TRACEML_STORE_LAST_SAMPLES",
    "120",
    "Each group's latest sample times kept raw (held back from every prune while they are its "
    "latest: the aggregator's memory holds their row ids, ~16 bytes a row).",
    kind=NON_NEGATIVE,
    unit="samples",
    readers=(_A,),
)

AUTO_INSTRUMENT = Setting(
    "TRACEML_AUTO_INSTRUMENT",
    "1",
    "Zero-code steps and phases for a script that never calls trace_step; off: `traceml run` "
    "starts the script itself.",
    kind=BOOL,
    readers=(_L,),
    flag="--auto-instrument",
)

PEAK_TFLOPS = Setting(
    "TRACEML_PEAK_TFLOPS",
    "",
    "Peak dense TFLOPS of one rank's device that MFU is computed against (wins over the GPU "
    "table, gives CPU runs an MFU); unset: the documented GPU table (docs/reading-output.md), "
    "no MFU on CPU.",
    kind=POSITIVE,
    unit="TFLOPS",
    readers=(_L, _R),
    flag="--peak-tflops",
)

# --- aggregator ----------------------------------------------------------------------------
#: Off unless given: nothing leaves node 0 unless asked for (docs/prometheus.md).
METRICS_PORT = Setting(
    "",
    "",
    "Node 0: serve Prometheus /metrics of the live run on this port of --metrics-bind-host "
    "(bearer: the run token; TLS as the aggregator's).",
    kind=PORT,
    readers=(_L, _A),
    flag="--metrics-port",
    passed_as="--metrics-port",
)
METRICS_BIND_HOST = Setting(
    "",
    "127.0.0.1",
    "Node 0: the address /metrics listens on (0.0.0.0: every interface).",
    kind=TEXT,
    readers=(_L, _A),
    flag="--metrics-bind-host",
    passed_as="--metrics-bind-host",
)
#: Off unless given, or unless the standard OTEL_EXPORTER_OTLP_(METRICS_)ENDPOINT is set
#: (traceml/core/otlp.py); the exporter reads the other OTEL_EXPORTER_OTLP_* variables itself.
OTLP_ENDPOINT = Setting(
    "",
    "",
    "Node 0: push the /metrics series as OpenTelemetry metrics to this OTLP/gRPC collector "
    "(http://host:4317: plain text; https://: TLS); needs the otlp extra.",
    kind=TEXT,
    readers=(_L, _A),
    flag="--otlp-endpoint",
    passed_as="--otlp-endpoint",
)
OTLP_INTERVAL_SEC = Setting(
    "TRACEML_OTLP_INTERVAL_SEC",
    "15",
    "Node 0: time between two OTLP pushes, s (one more when the run ends).",
    kind=POSITIVE,
    unit="s",
    readers=(_A,),
)
#: A rank, or a node sampler, holds one stream open all along, so this bounds the senders one
#: aggregator serves at once (docs/scale.md: 8,192 ranks and their nodes' samplers, with room
#: for one-off calls).
MAX_CONCURRENT_RPCS = Setting(
    "",
    "16384",
    "Calls in flight at most, each sender's open stream included; more are answered "
    "RESOURCE_EXHAUSTED.",
    kind=COUNT,
    unit="calls",
    readers=(_A,),
    flag="--max-concurrent-rpcs",
)
MAX_QUEUED_BYTES = Setting(
    "",
    str(256 * 2**20),
    "Bound of the writer's queue, bytes of serialized batches; beyond it a batch is pushed "
    "back with a retry-after.",
    kind=COUNT,
    unit="bytes",
    readers=(_A,),
    flag="--max-queued-bytes",
)

# --- the wire's time bounds (traceml/core/transport.py, docs/wire.md) ---------------------
# Read once, when a process imports traceml.core.transport. Client and aggregator must agree:
# GRPC_CLIENT_KEEPALIVE_MS >= GRPC_SERVER_MIN_PING_INTERVAL_MS, or the aggregator answers the
# client's pings with GOAWAY too_many_pings. The test suite sets them short to make its faults
# short (tests/test_keepalive.py, test_node_session.py, test_telemetry_loss.py).
GRPC_CLIENT_KEEPALIVE_MS = Setting(
    "TRACEML_GRPC_CLIENT_KEEPALIVE_MS",
    "30000",
    "How often a client (rank, node launcher, live view) pings the aggregator, also with no "
    "call open (>= TRACEML_GRPC_SERVER_MIN_PING_INTERVAL_MS).",
    kind=COUNT,
    unit="ms",
    readers=(_L, _R),
)
GRPC_SERVER_KEEPALIVE_MS = Setting(
    "TRACEML_GRPC_SERVER_KEEPALIVE_MS",
    "20000",
    "How often the aggregator pings each connection.",
    kind=COUNT,
    unit="ms",
    readers=(_A,),
)
GRPC_SERVER_MIN_PING_INTERVAL_MS = Setting(
    "TRACEML_GRPC_SERVER_MIN_PING_INTERVAL_MS",
    "10000",
    "Shortest interval between a client's pings that the aggregator permits.",
    kind=COUNT,
    unit="ms",
    readers=(_A,),
)
GRPC_KEEPALIVE_TIMEOUT_MS = Setting(
    "TRACEML_GRPC_KEEPALIVE_TIMEOUT_MS",
    "20000",
    "A connection whose ping has no answer within this, or whose sent data stays "
    "unacknowledged this long (gRPC's TCP_USER_TIMEOUT), is dropped (both sides).",
    kind=COUNT,
    unit="ms",
    readers=(_L, _A, _R),
)
NODE_LOST_AFTER_SEC = Setting(
    "TRACEML_NODE_LOST_AFTER_SEC",
    "25",
    "The aggregator marks a node lost once nothing came from its launcher for this long "
    "(the launcher's heartbeat comes every 2 s).",
    kind=POSITIVE,
    unit="s",
    readers=(_A,),
)

#: For tests only: shifts the wall clock a launcher, its ranks and its node sampler stamp on the
#: wire (traceml/core/clock.py), to play a node whose clock is off; node 0 estimates the shift
#: (docs/telemetry.md, "Clocks").
TEST_CLOCK_OFFSET_MS = Setting(
    "TRACEML_TEST_CLOCK_OFFSET_MS",
    "0",
    "Test builds: add this to the wall clock this node's launcher and ranks send, ms.",
    kind=INTEGER,
    unit="ms",
    readers=(_L, _R),
)

# --- SDK -------------------------------------------------------------------------------------
DISABLE = Setting("TRACEML_DISABLE", "0", "1 turns the SDK into a no-op.", kind=BOOL, readers=(_R,))
STRICT = Setting(
    "TRACEML_STRICT",
    "0",
    "1 lets SDK errors raise into training (for debugging TraceML).",
    kind=BOOL,
    readers=(_R,),
)
FLUSH_INTERVAL_SEC = Setting(
    "TRACEML_FLUSH_INTERVAL_SEC",
    "2.0",
    "Longest time a record waits before it is sent, s.",
    kind=POSITIVE,
    unit="s",
    readers=(_R,),
)
BATCH_MAX_RECORDS = Setting(
    "TRACEML_BATCH_MAX_RECORDS",
    "512",
    "Records that trigger a send before the interval.",
    kind=COUNT,
    unit="records",
    readers=(_R,),
)
BUFFER_MAX_RECORDS = Setting(
    "TRACEML_BUFFER_MAX_RECORDS",
    "65536",
    "Bound of the in-process buffer, records; it also holds what waits while the aggregator "
    "is out of reach. Records beyond it are dropped and counted.",
    kind=COUNT,
    unit="records",
    readers=(_R,),
)
HEARTBEAT_SEC = Setting(
    "TRACEML_HEARTBEAT_SEC",
    "5",
    "While a rank has nothing to send (no step completes: a hang, a long evaluation), its "
    "sender still ships its progress (step count and phase) this often, s.",
    kind=POSITIVE,
    unit="s",
    readers=(_R,),
)
RPC_TIMEOUT_SEC = Setting(
    "TRACEML_RPC_TIMEOUT_SEC",
    "5",
    "Longest wait for a batch's acknowledgement on the stream (a node relay's, for node 0's "
    "answer to its message), s.",
    kind=POSITIVE,
    unit="s",
    readers=(_L, _R),
)
FINISH_TIMEOUT_SEC = Setting(
    "TRACEML_FINISH_TIMEOUT_SEC",
    "10",
    "How long a rank's exit waits to deliver its last batch, s.",
    kind=POSITIVE,
    unit="s",
    readers=(_R,),
)
SIGTERM_FLUSH_SEC = Setting(
    "TRACEML_SIGTERM_FLUSH_SEC",
    "2",
    "How long a rank killed by SIGTERM takes to send what it buffered and its finish marker "
    "before it dies of SIGTERM, s (records it had no time for are counted as unsent).",
    kind=POSITIVE,
    unit="s",
    readers=(_R,),
)
SAMPLE_INTERVAL_SEC = Setting(
    "TRACEML_SAMPLE_INTERVAL_SEC",
    "1.0",
    "Period of the system and process samplers, s.",
    kind=POSITIVE,
    unit="s",
    readers=(_R,),
)
MEMORY_EVERY_N_STEPS = Setting(
    "TRACEML_MEMORY_EVERY_N_STEPS",
    "10",
    "CUDA allocator peaks are read (never reset) once every N steps.",
    kind=COUNT,
    unit="steps",
    readers=(_R,),
)
GPU_TIMING_EVERY_N_STEPS = Setting(
    "TRACEML_GPU_TIMING_EVERY_N_STEPS",
    "10",
    "One step in N is timed on the GPU clock (CUDA events around the step and its phases).",
    kind=COUNT,
    unit="steps",
    readers=(_R,),
)
GPU_FINISH_WAIT_SEC = Setting(
    "TRACEML_GPU_FINISH_WAIT_SEC",
    "2",
    "How long a rank's exit waits for the CUDA events of its last GPU-timed step, s.",
    kind=POSITIVE,
    unit="s",
    readers=(_R,),
)
SUMMARY_TIMEOUT_SEC = Setting(
    "TRACEML_SUMMARY_TIMEOUT_SEC",
    "30",
    "How long traceml.summary() waits for its steps to be stored and the verdict computed, s.",
    kind=POSITIVE,
    unit="s",
    readers=(_R,),
)

#: Every knob above, in order (``traceml run --help`` lists the variables with their docs).
ALL: tuple[Setting, ...] = tuple(v for v in list(globals().values()) if isinstance(v, Setting))


def env_str(setting: Setting) -> str:
    """The variable's text, or its default when unset or empty."""
    return (os.environ.get(setting.name) if setting.name else None) or setting.default


def resolve(setting: Setting, given=None, flag: str = ""):
    """The knob's value for a command: ``given`` (from ``flag``, default :attr:`Setting.flag`)
    when not None, else its variable, else its default; None for a knob without a variable
    that was not given (off), or without a default.

    Raises:
        KnobError: the value is not of the knob's kind (one line naming the flag or the
            variable, the value and what is expected).
    """
    if given is not None:
        return setting.kind.check(flag or setting.flag or setting.label, given)
    if not setting.name:
        return None
    raw = env_str(setting)
    return setting.kind.parse(setting.label, raw) if raw else None


def read(setting: Setting):
    """The value of the knob's variable in a rank (never raises): as :func:`resolve` without a
    flag, but a bad value is one warning and the default (training must never fail on a knob)."""
    try:
        return resolve(setting)
    except KnobError as exc:
        log.get("settings").warning(f"{exc}; using the default, {setting.default or 'none'}")
        return setting.value
