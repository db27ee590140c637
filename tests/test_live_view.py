"""The live view's pieces on real wire messages: the compact line (stdout not a terminal), the
rich table (a terminal), stalls, the other nodes' pointer, and the aggregator's rows.

Real runs (tmux, a pipe, two network namespaces) are in tests/test_live_cli.py.
"""

from __future__ import annotations

import io
import re

from rich.console import Console
from rundata_factory import identity

from traceml import wire
from traceml.launcher.terminal_view import (
    MAX_TABLE_ROWS,
    STALL_MIN_S,
    compact_line,
    node0_view_line,
    sparkline,
    stalled,
    table,
)
from traceml_aggregator.live import LiveAggregates
from traceml_aggregator.live.rows import SPARK_STEPS, LiveRows

NOW = 1_800_000_000.0


def rank(
    r: int,
    node: int | None,
    steps: int,
    idle: float | None,
    step_ms: float = 8.0,
    state: str = "running",
    **extra,
) -> wire.LiveRank:
    row = wire.LiveRank(
        rank=r,
        hostname=f"host{node}",
        steps_stored=steps,
        end_state=state,
        phase_median_ms={"input_wait": 0.5, "forward": 3.0},
        **extra,
    )
    if node is not None:
        row.node_rank = node
    if idle is not None:
        row.last_step_unix_s = NOW - idle
    if step_ms is not None:
        row.step_time_ms = step_ms
    return row


def reply(rows, verdict: str = "INPUT_STRAGGLER", **labels) -> wire.SummarizeReply:
    return wire.SummarizeReply(
        metrics={
            "step_time_ms": 8.25,
            "window_steps": 40,
            "input_wait_pct": 6.0,
            "forward_pct": 9.4,
        },
        labels={"verdict": verdict, "severity": "warning", **labels},
        ranks=rows,
        now_unix_s=NOW,
        verdict_summary="Rank 1 input wait: 5.0 ms per step.",
    )


def test_compact_line_names_verdict_shares_and_each_node():
    line = compact_line(
        reply(
            [
                rank(0, 0, 120, 0.4),
                rank(1, 0, 118, 0.25),
                rank(2, 1, 119, 1.5),
                rank(3, 1, 119, 0.0),
            ],
            ranks="1",
        ),
        12.0,
    )
    assert line == (
        "[traceml    12s] INPUT_STRAGGLER (warning) ranks 1 | step 8.2 ms over 40 steps"
        " | input 6% fwd 9% | node 0: ranks 0-1 steps 118-120 idle 0.4s"
        " | node 1: ranks 2-3 steps 119 idle 1.5s"
    )


def test_compact_line_flags_a_stalled_rank_and_counts_an_ended_node():
    line = compact_line(
        reply(
            [
                rank(0, 0, 40, None, state="completed"),
                rank(1, 0, 40, None, state="completed"),
                rank(2, 1, 33, STALL_MIN_S + 4.2),
                rank(5, None, 0, None, step_ms=None),
            ]
        ),
        61.0,
    )
    assert line == (
        "[traceml    61s] INPUT_STRAGGLER (warning) | step 8.2 ms over 40 steps"
        " | input 6% fwd 9% | node 0: ranks 0-1 steps 40 idle -"
        " | node 1: ranks 2 steps 33 idle 14.2s | node -: ranks 5 steps 0 idle -"
        " | STALLED rank 2 14s"
    )


def test_compact_line_before_any_step():
    empty = wire.SummarizeReply(labels={"verdict": "NO_DATA"}, now_unix_s=NOW)
    assert compact_line(empty, 3.0) == "[traceml     3s] waiting for step data (NO_DATA)"
    assert compact_line(wire.SummarizeReply(), 3.0) == (
        "[traceml     3s] waiting for step data (no verdict yet)"
    )


def test_stalled_takes_the_longer_of_the_floor_and_twenty_steps():
    assert not stalled(rank(0, 0, 5, STALL_MIN_S - 0.1), NOW)
    assert stalled(rank(0, 0, 5, STALL_MIN_S + 0.1), NOW)
    assert not stalled(rank(0, 0, 5, 39.0, step_ms=2000.0), NOW)  # 20 steps of 2 s: 40 s
    assert stalled(rank(0, 0, 5, 41.0, step_ms=2000.0), NOW)
    assert not stalled(rank(0, 0, 5, 1e6, state="completed"), NOW)
    assert not stalled(rank(0, 0, 0, None), NOW)  # no step yet


