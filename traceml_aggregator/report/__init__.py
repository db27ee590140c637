"""The reports written at finalization: ``final_summary.json``, ``.txt`` and ``.html``."""

from __future__ import annotations

import json
import os
from pathlib import Path

from traceml_aggregator import rundata
from traceml_aggregator.analysis.summary import build_summary
from traceml_aggregator.finalize import Outcome
from traceml_aggregator.report.text import render_text

JSON_NAME = "final_summary.json"
TEXT_NAME = "final_summary.txt"
HTML_NAME = "final_summary.html"


def write_atomic(path: Path, content: str) -> None:
    """Write ``content`` to ``path`` through a temporary file and a rename (never half a file)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(content, encoding="utf-8")
    os.replace(tmp, path)


def write_reports(store, run_dir: Path, missing: list[int], *, html: bool) -> Outcome:
    """Build the summary from ``store`` and write the report files into ``run_dir``."""
    summary = build_summary(rundata.load(store, missing))
    text = render_text(summary)
    outcome = Outcome(missing, text=text)
    outcome.json_path = run_dir / JSON_NAME
    write_atomic(outcome.json_path, json.dumps(summary, indent=2, sort_keys=False) + "\n")
    outcome.text_path = run_dir / TEXT_NAME
    write_atomic(outcome.text_path, text)
    if html:
        from traceml_aggregator.report.html import render_html

        outcome.html_path = run_dir / HTML_NAME
        write_atomic(outcome.html_path, render_html(summary))
    return outcome
