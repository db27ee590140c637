"""The end-state reason that marks an interrupted run (the launcher writes it, the analysis
reads it): a rank stopped because its launcher got SIGTERM or SIGINT (scancel, preemption,
Ctrl-C), not because it or another rank failed."""

from __future__ import annotations

INTERRUPTED_PREFIX = "interrupted: "


def interrupted_reason(signal_name: str) -> str:
    """The reason of a rank stopped by its launcher's ``signal_name`` ("SIGTERM")."""
    return f"{INTERRUPTED_PREFIX}the launcher got {signal_name} (scancel, preemption or Ctrl-C)"


def is_interrupted(reason: str | None) -> bool:
    """True for a reason written by :func:`interrupted_reason`."""
    return bool(reason) and reason.startswith(INTERRUPTED_PREFIX)
