"""Live views of a single-node run: ``--mode cli`` and ``--mode dashboard``.

While training runs, node 0's launcher asks its aggregator for the verdict so far (the
``Summarize`` RPC that also serves ``traceml.summary()``) every ``TRACEML_LIVE_REFRESH_SEC``
seconds (default 5) and shows it: ``cli`` prints two lines per refresh (good for logs and CI),
``dashboard`` redraws them in place when stdout is a terminal (and prints like ``cli`` when it
is not). Both
end with the same final summary as ``--mode summary``. A view that cannot refresh shows
nothing that time; it never touches training.
"""

from __future__ import annotations

import sys
import time

from traceml import settings
from traceml.core import log, phases
from traceml.launcher import aggregator

#: Step parts shown, as (flat metric prefix, label); the residual reads "other" here.
_PARTS = tuple((p.name, "other" if p is phases.RESIDUAL else p.short) for p in phases.PARTS)

_log = log.get("launcher")


def render(metrics: dict[str, float], labels: dict[str, str], elapsed_s: float) -> list[str]:
    """The view's lines for one :class:`~traceml.wire.SummarizeReply` (ms, %)."""
    head = f"[traceml {elapsed_s:5.0f}s]"
    if "step_time_ms" not in metrics:
        return [f"{head} waiting for step data ({labels.get('verdict', 'no verdict yet')})"]
    verdict = labels.get("verdict", "?")
    who = f" ranks {labels['ranks']}" if labels.get("ranks") else ""
    shares = " ".join(
        f"{label} {metrics[f'{part}_pct']:.0f}%" for part, label in _PARTS
        if f"{part}_pct" in metrics
    )
    return [
        f"{head} {verdict} ({labels.get('severity', '?')}){who}",
        f"  step {metrics['step_time_ms']:.1f} ms over {metrics.get('window_steps', 0):.0f} "
        f"steps | {shares}",
    ]


class LiveView:
    """Refreshes a live view for ``mode`` ("cli" or "dashboard") from ``target``.

    Args:
        mode: the launcher's ``--mode``.
        target: ``host:port`` of the aggregator.
        run_name: the run.
        out: where the view is written (stdout).
    """

    def __init__(self, mode: str, target: str, run_name: str, out=None) -> None:
        self.out = out or sys.stdout
        self.mode = mode
        self.target = target
        self.run_name = run_name
        self.in_place = mode == "dashboard" and self.out.isatty()
        self.refresh_s = settings.env_float(settings.LIVE_REFRESH_SEC)
        self._started = time.monotonic()
        self._next = self._started + self.refresh_s
        self._drawn = 0  # lines drawn last time (dashboard redraws over them)

    def tick(self) -> bool:
        """Refresh if one is due (called about once a second by the launcher).

        Returns:
            False once the view cannot be shown any more: its stream is closed (``--mode cli
            | head`` after head exited); the launcher then stops calling it, and training,
            its output and the summary files go on as before.
        """
        now = time.monotonic()
        if now < self._next:
            return True
        self._next = now + self.refresh_s
        import grpc  # loaded by now: the launcher waited for its aggregator over gRPC

        try:
            reply = aggregator.summarize(self.target, self.run_name, timeout_s=self.refresh_s / 2)
        except grpc.RpcError:
            return True
        if reply.error:
            return True
        lines = render(dict(reply.metrics), dict(reply.labels), now - self._started)
        try:
            if self.in_place and self._drawn:
                self.out.write(f"\x1b[{self._drawn}F\x1b[J")  # up N lines, clear to the end
            self.out.write("\n".join(lines) + "\n")
            self.out.flush()
        except (OSError, ValueError) as exc:
            _log.warning(
                f"warning: the live view stopped: stdout is closed ({exc}); training goes on"
            )
            return False
        self._drawn = len(lines)
        return True
