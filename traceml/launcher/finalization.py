"""Node 0's end of a run: the final summary, asked of the aggregator or written from the store.

:meth:`Finalization.run` asks node 0's aggregator over the node session (the summary's text
comes back down the stream and is printed). When the aggregator is gone for good (it died and
may not be restarted, or never served) or gives no answer within the budget and its slack (it
is paused or stalled; it is then stopped), the summary is written from the run's store by
``traceml-aggregator --finalize-only``, a process the launcher runs and waits for: the one
place the launcher reads summary files (that process's output), since no aggregator is left
to send anything.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable

from traceml.core import log
from traceml.core.rundir import (
    SUMMARY_HTML_NAME,
    SUMMARY_JSON_NAME,
    SUMMARY_TEXT_NAME,
    Manifest,
    RunDir,
    write_atomic,
)
from traceml.launcher import aggregator
from traceml.launcher.config import LaunchConfig
from traceml.launcher.states import AggregatorStatus
from traceml.launcher.supervisor import AggregatorSupervisor

_log = log.get("launcher")

#: Longest finalization after the launcher was interrupted (SIGTERM, SIGINT), s: Slurm sends
#: SIGKILL 30 s after its SIGTERM (KillWait), and the summary must be written before.
INTERRUPTED_FINALIZE_BUDGET_S = 10.0


class Finalization:
    """Writes and prints node 0's final summary (see the module docstring).

    Args:
        config: the launch's flags (run name, ``--finalize-timeout-sec``).
        run_dir: the run directory.
        supervisor: node 0's aggregator.
        signals: ``fn() -> int``: how many SIGTERM/SIGINT the launcher got so far (one that
            comes while the aggregator finalizes cuts the wait short: the summary is then
            written at once with what is stored).
    """

    def __init__(
        self,
        config: LaunchConfig,
        run_dir: RunDir,
        supervisor: AggregatorSupervisor,
        signals: Callable[[], int],
    ) -> None:
        self.config = config
        self.run_dir = run_dir
        self.supervisor = supervisor
        self._signals = signals

    def run(self, manifest: Manifest, session, report) -> None:
        """Write the summary, print it and record it in ``manifest`` (a ``finalized`` event):
        from the aggregator over ``session`` (a NodeSession, or None when it never served),
        else from the store with this node's exit ``report`` (a NodeExit)."""
        if not self._from_aggregator(manifest, session):
            self._from_store(manifest, report)

    def _from_aggregator(self, manifest: Manifest, session) -> bool:
        """Ask the aggregator for the summary and print it.

        The budget is ``--finalize-timeout-sec``, at most :data:`INTERRUPTED_FINALIZE_BUDGET_S`
        once the launcher was interrupted.

        Returns:
            False when the aggregator could not finalize because it is gone, or gave no answer
            (the caller writes the summary from the store), True otherwise.
        """
        supervisor = self.supervisor
        supervisor.watch(manifest)
        if supervisor.status is not AggregatorStatus.SERVING:
            return not supervisor.served  # lost (said by the supervisor), or never served
        from traceml.launcher.session import SessionBroken

        budget = self.config.finalize_timeout_sec
        signals_before = self._signals()
        if signals_before:
            budget = min(budget, INTERRUPTED_FINALIZE_BUDGET_S)
        run_name = str(self.config.run_name)
        try:
            reply = session.finalize(
                run_name,
                budget,
                cancelled=lambda: self._signals() != signals_before,
                gone=supervisor.exited,
            )
            if reply is None:  # a signal during the wait: now, with what is stored
                reply = session.finalize(run_name, 0.01, gone=supervisor.exited)
        except SessionBroken as exc:
            if supervisor.exited():  # it died while finalizing
                restarts = len(supervisor.health["restarts"])
                supervisor.watch(manifest)
                if (
                    len(supervisor.health["restarts"]) > restarts
                    and supervisor.status is AggregatorStatus.SERVING
                ):
                    return self._from_aggregator(manifest, session)  # a replacement serves
                return False
            # Alive but no answer within the budget and its slack (paused, stalled on its
            # disk): the store holds what it committed, and the summary is written from it,
            # saying that the aggregator was lost when it last answered anything.
            supervisor.fail(f"gave no answer ({exc})", session.last_answer_unix_s or time.time())
            manifest.update(aggregator=supervisor.health)
            _log.warning(
                f"warning: the aggregator did not write the summary ({exc}); writing it from "
                "the store"
            )
            return False
        if reply.summary_text:  # with an error too: node 0's disk is full, or its store failed
            print_summary(reply.summary_text)
            if reply.missing_ranks:
                _log.info(f"partial summary: ranks {list(reply.missing_ranks)} missing (see above)")
        if reply.error:
            supervisor.fail(reply.error)
            what = "the summary above" if reply.summary_text else "no final summary"
            _log.warning(f"warning: {what}: {reply.error}")
        if reply.summary_json_path:
            _log.info(f"summary: {reply.summary_json_path}")
        self._record(
            manifest,
            {
                "final_summary_json": reply.summary_json_path,
                "final_summary_txt": reply.summary_text_path,
                "final_summary_html": reply.summary_html_path,
            },
            status="finalized" if reply.summary_json_path else "finalize_failed",
            complete=reply.complete,
            missing_ranks=list(reply.missing_ranks),
            run_status=reply.run_status or None,
        )
        return True

    def _from_store(self, manifest: Manifest, report) -> None:
        """The aggregator is gone for good, or silent: stop it (SIGKILL after 2 s: its store
        lock must be released), then write the summary from the run's store with
        ``traceml-aggregator --finalize-only`` (this node's exit report and, when the
        supervisor lost it, why and since when included), print it. It has the budget of a
        live finalization (``--finalize-timeout-sec``, its own deadline too) and is killed
        :data:`~traceml.core.transport.FINALIZE_SLACK_S` after it, as a live aggregator's
        answer is waited for."""
        from traceml.core.transport import FINALIZE_SLACK_S

        supervisor = self.supervisor
        supervisor.halt(2.0)  # its disk room given back too: a full disk's summary needs it
        root = self.run_dir.root
        lost = supervisor.lost_unix_s is not None  # the summary says what it lacks
        try:
            node_exit_file = self.run_dir.node_dir / "node_exit.pb"
            write_atomic(node_exit_file, report.SerializeToString())
            code = aggregator.finalize_offline(
                self.config,
                self.run_dir,
                node_exit_file,
                self.config.finalize_timeout_sec + FINALIZE_SLACK_S,
                lost_reason=str(supervisor.health["reason"]) if lost else "",
                lost_unix_s=supervisor.lost_unix_s,
            )
        except Exception as exc:  # fail-open: a full disk, a timeout, or no python to run
            code = f"{type(exc).__name__}: {exc}"
        if code != 0:
            _log.warning(
                f"warning: no final summary: writing it from the store failed ({code}; see "
                f"{self.run_dir.aggregator_stderr})"
            )
            manifest.event("finalized", status="finalize_failed", aggregator=supervisor.health)
            return
        print_summary((root / SUMMARY_TEXT_NAME).read_text(encoding="utf-8"))
        _log.info(
            f"summary (written from the store: the aggregator was lost): {root / SUMMARY_JSON_NAME}"
        )
        summary = json.loads((root / SUMMARY_JSON_NAME).read_text(encoding="utf-8"))
        html = root / SUMMARY_HTML_NAME
        self._record(
            manifest,
            {
                "final_summary_json": str(root / SUMMARY_JSON_NAME),
                "final_summary_txt": str(root / SUMMARY_TEXT_NAME),
                "final_summary_html": str(html) if html.exists() else "",
            },
            status="finalized_from_store",
            complete=summary["run"]["complete"],
            missing_ranks=summary["run"]["missing_ranks"],
            run_status=summary["run"]["status"],
        )

    def _record(self, manifest: Manifest, paths: dict[str, str], **fields) -> None:
        """The ``finalized`` event: the summary's paths (those written) in the artifacts."""
        artifacts = dict(manifest.data["artifacts"])
        artifacts.update({key: path for key, path in paths.items() if path})
        health = self.supervisor.health
        manifest.event("finalized", aggregator=health, artifacts=artifacts, **fields)


def print_summary(text: str) -> None:
    """The summary text on stdout; a closed stdout (``| head``) costs only the text."""
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except (OSError, ValueError):
        _log.warning("warning: stdout is closed; the summary is only in the files")
