"""The report files of a run, built from its store: ``final_summary.json``, ``.txt``, ``.html``.

:func:`write_reports` runs at finalization, on the aggregator's writer thread (the live views
and ``traceml.summary()`` are answered from :mod:`traceml_aggregator.live` instead).
"""

from __future__ import annotations

from pathlib import Path

from traceml.analysis.summary import build_summary
from traceml.core.rundir import (
    SUMMARY_HTML_NAME,
    SUMMARY_JSON_NAME,
    SUMMARY_TEXT_NAME,
    write_atomic,
)
from traceml.report import to_json
from traceml.report.text import render_text
from traceml_aggregator import load
from traceml_aggregator.finalize import Outcome


def write_reports(store, run_dir: Path, missing: list[int], *, html: bool) -> Outcome:
    """Build the summary from ``store`` and write the report files into ``run_dir``."""
    summary = build_summary(load.load(store, missing))
    text = render_text(summary)
    outcome = Outcome(missing, text=text)
    outcome.json_path = run_dir / SUMMARY_JSON_NAME
    write_atomic(outcome.json_path, to_json(summary))
    outcome.text_path = run_dir / SUMMARY_TEXT_NAME
    write_atomic(outcome.text_path, text)
    if html:
        from traceml.report.html import render_html

        outcome.html_path = run_dir / SUMMARY_HTML_NAME
        write_atomic(outcome.html_path, render_html(summary))
    return outcome
