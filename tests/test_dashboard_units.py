"""The dashboard's parts, with exact values: its frames (traceml_aggregator/dashboard/frames.py:
what a viewer gets first, then only what is new), its HTTP server on a real socket (the token,
the data endpoint, the event stream), and the read-only store of ``traceml view --serve``.
The whole of it in a browser on a real run: tests/test_dashboard.py."""

from __future__ import annotations

import asyncio
import json
import subprocess

import aiohttp
import pytest
from conftest import SCRIPTS, assert_rejected, free_port, traceml_env
from helpers.aggregator import aggregator_cmd, listening_port
from helpers.waiting import LOADED_CALL_S
from rundata_factory import identity, node_exit

from traceml.analysis.rundata import RankData, RunData, StepTable
from traceml_aggregator.dashboard import app as dashboard_app
from traceml_aggregator.dashboard import frames
from traceml_aggregator.dashboard.frames import Cursor, Snapshot
from traceml_aggregator.dashboard.sources import StoredSource
from traceml_aggregator.store import Store, StoreUnavailable

START_US = 1_700_000_000_000_000


def _steps(first: int, last: int, input_us: int = 1000) -> StepTable:
    return StepTable.from_dicts(
        {
            "step": s,
            "end_us": 10_000 * (s + 1),
            "step_us": 10_000,
            "input_wait_us": input_us,
            "forward_us": 3000,
            "backward_us": 4000,
            "optimizer_us": 1000,
        }
        for s in range(first, last + 1)
    )


def _run(last_step: int, restart: int = 0, with_exit: bool = False) -> RunData:
    ranks = {}
    for r in (0, 1):
        ranks[r] = RankData(
            r,
            restart=restart,
            identity=identity(r, hostname="h0", start_unix_us=START_US),
            steps=_steps(0, last_step, 1000 + 4000 * r),
            process_samples=[
                {
                    "rank": r,
                    "restart": restart,
                    "unix_us": START_US + 1_000_000 * i,
                    "cpu_percent": 50.0,
                    "rss_bytes": 2**30,
                    "gpu_allocated_bytes": None,
                }
                for i in range(3)
            ],
        )
    system = {
        0: [
            {
                "node_rank": 0,
                "unix_us": START_US + 1_000_000 * i,
                "hostname": "h0",
                "cpu_percent": 40.0 + i,
                "gpu_unavailable_reason": "no NVIDIA driver",
            }
            for i in range(2)
        ]
    }
    exits = {0: node_exit(0)} if with_exit else {}
    return RunData("r", 2, ranks, exits, system, {}, [])


SUMMARY = {
    "run": {"status": "running"},
    "primary_diagnosis": {
        "kind": "INPUT_STRAGGLER",
        "severity": "warning",
        "summary": "s",
        "action": "a",
        "ranks": [1],
        "evidence": {},
    },
    "findings": {
        "system": [
            {
                "kind": "HIGH_CPU",
                "severity": "warning",
                "summary": "c",
                "action": "d",
                "ranks": [],
                "nodes": [0],
            }
        ]
    },
    "ranks": [
        {
            "rank": r,
            "step_time_ms": {"median": 10.0, "p95": 10.0},
            "phase_share_pct": {"input_wait": 10.0 + 40 * r},
        }
        for r in (0, 1)
    ],
}


def test_first_frame_holds_everything_then_only_what_is_new():
    cursor = Cursor()
    first = Snapshot(_run(9), SUMMARY, live=False, version=1).frame(cursor)
    assert first["steps"]["1"]["step"] == list(range(10))
    # Summed over both ranks: steps 20 ms, input 1 + 5 ms, forward 2 x 3 ms, backward 2 x 4 ms,
    # optimizer 2 x 1 ms, residual 1 ms (rank 0; rank 1's phases fill its step); no H2D, no comm.
    assert first["phases"] == {
        "step": list(range(10)),
        "input_wait": [30.0] * 10,
        "h2d": [None] * 10,
        "forward": [30.0] * 10,
        "backward": [40.0] * 10,
        "optimizer": [10.0] * 10,
        "comm": [None] * 10,  # no collective recorded
        "residual": [5.0] * 10,
    }
    assert first["charted_ranks"] == [1, 0]  # the verdict's rank first
    assert first["steps"]["0"]["step_ms"] == [10.0] * 10
    assert first["steps"]["0"]["reset"] is False
    assert first["memory"]["0"]["t"] == [START_US / 1e6 + i for i in range(3)]
    assert first["memory"]["0"]["rss_bytes"] == [2**30] * 3
    assert first["system"]["0"] == {
        "t": [START_US / 1e6, START_US / 1e6 + 1],
        "cpu_percent": [40.0, 41.0],
        "gpu_util_percent": [None, None],
    }
    assert first["verdict"] == {
        "kind": "INPUT_STRAGGLER",
        "severity": "warning",
        "summary": "s",
        "action": "a",
        "ranks": [1],
    }
    assert [f["kind"] for f in first["findings"]] == ["HIGH_CPU"]
    assert [(r["rank"], r["steps"], r["input_pct"], r["state"]) for r in first["ranks"]] == [
        (0, 10, 10.0, "running"),
        (1, 10, 50.0, "running"),
    ]
    assert first["nodes"][0]["ranks"] == [0, 1]
    assert first["nodes"][0]["gpu_note"] == "no NVIDIA driver"
    assert first["nodes"][0]["state"] == "no exit report"  # stored, and no exit reported

    later = Snapshot(_run(14, with_exit=True), SUMMARY, live=False, version=2).frame(cursor)
    assert later["steps"]["0"]["step"] == [10, 11, 12, 13, 14]
    assert later["phases"]["step"] == [10, 11, 12, 13, 14]
    assert later["memory"] == {} and later["system"] == {}  # no new samples
    assert later["nodes"][0]["state"] == "exited 0"
    assert Snapshot(_run(14), None, live=True, version=3).frame(cursor)["steps"] == {}


