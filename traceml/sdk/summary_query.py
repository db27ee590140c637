"""``traceml.summary()``: the verdict so far, from the aggregator, as one flat dict.

Rank 0 first waits (bounded) until its own buffered steps are stored, then asks the aggregator
(``Summarize`` RPC) to analyse everything stored so far. The aggregator answers with metrics
(numbers) and labels (words); they come back merged, each name prefixed, ready for
``wandb.log``, ``mlflow.log_metrics``/``mlflow.set_tags`` or TensorBoard. Fail-open: any
problem is one warning and an empty dict.
"""

from __future__ import annotations

import time

from traceml import settings
from traceml.sdk import rank_state
from traceml.sdk.failopen import warn_once


def _warn_once(message: str) -> None:
    warn_once("summary", f"traceml.summary(): {message}; returning {{}}")


def _number(name: str, value: float) -> float | int:
    """Counts and byte sizes as int; durations and shares stay float."""
    if value.is_integer() and not name.endswith(("_ms", "_pct")):
        return int(value)
    return value


def fetch(prefix: str, timeout_s: float | None) -> dict:
    """The flat verdict for rank 0 (``{}`` on other ranks); see ``traceml.summary``."""
    s = rank_state.current()
    if s is None:
        _warn_once("no TraceML session (traceml.init() not called, disabled, or failed)")
        return {}
    if s.info.rank != 0:
        return {}
    from traceml import wire

    budget = (
        timeout_s if timeout_s and timeout_s > 0 else settings.read(settings.SUMMARY_TIMEOUT_SEC)
    )
    deadline = time.monotonic() + budget
    import grpc

    s.client.flush(budget / 2)  # best effort: the verdict covers whatever is stored
    try:
        reply = s.client.call(
            "Summarize",
            wire.SummarizeRequest(run_name=s.run_name),
            max(1.0, deadline - time.monotonic()),
        )
    except grpc.RpcError as exc:
        code = exc.code() if hasattr(exc, "code") else None
        _warn_once(f"the aggregator at {s.target} did not answer ({getattr(code, 'name', code)})")
        return {}
    if reply.error:
        _warn_once(f"the aggregator could not summarize ({reply.error})")
        return {}
    out: dict = {f"{prefix}{k}": _number(k, v) for k, v in sorted(reply.metrics.items())}
    out.update({f"{prefix}{k}": v for k, v in sorted(reply.labels.items())})
    return out
