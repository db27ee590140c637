"""The scale views' data, exact: the rank x step grid (traceml/report/grid.py), the
dashboard frame's ``scale`` above SCALE_RANKS ranks (none below), and the figure a viewer asks
for (``?metric=``) on a real socket. In a browser at 1,024 ranks:
tests/test_dashboard_scale.py."""

from __future__ import annotations

import asyncio
import base64
import json

import aiohttp
import numpy as np
from conftest import free_port
from rundata_factory import identity

from traceml.analysis.rundata import RankData, RunData, StepTable
from traceml.report import grid
from traceml_aggregator.dashboard import app as dashboard_app
from traceml_aggregator.dashboard.frames import Cursor, Snapshot

WORLD = grid.SCALE_RANKS + 8  # 40 ranks: above the threshold
SLOW = 29


def _run(world: int, slow: int | None = SLOW, steps: int = 20) -> RunData:
    """``world`` ranks of ``steps`` steps of 10 ms (input wait 1 ms), 4 ranks a node; rank
    ``slow`` waits 5 ms more for its input (15 ms steps); rank 3 has no step after step 9."""
    ranks = {}
    for r in range(world):
        extra = 5000 if r == slow else 0
        last = 9 if r == 3 else steps - 1
        ranks[r] = RankData(
            r,
            identity=identity(r, node=r // 4, hostname=f"h{r // 4}", start_unix_us=None),
            steps=StepTable.from_dicts(
                {
                    "step": s,
                    "end_us": 20_000 * (s + 1),
                    "step_us": 10_000 + extra,
                    "input_wait_us": 1000 + extra,
                    "forward_us": 3000,
                    "backward_us": 4000,
                    "optimizer_us": 1000,
                }
                for s in range(last + 1)
            ),
        )
    return RunData("r", world, ranks, {}, {}, {}, [])


def test_grid_columns_band_slowest_and_levels():
    g = grid.from_series(
        {0: ([0, 1, 2, 3, 4], [10, 12, 10, 12, 20]), 1: ([2, 3, 4], [30, None, 30]), 2: ([], [])},
        columns=2,
    )
    assert (g.ranks, g.first_step, g.bin_steps, g.columns) == ([0, 1, 2], 0, 3, 2)
    assert g.column_steps() == [0, 3]
    # rank 0: steps 0-2 -> 32/3, steps 3-4 -> 16; rank 1: step 2 -> 30, step 4 (3 is None) -> 30
    assert g.row(0) == [round(32 / 3, 3), 16.0] and g.row(1) == [30.0, 30.0]
    assert g.row(2) == [None, None]
    assert g.band() == {
        "min": [round(32 / 3, 3), 16.0],
        "median": [round(61 / 3, 3), 23.0],
        "max": [30.0, 30.0],
    }
    assert g.slowest(5) == [1, 0]
    lo, hi = g.scale()  # the lowest and highest rank medians: (32/3 + 16) / 2 and 30
    assert (round(lo, 6), hi) == (round((32 / 3 + 16) / 2, 6), 30.0)
    levels = list(g.levels())
    assert levels[0:2] == [1, 1 + round((16 - lo) / (hi - lo) * 254)]  # 32/3 < lo: clipped
    assert levels[2:4] == [255, 255] and levels[4:6] == [0, 0]


def test_balanced_ranks_keep_a_tenth_of_the_scale():
    g = grid.from_series({0: ([0], [10.0]), 1: ([0], [10.1])})
    assert g.scale() == (10.1 * 0.9, 10.1)


def test_frame_scale_names_the_slow_rank_above_the_threshold_only():
    frame = Snapshot(_run(WORLD), None, live=True, version=1).frame(Cursor())
    s = frame["scale"]
    assert frame["metrics"] == ["step", "input_wait", "forward", "backward", "optimizer"]
    assert s["metric"] == "step" and s["ranks"] == list(range(WORLD))
    assert s["nodes"] == [r // 4 for r in range(WORLD)]
    assert (s["first_step"], s["bin_steps"], s["columns"]) == (0, 1, 20)
    assert s["slowest"][0] == SLOW and len(s["slowest"]) == grid.SLOWEST_RANKS
    assert (s["lo_ms"], s["hi_ms"]) == (10.0, 15.0)
    assert s["lines"][str(SLOW)] == [15.0] * 20
    assert s["band"] == {
        "step": list(range(20)),
        "min": [10.0] * 20,
        "median": [10.0] * 20,
        "max": [15.0] * 20,
    }
    cells = np.frombuffer(base64.b64decode(s["cells"]), np.uint8).reshape(WORLD, 20)
    assert set(cells[SLOW]) == {255} and set(cells[0]) == {1}
    assert list(cells[3]) == [1] * 10 + [0] * 10  # no steps after 9: no colour
    # the charted ranks: the slowest first (no verdict here)
    assert frame["charted_ranks"][0] == SLOW
    # live phase shares: through step 9, the last step every rank completed
    assert frame["phases"]["step"] == list(range(10))
    below = Snapshot(_run(grid.SCALE_RANKS), None, live=True, version=1).frame(Cursor())
    assert below["scale"] is None and below["metrics"] == []


def test_a_viewer_picks_the_figure_and_the_encoded_frame_is_the_frame():
    snapshot = Snapshot(_run(WORLD), None, live=False, version=1)
    frame = snapshot.frame(Cursor(metric="input_wait"))
    assert frame["scale"]["metric"] == "input_wait"
    assert (frame["scale"]["lo_ms"], frame["scale"]["hi_ms"]) == (1.0, 6.0)
    encoded = json.loads(snapshot.encode(Cursor(metric="input_wait"), full=True))
    assert encoded == {**frame, "full": True}
    unknown = snapshot.frame(Cursor(metric="nothing"))
    assert unknown["scale"]["metric"] == "step"
    assert frame["phases"]["step"] == list(range(20))  # a stored run: every step


class _StoredScaleRun:
    """A source (the dashboard's three-call boundary) over a fixed 40-rank run."""

    live = False

    def version(self) -> int:
        return 0

    async def snapshot(self, summary: dict | None, version: int) -> Snapshot:
        return Snapshot(_run(WORLD), summary, live=False, version=version)

    async def summary(self) -> None:
        return None


def test_http_frame_and_stream_carry_the_asked_figure():
    token, port = "the-token", free_port()
    base = f"http://127.0.0.1:{port}"

    async def main() -> tuple[dict, dict, dict]:
        runner = await dashboard_app.start(_StoredScaleRun(), "127.0.0.1", port, token)
        try:
            async with aiohttp.ClientSession() as session:
                async with session.get(f"{base}/api/frame?token={token}") as reply:
                    default = await reply.json()
                async with session.get(f"{base}/api/frame?token={token}&metric=forward") as reply:
                    forward = await reply.json()
                url = f"{base}/api/events?token={token}&metric=input_wait"
                async with session.get(url) as reply:
                    async for line in reply.content:
                        if line.startswith(b"data: "):
                            streamed = json.loads(line[len(b"data: ") :])
                            break
        finally:
            await runner.cleanup()
        return default, forward, streamed

    default, forward, streamed = asyncio.run(main())
    assert default["scale"]["metric"] == "step" and default["scale"]["slowest"][0] == SLOW
    assert forward["scale"]["metric"] == "forward"
    assert (forward["scale"]["lo_ms"], forward["scale"]["hi_ms"]) == (2.7, 3.0)  # all 3 ms
    assert streamed["full"] is True and streamed["scale"]["metric"] == "input_wait"
    assert streamed["scale"]["slowest"][0] == SLOW and streamed["scale"]["hi_ms"] == 6.0