def test_live_phase_shares_wait_for_every_rank_and_ranks_beyond_the_charted_are_not_sent():
    run = _run(9)
    run.ranks[0].steps = _steps(0, 6)  # rank 0 is behind: steps 7-9 are rank 1's only
    for r in range(2, 2 + frames.MAX_CHART_RANKS):
        run.ranks[r] = RankData(r, steps=_steps(0, 9))
    frame = Snapshot(run, None, live=True, version=1).frame(Cursor())
    assert frame["phases"]["step"] == list(range(7))
    assert frame["charted_ranks"] == list(range(frames.MAX_CHART_RANKS))
    assert sorted(map(int, frame["steps"])) == list(range(frames.MAX_CHART_RANKS))
    assert len(frame["ranks"]) == 2 + frames.MAX_CHART_RANKS  # the table shows every rank
    stored = Snapshot(run, None, live=False, version=1).frame(Cursor())
    assert stored["phases"]["step"] == list(range(10))  # a stored run gets no more steps


def test_a_new_attempt_starts_the_rank_over():
    cursor = Cursor()
    Snapshot(_run(9), None, live=True, version=1).frame(cursor)
    frame = Snapshot(_run(3, restart=1), None, live=True, version=2).frame(cursor)
    assert frame["steps"]["0"]["reset"] is True and frame["steps"]["0"]["step"] == [0, 1, 2, 3]
    assert frame["memory"]["0"]["reset"] is True and len(frame["memory"]["0"]["t"]) == 3
    assert frame["verdict"] is None and frame["findings"] == []


def test_long_series_are_thinned_keeping_the_last_point():
    n = 3 * frames.MAX_POINTS + 2
    run = _run(n - 1)
    frame = Snapshot(run, None, live=False, version=1).frame(Cursor())
    assert frame["steps"]["0"]["step"] == list(range(0, n, 4)) + [n - 1]  # every 4th, the last
    assert len(frame["steps"]["0"]["step_ms"]) == len(range(0, n, 4)) + 1 <= frames.MAX_POINTS


class GrowingRun:
    """A source (the dashboard's three-call boundary) over a hand-built run whose ranks gain
    ``grow()`` steps at a time, as the live aggregates' windows do."""

    live = True

    def __init__(self) -> None:
        self.last_step = 9
        self._version = 1

    def grow(self, steps: int) -> None:
        self.last_step += steps
        self._version += 1

    def version(self) -> int:
        return self._version

    async def snapshot(self, summary: dict | None, version: int) -> Snapshot:
        return Snapshot(_run(self.last_step), summary, live=True, version=version)

    async def summary(self) -> dict:
        return SUMMARY


async def _events(session, url: str, count: int) -> list[dict]:
    """The first ``count`` frames of the event stream at ``url``."""
    out = []
    async with session.get(url) as reply:
        assert reply.status == 200 and reply.headers["Content-Type"] == "text/event-stream"
        async for line in reply.content:
            if line.startswith(b"data: "):
                out.append(json.loads(line[len(b"data: ") :]))
                if len(out) == count:
                    return out