def test_sparkline_uses_the_given_scale():
    assert sparkline([1.0, 5.0, 9.0], 1.0, 9.0) == "▁▅█"
    assert sparkline([4.0, 4.0], 4.0, 4.0) == "▁▁"
    assert sparkline([], 0.0, 0.0) == ""


def render(renderable, width: int = 200) -> str:
    console = Console(file=io.StringIO(), width=width, color_system=None)
    console.print(renderable)
    return console.file.getvalue()


def test_table_groups_ranks_by_node_and_marks_the_stall():
    rows = [
        rank(0, 0, 120, 0.4, recent_step_ms=[8.0, 8.0, 16.0]),
        rank(1, 0, 118, 0.2),
        rank(2, 1, 40, 30.0, cpu_pct=97.0, gpu_util_pct=55.0, gpu_memory_bytes=3 << 20),
    ]
    drawn = render(table(reply(rows, ranks="2"), 12.0, "demo"))
    out = [line.rstrip() for line in drawn.splitlines()]
    assert out[0] == "traceml demo: 3 ranks, 2 nodes, 12 s"
    header = next(line for line in out if "rank" in line and "steps" in line)
    assert (
        header.replace("┃", " ").split()
        == (
            "node rank steps step ms input h2d fwd bwd opt comm other input % GPU % GPU MiB CPU % "
            "idle s recent"
        ).split()
    )
    cells = [[c.strip() for c in line.split("│")[1:-1]] for line in out if line.startswith("│")]
    body = [c for c in cells if c and c[1].isdigit()]
    assert [(c[0], c[1], c[2], c[3], c[4], c[6]) for c in body] == [
        ("0 host0", "0", "120", "8.0", "0.5", "3.0"),
        ("", "1", "118", "8.0", "0.5", "3.0"),
        ("1 host1", "2", "40", "8.0", "0.5", "3.0"),
    ]
    assert [tuple(c[12:17]) for c in body] == [
        ("-", "-", "-", "0.4", "▁▁█"),
        ("-", "-", "-", "0.2", ""),
        ("55", "3", "97", "30.0", ""),
    ]
    text = "\n".join(out)
    assert "verdict so far: INPUT_STRAGGLER (warning) ranks 2" in text
    assert "Rank 1 input wait: 5.0 ms per step." in text
    # The stalled rank's idle time is the one cell drawn in bold red.
    styled = Console(file=io.StringIO(), width=200, force_terminal=True, color_system="standard")
    styled.print(table(reply(rows), 12.0, "demo"))
    red = re.findall(r"\x1b\[1;31m *([^\x1b]*)\x1b\[0m", styled.file.getvalue())
    assert red == ["30.0"]


