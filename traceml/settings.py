"""Every ``TRACEML_*`` environment variable, one constant each, with its default.

The launcher exports ``TRACEML_RUN_NAME``/``TRACEML_AGGREGATOR``/``TRACEML_LAUNCHED``, the
run token (``TRACEML_RUN_TOKEN``) and the TLS CA (``TRACEML_TLS_CA``) to its torchrun; everything else is a knob a user may set. Read values through
:func:`env_str`, :func:`env_float`, :func:`env_int` and :func:`env_bool` so a malformed value
falls back to the default with one warning instead of crashing training.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from traceml.core import log


@dataclass(frozen=True)
class Setting:
    """One environment variable: its name, default and meaning (units in the doc)."""

    name: str
    default: str
    doc: str


# --- exported by the launcher to every rank ---------------------------------------------
RUN_NAME = Setting("TRACEML_RUN_NAME", "", "Run name the rank reports under.")
AGGREGATOR = Setting("TRACEML_AGGREGATOR", "", "host:port of the aggregator's gRPC endpoint.")
LAUNCHED = Setting(
    "TRACEML_LAUNCHED", "0", "1 when a `traceml run` launcher hosts the node sampler."
)
RUN_TOKEN = Setting(
    "TRACEML_RUN_TOKEN",
    "",
    "The run's secret: every call to the aggregator carries it (node 0 makes one when unset).",
)
TLS_CA = Setting(
    "TRACEML_TLS_CA", "", "CA certificate (PEM file) of the aggregator's TLS; unset: no TLS."
)
TLS_CERT = Setting(
    "TRACEML_TLS_CERT", "", "Node 0: the aggregator's TLS certificate (PEM file, with --tls-key)."
)
TLS_KEY = Setting("TRACEML_TLS_KEY", "", "Node 0: the private key of TRACEML_TLS_CERT (PEM file).")

# --- launcher ------------------------------------------------------------------------------
FINALIZE_TIMEOUT_SEC = Setting(
    "TRACEML_FINALIZE_TIMEOUT_SEC", "300", "Budget of node 0's finalization, seconds (> 0)."
)
AGGREGATOR_WAIT_SEC = Setting(
    "TRACEML_AGGREGATOR_WAIT_SEC",
    "300",
    "How long a non-owner node waits for node 0's aggregator before giving up, seconds.",
)
LIVE_REFRESH_SEC = Setting(
    "TRACEML_LIVE_REFRESH_SEC", "5", "Seconds between refreshes of the --mode cli view."
)
HANG_TIMEOUT_SEC = Setting(
    "TRACEML_HANG_TIMEOUT_SEC",
    "300",
    "Seconds without a completed step before a live rank is reported as hung (> 0).",
)
SAVE_TRAINING_OUTPUT = Setting(
    "TRACEML_SAVE_TRAINING_OUTPUT",
    "1",
    "1 (default): each node also writes torchrun's output to nodes/node_<r>/training.*.log; "
    "0: console only (--save-training-output/--no-save-training-output win).",
)
AGGREGATOR_MAX_RESTARTS = Setting(
    "TRACEML_AGGREGATOR_MAX_RESTARTS",
    "3",
    "How many times node 0 restarts an aggregator that died during the run (>= 0).",
)
AGGREGATOR_START_SEC = Setting(
    "TRACEML_AGGREGATOR_START_SEC", "60", "How long node 0 waits for its aggregator to serve."
)

AUTO_INSTRUMENT = Setting(
    "TRACEML_AUTO_INSTRUMENT",
    "1",
    "0 makes `traceml run` start the script itself, without zero-code steps "
    "(as --no-auto-instrument does).",
)

PEAK_TFLOPS = Setting(
    "TRACEML_PEAK_TFLOPS",
    "",
    "Peak TFLOPS of one rank's device that MFU is computed against (as --peak-tflops does); "
    "unset: the documented GPU table (docs/reading-output.md), no MFU on CPU.",
)

# --- SDK -------------------------------------------------------------------------------------
DISABLE = Setting("TRACEML_DISABLE", "0", "1 turns the SDK into a no-op.")
STRICT = Setting(
    "TRACEML_STRICT", "0", "1 lets SDK errors raise into training (for debugging TraceML)."
)
FLUSH_INTERVAL_SEC = Setting(
    "TRACEML_FLUSH_INTERVAL_SEC", "2.0", "Longest time a record waits before it is sent, s."
)
BATCH_MAX_RECORDS = Setting(
    "TRACEML_BATCH_MAX_RECORDS", "512", "Records that trigger a send before the interval."
)
BUFFER_MAX_RECORDS = Setting(
    "TRACEML_BUFFER_MAX_RECORDS",
    "65536",
    "Bound of the in-process buffer, records; it also holds what waits while the aggregator "
    "is out of reach. Records beyond it are dropped and counted.",
)
HEARTBEAT_SEC = Setting(
    "TRACEML_HEARTBEAT_SEC",
    "5",
    "While a rank has nothing to send (no step completes: a hang, a long evaluation), its "
    "sender still ships its progress (step count and phase) this often, s.",
)
RPC_TIMEOUT_SEC = Setting(
    "TRACEML_RPC_TIMEOUT_SEC", "5", "Longest wait for a batch's acknowledgement on the stream, s."
)
FINISH_TIMEOUT_SEC = Setting(
    "TRACEML_FINISH_TIMEOUT_SEC", "10", "How long a rank's exit waits to deliver its last batch."
)
SIGTERM_FLUSH_SEC = Setting(
    "TRACEML_SIGTERM_FLUSH_SEC",
    "2",
    "How long a rank killed by SIGTERM takes to send what it buffered and its finish marker "
    "before it dies of SIGTERM, s (records it had no time for are counted as unsent).",
)
SAMPLE_INTERVAL_SEC = Setting(
    "TRACEML_SAMPLE_INTERVAL_SEC", "1.0", "Period of the system and process samplers, s."
)
MEMORY_EVERY_N_STEPS = Setting(
    "TRACEML_MEMORY_EVERY_N_STEPS",
    "10",
    "CUDA allocator peaks are read (never reset) once every N steps.",
)
GPU_TIMING_EVERY_N_STEPS = Setting(
    "TRACEML_GPU_TIMING_EVERY_N_STEPS",
    "10",
    "One step in N is timed on the GPU clock (CUDA events around the step and its phases).",
)
GPU_FINISH_WAIT_SEC = Setting(
    "TRACEML_GPU_FINISH_WAIT_SEC",
    "2",
    "How long a rank's exit waits for the CUDA events of its last GPU-timed step, s.",
)
SUMMARY_TIMEOUT_SEC = Setting(
    "TRACEML_SUMMARY_TIMEOUT_SEC",
    "30",
    "How long traceml.summary() waits for its steps to be stored and the verdict computed, s.",
)

#: Every setting above, in order (``traceml run --help`` lists them with their docs).
ALL: tuple[Setting, ...] = tuple(v for v in list(globals().values()) if isinstance(v, Setting))


def env_str(setting: Setting) -> str:
    """The variable's value, or its default when unset or empty."""
    return os.environ.get(setting.name) or setting.default


