"""final_summary.html of a 1,024-rank run in headless Chromium: the same scale views as the
dashboard (the rank x step heatmap and the band over ranks, traceml/report/grid.py) in place of
one line per rank; rank 737, a planted input straggler, is the first label and its row the
hottest colour, the band's slowest line is rank 737, and the page requests nothing but itself.
A full-page screenshot is written for review. Skipped when no Chromium is installed."""

from __future__ import annotations

import json

from chromium import BROWSER_MARKS, DevTools
from rundata_factory import identity

from traceml.analysis.rundata import RankData, RunData, StepTable
from traceml.analysis.summary import build_summary
from traceml.report import grid
from traceml.report.html import render_html

pytestmark = BROWSER_MARKS

WORLD = 1024
SLOW = 737
STEPS = 64
WIDTH = 1000

#: What the test reads of the page: the heatmap's labels, each row group's ranks and fills,
#: the band's legend.
LOOK = """JSON.stringify({
  labels: [...document.querySelectorAll('svg text[data-rank]')].map(t => +t.dataset.rank),
  rows: [...document.querySelectorAll('svg g[data-ranks]')].map(g =>
    [g.dataset.ranks,
     [...new Set([...g.querySelectorAll('rect')].map(r => r.getAttribute('fill')))]]),
  texts: [...document.querySelectorAll('svg text')].map(t => t.textContent),
  headings: [...document.querySelectorAll('h2')].map(h => h.firstChild.textContent.trim()),
})"""


def _run() -> RunData:
    """1,024 ranks, 8 a node, of STEPS steps of about 25 ms; rank SLOW waits 12 ms more for its
    input each step."""
    ranks = {}
    for r in range(WORLD):
        extra = 12_000 if r == SLOW else 0
        ranks[r] = RankData(
            r,
            identity=identity(
                r,
                node=r // 8,
                hostname=f"node{r // 8}",
                world_size=WORLD,
                local_rank=None,
                start_unix_us=None,
                device=None,
            ),
            steps=StepTable.from_dicts(
                {
                    "step": s,
                    "end_us": 40_000 * (s + 1),
                    "step_us": 25_000 + extra + (r * 7 + s * 13) % 400,
                    "input_wait_us": 1000 + extra,
                    "forward_us": 6000,
                    "backward_us": 14000,
                    "optimizer_us": 2000,
                }
                for s in range(STEPS)
            ),
        )
    return RunData("big", WORLD, ranks, {}, {}, {}, [])


def test_1024_rank_report_shows_the_heatmap_and_band_with_the_planted_rank(tmp_path):
    summary = build_summary(_run())
    assert summary["primary_diagnosis"]["kind"] == "INPUT_STRAGGLER"
    assert summary["primary_diagnosis"]["ranks"] == [SLOW]
    html = tmp_path / "final_summary.html"
    html.write_text(render_html(summary))
    text = html.read_text()
    assert "<script" not in text.lower() and "http://" not in text and "https://" not in text
    assert "<h2>Step time per rank" not in text  # no line per rank at this scale

    chrome = DevTools(tmp_path / "profile")
    try:
        page = chrome.open_page(html.as_uri(), WIDTH)
        look = json.loads(chrome.evaluate(page, LOOK))
        png = tmp_path / "report-1024.png"
        chrome.screenshot(page, png, WIDTH)
        requested = [
            e["params"]["request"]["url"]
            for e in chrome.events
            if e.get("method") == "Network.requestWillBeSent"
        ]
    finally:
        chrome.close()
    print(f"screenshot for review: {png}")
    assert requested == [html.as_uri()]
    assert "Step time by rank and step" in look["headings"]
    assert "Spread over ranks" in look["headings"]
    assert look["labels"][0] == SLOW
    # 1,024 ranks in 256 pixel rows of 4 ranks, each the slowest of its ranks
    assert len(look["rows"]) == 256 and look["rows"][0][0] == "0-3"
    by_ranks = dict(look["rows"])
    # the slow rank's row: the two hottest of the 32 colours (its steps within 0.4 ms of its
    # median, the top of the scale); the others': the two coolest
    hottest = {grid.colour(30 / 31), grid.colour(1.0)}
    coolest = {grid.colour(0.0), grid.colour(1 / 31)}
    slow_row = f"{SLOW // 4 * 4}-{SLOW // 4 * 4 + 3}"
    assert set(by_ranks.pop(slow_row)) <= hottest, slow_row
    assert all(set(fills) <= coolest for fills in by_ranks.values())
    legend = look["texts"]
    first_line = legend.index("min") + 1  # the band's legend: max, median, min, the slowest
    assert legend[first_line - 3 : first_line + 1] == ["max", "median", "min", f"rank {SLOW}"]