def test_table_lists_named_and_stalled_ranks_first_past_the_row_limit():
    rows = [rank(r, r // 8, 50, 0.1) for r in range(MAX_TABLE_ROWS + 8)]
    rows[39].last_step_unix_s = NOW - 60  # stalled
    out = render(table(reply(rows, ranks="37"), 5.0, "big"))
    body = [
        line.split("│")[2].strip()
        for line in out.splitlines()
        if line.startswith("│") and line.split("│")[2].strip().isdigit()
    ]
    assert body == [str(r) for r in list(range(MAX_TABLE_ROWS - 2)) + [37, 39]]
    assert "... 8 more ranks not shown (the summary lists every rank)" in out


def test_node0_view_line_names_the_host_and_the_aggregator():
    assert node0_view_line("cli", "10.1.0.1", "10.1.0.1:29765", "r") == (
        "--mode cli: the live view of run r (every node) is drawn by node 0's launcher on "
        "10.1.0.1 (aggregator 10.1.0.1:29765): watch node 0's terminal or job output "
        "(Slurm: task 0's output)"
    )
    assert node0_view_line("dashboard", "n0", "n0:29765", "r", "http://n0:29766/") == (
        "--mode dashboard: the live page of run r (every node) is served by node 0's "
        "aggregator on n0: http://n0:29766/"
    )
    assert node0_view_line("dashboard", "n0", "n0:29765", "r").endswith(
        "on n0: its URL is in node 0's launcher output"
    )


def test_live_ranks_take_counts_and_clock_from_the_aggregates():
    """The rows combine the live summary (figures over the window) with the aggregates
    (steps stored, last step's wall clock), rank by rank."""
    live = LiveAggregates("r", world_size=2)
    summary = {
        "nodes": [
            {
                "system": {
                    "gpus": [
                        {
                            "uuid": "GPU-a",
                            "util_percent_median": 71.0,
                            "memory_used_bytes_max": 5 << 20,
                        }
                    ]
                }
            }
        ],
        "ranks": [
            {
                "rank": 0,
                "node_rank": 0,
                "hostname": "h0",
                "end": {"state": "running"},
                "step_time_ms": {"median": 20.0},
                "phase_share_pct": {"input_wait": 10.0},
                "phase_median_ms": {"input_wait": 2.0, "h2d": None, "forward": 9.0},
                "process": {"cpu_percent_median": 98.0},
                "memory": {"peak_allocated_bytes": None},
                "series": {"step_ms": [float(i) for i in range(100)]},
            },
            {
                "rank": 1,
                "node_rank": None,
                "hostname": None,
                "end": {"state": "running"},
                "step_time_ms": None,
                "phase_share_pct": {},
                "phase_median_ms": {},
                "process": {"cpu_percent_median": None},
                "memory": {"peak_allocated_bytes": None},
                "series": {"step_ms": []},
            },
        ],
    }
    rl = live._rank(0)
    rl.identity, rl.steps_stored, rl.last_step_unix_s = identity(0, uuid="GPU-a"), 1234, NOW
    rows = LiveRows()

    def reply() -> wire.SummarizeReply:
        out = wire.SummarizeReply()
        rows.fill(out, summary, live)
        return out

    r0, r1 = reply().ranks
    assert (r0.rank, r0.node_rank, r0.hostname, r0.steps_stored) == (0, 0, "h0", 1234)
    assert (r0.last_step_unix_s, r0.step_time_ms, r0.input_wait_pct) == (NOW, 20.0, 10.0)
    assert dict(r0.phase_median_ms) == {"input_wait": 2.0, "forward": 9.0}
    assert (r0.cpu_pct, r0.gpu_util_pct, r0.gpu_memory_bytes) == (98.0, 71.0, 5 << 20)
    assert list(r0.recent_step_ms) == [float(i) for i in range(100 - SPARK_STEPS, 100)]
    assert (r1.rank, r1.steps_stored, r1.end_state) == (1, 0, "running")
    for name in (
        "node_rank",
        "last_step_unix_s",
        "step_time_ms",
        "input_wait_pct",
        "cpu_pct",
        "gpu_util_pct",
        "gpu_memory_bytes",
    ):
        assert not r1.HasField(name), name
    # the next reply from the same summary: the summary's figures reused, the aggregates' new
    rl.steps_stored, rl.last_step_unix_s = 1240, NOW + 2
    r0 = reply().ranks[0]
    assert (r0.steps_stored, r0.last_step_unix_s, r0.step_time_ms) == (1240, NOW + 2, 20.0)
    # rank 1's identity and first steps arrive after the summary was built: its row names its
    # node at once, as it counts its steps (CI once saw "node -: ranks 1 steps 1")
    r1_live = live._rank(1)
    r1_live.identity, r1_live.steps_stored = identity(1, node=2), 1
    r1 = reply().ranks[1]
    assert (r1.node_rank, r1.hostname, r1.steps_stored) == (2, "host2", 1)
    assert not r1.HasField("step_time_ms")  # the summary's figures wait for the next one
    live.close()


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


class Bytes(io.BytesIO):
    def isatty(self) -> bool:
        return False


def test_training_output_prints_above_the_table_whole_lines_only():
    """While the table is drawn, the copied training output goes through its console in
    whole lines (a UTF-8 character split across chunks is kept whole); before it is drawn
    and once it closed, bytes go straight through, the held-back partial line first."""
    from traceml.launcher.terminal_view import TerminalView

    screen, raw = Terminal(), Bytes()
    view = TerminalView("127.0.0.1:1", "r", out=screen)
    above = view.above(raw)
    above.write(b"before\n")
    assert raw.getvalue() == b"before\n"
    view._draw(reply([rank(0, 0, 3, 0.1)]), 1.0)
    drawn = len(screen.getvalue())
    for chunk in (b"loss 0.5\nstep \xc3", b"\xa9t\xc3\xa9 2\npartial"):
        above.write(chunk)
    printed = screen.getvalue()[drawn:]
    assert "loss 0.5\n" in printed and "step été 2\n" in printed and "partial" not in printed
    assert raw.getvalue() == b"before\n"
    view.close()
    assert raw.getvalue() == b"before\npartial"
    above.write(b" end\n")
    assert raw.getvalue() == b"before\npartial end\n"
