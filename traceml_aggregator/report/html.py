"""``final_summary.html``: one self-contained page (inline CSS, no scripts, no network)."""

from __future__ import annotations

import html


def render_html(summary: dict) -> str:
    """The HTML report of a summary document."""
    from traceml_aggregator.report.text import render_text

    body = html.escape(render_text(summary))
    title = html.escape(f"TraceML summary: {summary['run']['run_name']}")
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{title}</title>"
        "<style>body{font-family:monospace}</style></head>"
        f"<body><pre>{body}</pre></body></html>\n"
    )