def _warn_bad(setting: Setting, raw: str, why: str) -> None:
    log.get("settings").warning(f"ignoring {setting.name}={raw!r} ({why}); using {setting.default}")


def env_float(setting: Setting, *, positive: bool = True, strict: bool = False) -> float:
    """The variable as a finite float (> 0 when ``positive``); default with a warning if not.

    Args:
        strict: raise instead of warning and falling back (the launcher rejects bad input
            before anything starts; training processes must never fail on a knob).

    Raises:
        ValueError: only with ``strict``; the one-line message names the variable and value.
    """
    raw = env_str(setting)
    try:
        value = float(raw)
        why = ""
    except ValueError:
        why = "not a number"
    else:
        if not math.isfinite(value) or (positive and value <= 0):
            why = "must be a finite number > 0" if positive else "not finite"
    if not why:
        return value
    if strict:
        raise ValueError(f"{setting.name}={raw!r}: {why}")
    _warn_bad(setting, raw, why)
    return float(setting.default)


def env_int(setting: Setting) -> int:
    """The variable as an integer >= 1; default with a warning if not."""
    raw = env_str(setting)
    try:
        value = int(raw)
    except ValueError:
        _warn_bad(setting, raw, "not an integer")
        return int(setting.default)
    if value < 1:
        _warn_bad(setting, raw, "must be >= 1")
        return int(setting.default)
    return value


def env_bool(setting: Setting) -> bool:
    """True for 1/true/yes/on (any case)."""
    return env_str(setting).strip().lower() in {"1", "true", "yes", "on"}
