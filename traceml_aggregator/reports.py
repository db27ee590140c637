"""The report files of a run: ``final_summary.json``, ``.txt``, ``.html``.

:func:`write_reports` runs at finalization, on the aggregator's writer thread (the live views
and ``traceml.summary()`` are answered from :mod:`traceml_aggregator.live` instead). The steps
come from the live aggregates and the samples from the checkpoint's bounded series (both
bounded per rank, so finalization costs O(ranks), not O(stored steps or samples)); everything
else (identities, ends) from the store's small tables.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from traceml.analysis.rundata import RunData
from traceml.analysis.summary import build_summary
from traceml.core import log
from traceml.core.records import AggregatorLoss, NodeExit, RankEnd
from traceml.core.rundir import (
    SUMMARY_HTML_NAME,
    SUMMARY_JSON_NAME,
    SUMMARY_TEXT_NAME,
    write_atomic,
)
from traceml.core.transport import FINALIZE_SLACK_S
from traceml.report import to_json
from traceml.report.text import render_text
from traceml_aggregator import load
from traceml_aggregator.checkpoint import Checkpoint
from traceml_aggregator.finalize import Outcome
from traceml_aggregator.live import with_steps

_log = log.get("aggregator")

#: The HTML report is drawn when the summary is written at most this long past the
#: finalization's deadline, s: half the time node 0's launcher waits past the budget
#: (:data:`~traceml.core.transport.FINALIZE_SLACK_S`), the other half left to draw it.
HTML_AFTER_DEADLINE_S = FINALIZE_SLACK_S / 2


@dataclass
class Unstored:
    """What the aggregator knows at finalization that its store may not hold (a full disk,
    with no room even in :mod:`~traceml.core.disk_reserve`'s): the summary takes it all the
    same (:func:`with_unstored`)."""

    #: ``(NodeExit, received µs)`` of the node exits taken (:attr:`AggregatorService.
    #: unstored_exits <traceml_aggregator.server.AggregatorService.unstored_exits>`).
    node_exits: list[tuple] = field(default_factory=list)
    #: The store's failure to commit, as the summary records it (None: it commits).
    loss: AggregatorLoss | None = None


def with_unstored(run: RunData, unstored: Unstored) -> RunData:
    """``run`` with ``unstored``'s node exits (and their ranks' end states) and loss over what
    the store held (the same facts where the store did take them)."""
    for report, received_unix_us in unstored.node_exits:
        run.node_exits[report.node_rank] = NodeExit.from_wire(
            report, received_unix_us=received_unix_us
        )
        for end in report.ranks:
            if end.rank in run.ranks:
                run.ranks[end.rank].end = RankEnd.from_wire(end, node_rank=report.node_rank)
    if unstored.loss is not None:
        run.aggregator_loss = unstored.loss
    return run


def write_reports(
    store,
    run_dir: Path,
    missing: list[int],
    *,
    html: bool,
    steps: dict | None = None,
    samples: Checkpoint | None = None,
    deadline: float | None = None,
    unstored: Unstored | None = None,
) -> Outcome:
    """Build the summary and write the report files into ``run_dir``; when they cannot be
    written (``OSError``: a full disk), the outcome has the summary's text and the error.

    The summary (``final_summary.json`` and ``.txt``) is always written: what it reads is
    bounded per rank (above), so its time grows with the ranks, not the run. The HTML report
    is drawn only when they are written at most :data:`HTML_AFTER_DEADLINE_S` past
    ``deadline`` (``time.monotonic()``, None: none; a partial summary comes after the budget
    was spent waiting for ranks): later, one line says it was left out (``traceml view
    RUN_DIR --html PATH`` draws it from the summary), and the finalization ends before node
    0's launcher stops waiting for it.

    Args:
        store: the run's store.
        run_dir: where the files go.
        missing: ranks finalization gave up on.
        html: also write ``final_summary.html`` (unless late: see above).
        steps: the ranks' steps from the live aggregates
            (:meth:`traceml_aggregator.live.LiveAggregates.final_steps`); None reads every
            stored step from ``store`` instead (O(stored steps)).
        samples: the live aggregates' checkpoint (on ``store``'s thread): the samples are
            its bounded series (:meth:`~traceml_aggregator.checkpoint.Checkpoint.with_samples`),
            advanced first over the sample rows stored since it (O(those rows)); None reads
            every stored sample instead (O(stored samples)).
        deadline: the finalization's deadline (see above).
        unstored: what the store may lack (:func:`with_unstored`); None: nothing.
    """
    if samples is not None:
        samples.advance_windows(store)
        run = load.load(
            store,
            missing,
            steps=steps is None,
            samples=False,
            sampled_ranks=samples.sampled_ranks(),
        )
        run = samples.with_samples(run)
    else:
        run = load.load(store, missing, steps=steps is None)
    if steps is not None:
        run = with_steps(run, steps)
    if unstored is not None:
        run = with_unstored(run, unstored)
    summary = build_summary(run)
    text = render_text(summary)
    outcome = Outcome(missing, text=text, run_status=summary["run"]["status"])
    path = run_dir / SUMMARY_JSON_NAME
    try:
        write_atomic(path, to_json(summary))
        outcome.json_path, path = path, run_dir / SUMMARY_TEXT_NAME
        write_atomic(path, text)
        outcome.text_path, path = path, run_dir / SUMMARY_HTML_NAME
        if html and deadline is not None and time.monotonic() > deadline + HTML_AFTER_DEADLINE_S:
            _log.warning(
                f"warning: {SUMMARY_HTML_NAME} left out: the summary was written more than "
                f"{HTML_AFTER_DEADLINE_S:g} s past the finalization's deadline (traceml view "
                f"{run_dir} --html PATH draws it)"
            )
        elif html:
            from traceml.report.html import render_html

            write_atomic(path, render_html(summary))
            outcome.html_path = path
    except OSError as exc:  # a full disk: the text still goes to node 0's launcher
        outcome.error = f"{path} not written ({exc.strerror})"
    return outcome
