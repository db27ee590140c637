"""The report files: ``final_summary.json``, ``.txt`` and ``.html``, written and read back.

:func:`write_reports` runs at finalization and :func:`summarize_live` answers
``traceml.summary()`` (both on the aggregator's writer thread); :func:`read_summary` loads a
saved summary for ``traceml view`` and ``traceml compare``.
"""

from __future__ import annotations

import json
from pathlib import Path

from traceml.launcher.rundir import (
    SUMMARY_HTML_NAME,
    SUMMARY_JSON_NAME,
    SUMMARY_TEXT_NAME,
    write_atomic,
)
from traceml_aggregator import rundata
from traceml_aggregator.analysis.summary import SCHEMA_VERSION, build_summary
from traceml_aggregator.finalize import Outcome
from traceml_aggregator.report.text import render_text



class SummaryFileError(ValueError):
    """A file is not a readable TraceML summary of a version this TraceML understands."""


def to_json(document: dict) -> str:
    """A report document as written to disk (indented, UTF-8 text, trailing newline)."""
    return json.dumps(document, indent=2, ensure_ascii=False) + "\n"


def write_reports(store, run_dir: Path, missing: list[int], *, html: bool) -> Outcome:
    """Build the summary from ``store`` and write the report files into ``run_dir``."""
    summary = build_summary(rundata.load(store, missing))
    text = render_text(summary)
    outcome = Outcome(missing, text=text)
    outcome.json_path = run_dir / SUMMARY_JSON_NAME
    write_atomic(outcome.json_path, to_json(summary))
    outcome.text_path = run_dir / SUMMARY_TEXT_NAME
    write_atomic(outcome.text_path, text)
    if html:
        from traceml_aggregator.report.html import render_html

        outcome.html_path = run_dir / SUMMARY_HTML_NAME
        write_atomic(outcome.html_path, render_html(summary))
    return outcome


def summarize_live(store) -> tuple[dict[str, float], dict[str, str]]:
    """The verdict over what ``store`` holds so far, flat (see :mod:`.flat`); writes nothing."""
    from traceml_aggregator.report.flat import flatten

    return flatten(build_summary(rundata.load(store, []), live=True))


def read_summary(path: str | Path) -> dict:
    """A saved ``final_summary.json`` (or a run directory holding one).

    Raises:
        SummaryFileError: missing, not JSON, not a summary, or of another schema version.
    """
    path = Path(path)
    if path.is_dir():
        path = path / SUMMARY_JSON_NAME
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise SummaryFileError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SummaryFileError(f"{path}: not a JSON file ({exc})") from None
    if not isinstance(document, dict) or "primary_diagnosis" not in document:
        raise SummaryFileError(f"{path}: not a TraceML summary (no primary_diagnosis)")
    if document.get("schema_version") != SCHEMA_VERSION:
        raise SummaryFileError(
            f"{path}: summary schema version {document.get('schema_version')!r}; this TraceML "
            f"reads version {SCHEMA_VERSION}"
        )
    return document
