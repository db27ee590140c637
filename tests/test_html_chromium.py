"""final_summary.html in headless Chromium: it loads with no network request but the page
itself, no failed request, no script, and a full-page screenshot is written for review.

Chromium is driven over the DevTools protocol (tests/chromium.py), so the test sees every
request the page makes. Skipped when no Chromium is installed (Debian: ``apt-get install
chromium``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from chromium import CHROMIUM, DevTools
from rundata_factory import rich_run

from traceml.analysis.summary import build_summary
from traceml.report.html import render_html

pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed")

#: Viewport width of the screenshots, CSS px.
WIDTH = 1000


def load_and_screenshot(html_path: Path, png_path: Path, profile: Path) -> list[dict]:
    """Open ``html_path``; write a full-page PNG; return the page's network events."""
    chrome = DevTools(profile)
    try:
        session = chrome.open_page(html_path.as_uri(), WIDTH)
        chrome.screenshot(session, png_path, WIDTH)
        return [e for e in chrome.events if e.get("method", "").startswith("Network.")]
    finally:
        chrome.close()


def _check_page(html_path: Path, tmp_path: Path, name: str) -> Path:
    html = html_path.read_text()
    assert "<script" not in html.lower() and "http://" not in html and "https://" not in html
    png = tmp_path / f"{name}.png"
    events = load_and_screenshot(html_path, png, tmp_path / f"profile-{name}")
    requested = [
        e["params"]["request"]["url"] for e in events if e["method"] == "Network.requestWillBeSent"
    ]
    failed = [e["params"] for e in events if e["method"] == "Network.loadingFailed"]
    assert requested == [html_path.as_uri()]
    assert failed == []
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    print(f"screenshot for review: {png}")
    return png


@pytest.mark.torchrun
@pytest.mark.browser
@pytest.mark.slow
def test_real_run_report_loads_offline(tmp_path, planted):
    run = planted("input_straggler")
    html = run.run_dir / "final_summary.html"
    text = html.read_text()
    for heading in (
        "Verdict",
        "Step time per rank",
        "Phase breakdown per rank",
        "Memory over the run",
        "Nodes",
        "Rank end states",
    ):
        assert f"<h2>{heading}" in text, heading
    assert "INPUT_STRAGGLER · rank 1" in text
    _check_page(html, tmp_path, "input_straggler")


@pytest.mark.slow
@pytest.mark.browser
def test_gpu_multi_node_report_loads_offline(tmp_path):
    html = tmp_path / "final_summary.html"
    html.write_text(render_html(build_summary(rich_run())))
    text = html.read_text()
    assert text.count("<svg") == 3  # step time, phases, memory
    assert "COMPUTE_STRAGGLER · rank 6" in text and "MEMORY_CREEP" in text
    _check_page(html, tmp_path, "gpu_multi_node")
