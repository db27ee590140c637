"""The report formats of a summary: JSON on disk (:func:`to_json`, :func:`read_summary`), text,
HTML, the flat live view and ``compare``.

Pure functions of a summary document: the aggregator writes the files at finalization
(:mod:`traceml_aggregator.reports`), and ``traceml view`` and ``traceml compare`` read them back.
"""

from __future__ import annotations

import json
from pathlib import Path

from traceml.analysis.document import SCHEMA_VERSION
from traceml.core.rundir import SUMMARY_JSON_NAME


class SummaryFileError(ValueError):
    """A file is not a readable TraceML summary of a version this TraceML understands."""


def to_json(document: dict) -> str:
    """A report document as written to disk (indented, UTF-8 text, trailing newline)."""
    return json.dumps(document, indent=2, ensure_ascii=False) + "\n"


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
