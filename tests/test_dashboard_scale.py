"""The dashboard at scale, in headless Chromium: 1,024 simulated ranks (every rank's batches
pushed straight to a real aggregator over gRPC: benchmarks/simulated_world.py), rank 737 a
planted input straggler. The heatmap's row of rank 737 is the hottest colour and labelled, the
band's first line is rank 737, the table (sorted by input %, the verdict's figure) starts with
it, the search box finds a rank and a node, and the node view has one row per node.

A screenshot is saved in ``$TRACEML_TEST_ARTIFACTS`` (else the test's tmp dir); with
``TRACEML_UPDATE_DOCS=1`` it also replaces docs/dashboard-1024.png. Skipped when no Chromium is
installed (Debian: ``apt-get install chromium``).
"""

from __future__ import annotations

import json
import os
import shutil
import time

import pytest
from chromium import BROWSER_MARKS, DevTools
from conftest import ROOT, free_port
from helpers.waiting import wait_for
from live_aggregator import LiveAggregator
from simulated_world import (  # benchmarks/, on the path through live_aggregator
    push,
    rank_batches,
)

pytestmark = [pytest.mark.aggregator, *BROWSER_MARKS]

WORLD = 1024
SLOW = 737
WIDTH = 1400
#: The YlOrRd ends of the heatmap's scale (traceml.report.grid.COLORS), RGB.
HOTTEST, COOLEST = (128, 0, 38), (255, 255, 204)

LOOK = """JSON.stringify({
  verdict: document.getElementById('verdict').dataset.kind || null,
  heat: {...document.getElementById('heat-canvas').dataset},
  band: document.getElementById('chart-band').dataset.labels || '',
  table: [...document.querySelectorAll('#ranks tr[data-rank]')].map(r => +r.dataset.rank),
  top: [...document.querySelectorAll('#ranks tr.top')].map(r => +r.dataset.rank),
  steps_hidden: document.getElementById('chart-steps').closest('section').hidden,
  metric: state.frame && state.frame.scale ? state.frame.scale.metric : null,
  frames: +(document.body.dataset.frames || 0),
})"""

#: The mean colour (RGB) of the heatmap's pixel row through rank R (rows in rank order).
ROW_COLOUR = """((rank) => {
  const c = document.getElementById('heat-canvas'),
    [x, y0, w, h] = c.dataset.plot.split(',').map(Number);
  const y = Math.floor(y0 + (rank + 0.5) * h / +c.dataset.rows);
  const d = c.getContext('2d').getImageData(x, y, w, 1).data, sum = [0, 0, 0];
  for (let i = 0; i < d.length; i += 4) for (let j = 0; j < 3; j++) sum[j] += d[i + j];
  return sum.map(v => Math.round(v / (d.length / 4)));
})(%d)"""


def _look(chrome: DevTools, page: str) -> dict:
    return json.loads(chrome.evaluate(page, LOOK))


def _requested(chrome: DevTools) -> list[str]:
    return [
        e["params"]["request"]["url"]
        for e in chrome.events
        if e.get("method") == "Network.requestWillBeSent"
    ]


def _search(chrome: DevTools, page: str, text: str) -> list[int]:
    chrome.evaluate(
        page,
        f"""(() => {{ const s = document.getElementById('rank-search');
      s.value = {json.dumps(text)}; s.dispatchEvent(new Event('input')); }})()""",
    )
    return _look(chrome, page)["table"]


def _near(colour: list[int], expected: tuple[int, int, int], within: int = 16) -> bool:
    return all(abs(a - b) <= within for a, b in zip(colour, expected, strict=True))


def test_1024_ranks_the_scale_views_show_the_planted_straggler(tmp_path):
    port = free_port()
    start_us = int(time.time() * 1e6)
    agg = LiveAggregator(
        tmp_path / "run", "scale", world_size=WORLD, extra_args=("--dashboard-port", str(port))
    )
    with agg:
        push(agg.target, rank_batches("scale", WORLD, range(128), 1, SLOW, start_us))
        chrome = DevTools(tmp_path / "profile")
        try:
            page = chrome.open_page(
                f"http://127.0.0.1:{port}/?token={os.environ['TRACEML_RUN_TOKEN']}", WIDTH
            )
            wait_for(
                lambda: _look(chrome, page)["verdict"] == "INPUT_STRAGGLER",
                240,
                "the live verdict on the page",
                poll_s=0.5,
            )
            look = _look(chrome, page)
            assert look["steps_hidden"] is True  # the band replaces one line per rank
            assert look["heat"]["rows"] == str(WORLD)
            assert look["heat"]["labels"].split("|")[0] == f"rank {SLOW}"
            assert look["band"].split("|")[:4] == ["min", "median", "max", f"rank {SLOW}"]
            assert look["table"][0] == SLOW and len(look["table"]) == 50
            assert look["top"][0] == SLOW and len(look["top"]) == 8
            slow_row = chrome.evaluate(page, ROW_COLOUR % SLOW)
            assert _near(slow_row, HOTTEST), slow_row
            for rank in (0, 100, 738, 1023):  # 738: the next pixel row (736 shares 737's)
                assert _near(chrome.evaluate(page, ROW_COLOUR % rank), COOLEST), rank

            png = tmp_path / "dashboard-1024.png"
            chrome.screenshot(page, png, WIDTH)
            artifacts = os.environ.get("TRACEML_TEST_ARTIFACTS")
            if artifacts:
                shutil.copyfile(png, os.path.join(artifacts, png.name))
            if os.environ.get("TRACEML_UPDATE_DOCS") == "1":
                shutil.copyfile(png, ROOT / "docs" / png.name)
            print(f"screenshot for review: {png}")

            assert _search(chrome, page, "42") == [42]
            node = _search(chrome, page, "node 92")  # sorted by input %: rank 737 first
            assert node[0] == SLOW and sorted(node) == list(range(736, 744)), node
            assert sorted(_search(chrome, page, "node5")) == list(range(40, 48))
            assert sorted(_search(chrome, page, "de127")) == list(range(1016, 1024))  # a host
            assert len(_search(chrome, page, "ode1")) == 50  # 39 hosts' 312 ranks: 50 shown
            assert _search(chrome, page, "")[0] == SLOW
            chrome.evaluate(
                page,
                """(() => { const s = document.getElementById('heat-rows');
              s.value = 'nodes'; s.dispatchEvent(new Event('change')); })()""",
            )
            nodes = _look(chrome, page)["heat"]
            assert nodes["rows"] == str(WORLD // 8)
            assert nodes["labels"].split("|")[0] == f"node {SLOW // 8}"

            # Another figure: a new event stream, whose frames hold that figure's grid.
            chrome.evaluate(
                page,
                """(() => { const s = document.getElementById('metric');
              s.value = 'input_wait'; s.dispatchEvent(new Event('change')); })()""",
            )
            wait_for(
                lambda: _look(chrome, page)["metric"] == "input_wait",
                120,
                "the input wait heatmap",
                poll_s=0.5,
            )
            look = _look(chrome, page)
            assert look["heat"]["labels"].split("|")[0] == f"node {SLOW // 8}"
            assert look["band"].split("|")[:4] == ["min", "median", "max", f"rank {SLOW}"]
            streams = [u for u in _requested(chrome) if "/api/events?" in u]
            assert [u.split("token=")[1].split("&")[1:] for u in streams] == [
                [],
                ["metric=input_wait"],
            ]
        finally:
            chrome.close()