def test_http_token_frame_and_event_stream():
    source, token, port = GrowingRun(), "the-token", free_port()
    base = f"http://127.0.0.1:{port}"

    async def main():
        runner = await dashboard_app.start(source, "127.0.0.1", port, token)
        try:
            async with aiohttp.ClientSession() as session:
                for path in ("/", "/api/frame", "/api/events", "/static/../api/frame", "/x"):
                    for query in ("", "?token=", "?token=the-toke", "?token=the-token2"):
                        async with session.get(base + path + query) as reply:
                            assert reply.status == 401, (path, query)
                            assert await reply.text() == dashboard_app.UNAUTHORIZED
                async with session.get(
                    f"{base}/api/frame", headers={"Authorization": f"Bearer {token}"}
                ) as reply:
                    frame = await reply.json()
                assert frame["steps"]["0"]["step"] == list(range(10))
                async with session.get(f"{base}/?token={token}") as reply:
                    assert reply.status == 200 and "/static/dashboard.js" in await reply.text()
                stream = asyncio.create_task(
                    _events(session, f"{base}/api/events?token={token}", 2)
                )
                await asyncio.sleep(3 * dashboard_app.REFRESH_S)  # no change: no frame
                assert not stream.done()
                source.grow(3)
                first, second = await asyncio.wait_for(stream, LOADED_CALL_S)
            assert first["full"] is True and first["steps"]["1"]["step"] == list(range(10))
            assert second["full"] is False and second["steps"]["1"]["step"] == [10, 11, 12]
            assert second["verdict"]["kind"] == "INPUT_STRAGGLER"
        finally:
            await runner.cleanup()

    asyncio.run(main())


def test_a_stored_run_is_read_only_and_a_held_store_is_refused(tmp_path):
    writer = Store(tmp_path / "telemetry.sqlite")
    writer.set_meta("run_name", "held")
    with pytest.raises(StoreUnavailable) as refused:
        StoredSource(tmp_path)  # a running aggregator holds its store
    assert str(refused.value) == (
        f"{tmp_path / 'telemetry.sqlite'} is locked: another aggregator holds it (a live run's "
        "store)"
    )
    writer.close()
    before = (tmp_path / "telemetry.sqlite").read_bytes()
    source = StoredSource(tmp_path)
    snapshot = asyncio.run(source.snapshot(None, source.version()))
    assert snapshot.tables["run"]["run_name"] == "held" and source.version() == 0
    assert (tmp_path / "telemetry.sqlite").read_bytes() == before


@pytest.fixture
def busy_port():
    """A port something listens on (127.0.0.1)."""
    with listening_port() as port:
        yield port


@pytest.mark.torchrun
def test_traceml_run_refuses_a_dashboard_port_it_cannot_have(tmp_path, busy_port):
    port = str(free_port())
    base = [str(SCRIPTS / "faulty_ddp.py"), "--aggregator-port", port, "--mode", "dashboard"]
    for flags, expected in (
        (
            ["--dashboard-port", str(busy_port)],
            f"dashboard port 127.0.0.1:{busy_port} is not available (already in use); pick "
            "another with --dashboard-port",
        ),
        (["--dashboard-port", "70000"], "--dashboard-port must be a TCP port, 1-65535 (got 70000)"),
        (
            ["--dashboard-port", port],
            f"--dashboard-port {port} is also the aggregator's or the rendezvous port",
        ),
    ):
        case = tmp_path / flags[1]
        case.mkdir()
        assert_rejected(case, base + flags, expected, marker=port)


@pytest.mark.aggregator
def test_the_aggregator_refuses_a_dashboard_port_in_use(tmp_path, busy_port):
    result = subprocess.run(
        aggregator_cmd(
            tmp_path / "run", "r", "--port", str(free_port()), "--dashboard-port", str(busy_port)
        ),
        env=traceml_env(),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert result.stderr.splitlines()[-1].startswith(
        f"traceml-aggregator: error: cannot serve the dashboard on 127.0.0.1:{busy_port}: "
    ), result.stderr


@pytest.mark.parametrize(
    "header, token",
    [
        ("Bearer abc", "abc"),
        ("bearer abc", "abc"),  # RFC 7235: the scheme's name in any case
        ("BEARER abc", "abc"),
        ("Basic abc", None),
        ("abc", None),
        (None, None),
    ],
)
def test_the_bearer_token_of_an_authorization_header(header, token):
    from traceml_aggregator.auth import bearer

    assert bearer(header) == token


def test_the_pages_phases_are_the_phase_tables_parts():
    """dashboard.js draws the step's parts with its own list (name, label, colour): the phase
    table's PARTS, in order, so that a phase added to the table is drawn live too."""
    import re
    from pathlib import Path

    from traceml.core.phases import PARTS
    from traceml_aggregator import dashboard

    js = (Path(dashboard.__file__).parent / "static" / "dashboard.js").read_text()
    listed = js[js.index("const PHASES = [") : js.index("];", js.index("const PHASES = ["))]
    drawn = re.findall(r'\["(\w+)", "([^"]+)", "(#[0-9a-f]{6})"\]', listed)
    assert drawn == [(p.name, p.label, p.color) for p in PARTS]
