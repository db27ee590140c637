"""`traceml run --mode cli` for real: a 2-rank CPU job under tmux (the rich table redrawn in
place on a terminal), the same job with stdout a pipe (one compact line per refresh), a job
that stalls (the line flags both ranks), and two launchers on two network namespaces (node 0's
view shows both nodes; node 1 says where it is).

Each rank sleeps ``SLEEP_S`` inside every step (``tests/scripts/faulty_ddp.py --step-sleep``),
so the step time the view shows is known to within the tiny model's few milliseconds.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import time

import pytest
from conftest import (
    SCRIPTS,
    assert_all_gone,
    free_port,
    load_summary,
    process_family,
    start_traceml,
    traceml_cmd,
    traceml_env,
)
from test_netns import HOST0, hosts, run_nodes  # noqa: F401 (hosts: the fixture)

pytestmark = [pytest.mark.slow, pytest.mark.torchrun]

SCRIPT = str(SCRIPTS / "faulty_ddp.py")
SLEEP_S = 0.05
STEPS = 300
ENV = {"TRACEML_LIVE_REFRESH_SEC": "0.5", "TRACEML_FLUSH_INTERVAL_SEC": "0.2"}

#: One compact line (see traceml.launcher.terminal_view.compact_line), its node parts captured.
LINE = re.compile(
    r"\[traceml +\d+s\] [A-Z_]+ \((?:info|warning|critical)\)(?: ranks [\d,]+)?"
    r" \| step (?P<step>\d+\.\d) ms over \d+ steps"
    r" \| (?:(?:input|h2d|fwd|bwd|opt|comm|other) \d+%(?: |(?= \|)))+"
    r"(?P<nodes>(?: \| node \d: ranks [\d,-]+ steps \d+(?:-\d+)? idle (?:\d+\.\ds|-))+)"
)
NODE = re.compile(r"node (\d): ranks ([\d,-]+) steps (\d+)(?:-(\d+))? idle")


def job_args(tmp_path, name: str, steps: int = STEPS) -> list[str]:
    return [
        "run",
        SCRIPT,
        "--nproc-per-node=2",
        "--mode=cli",
        f"--run-name={name}",
        f"--aggregator-port={free_port()}",
        f"--logs-dir={tmp_path / 'logs'}",
        "--",
        "--steps",
        str(steps),
        "--step-sleep",
        str(SLEEP_S),
    ]


def node_parts(line: str) -> dict[int, tuple[str, int, int]]:
    """``{node: (ranks, fewest steps, most steps)}`` of a compact line."""
    match = LINE.fullmatch(line)
    assert match, line
    return {int(n): (ranks, int(lo), int(hi or lo)) for n, ranks, lo, hi in NODE.findall(line)}


class Tmux:
    """A tmux server of its own (``-L``), one 200x60 window; killed with everything in it."""

    def __init__(self, name: str) -> None:
        self.socket = name

    def __call__(self, *args: str) -> str:
        return subprocess.run(
            ["tmux", "-u", "-L", self.socket, *args], check=True, capture_output=True, text=True
        ).stdout

    def screen(self) -> list[str]:
        return self("capture-pane", "-p", "-t", "live").splitlines()

    def everything(self) -> str:
        return self("capture-pane", "-p", "-S", "-", "-t", "live")

    def kill(self) -> None:
        subprocess.run(["tmux", "-L", self.socket, "kill-server"], capture_output=True)


def rank_rows(screen: list[str]) -> dict[int, list[str]]:
    """The table's rank rows by rank: the cells between the box's vertical bars."""
    rows = {}
    for line in screen:
        cells = [c.strip() for c in line.split("│")[1:-1]]
        if len(cells) > 2 and cells[1].isdigit():
            rows[int(cells[1])] = cells
    return rows


@pytest.fixture
def tmux(tmp_path):
    if shutil.which("tmux") is None:
        pytest.skip("needs tmux (tools/test.sh installs it)")
    server = Tmux(f"traceml-test-{os.getpid()}")
    yield server
    server.kill()


def test_tmux_shows_the_table_while_training_then_the_summary(tmp_path, tmux):
    env = traceml_env(ENV, launcher=True)
    env.update(TERM="xterm-256color", LANG="C.UTF-8", COLUMNS="200", LINES="60")
    script = tmp_path / "job.sh"
    exports = "".join(
        f"export {k}={shlex.quote(v)}\n"
        for k, v in env.items()
        if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k)
    )
    command = shlex.join(traceml_cmd() + job_args(tmp_path, "tmux"))
    script.write_text(
        f"{exports}cd {shlex.quote(str(tmp_path))}\n{command}\necho TRACEML_EXIT=$?\nsleep 600\n"
    )
    tmux("new-session", "-d", "-s", "live", "-x", "200", "-y", "60", f"bash {script}")

    def steps_shown(rows: dict[int, list[str]]) -> int:
        return max(int(rows[r][2]) for r in (0, 1))

    # at least 3 tables, the last showing more steps than the first (the live view refreshes
    # on its own schedule: on a loaded machine two looks a second apart may see one table)
    deadline = time.monotonic() + 180
    seen: list[dict[int, list[str]]] = []
    while time.monotonic() < deadline:
        screen = tmux.screen()
        rows = rank_rows(screen)
        if sorted(rows) == [0, 1] and all(r[2] != "0" and r[3] != "-" for r in rows.values()):
            seen.append(rows)
            if len(seen) >= 3 and steps_shown(rows) > steps_shown(seen[0]):
                break
        assert not any("TRACEML_EXIT" in line for line in screen), "\n".join(screen)
        time.sleep(1.0)
    assert len(seen) >= 3, "\n".join(tmux.screen())
    header = next(line for line in screen if " rank " in line and "steps" in line)
    for column in (
        "node",
        "step ms",
        "input",
        "fwd",
        "bwd",
        "opt",
        "comm",
        "other",
        "input %",
        "CPU %",
        "idle s",
        "recent",
    ):
        assert column in header, header
    assert any(line.startswith("traceml tmux: 2 ranks, 1 node,") for line in screen), screen
    assert any(line.startswith("verdict so far: ") for line in screen), screen
    first, last = seen[0], seen[-1]
    for rank in (0, 1):
        steps = int(last[rank][2])
        assert 1 <= int(first[rank][2]) <= steps <= STEPS
        # The planted sleep, plus the tiny model's CPU time (a busy shared machine: < 3x).
        assert SLEEP_S * 1000 <= float(last[rank][3]) < SLEEP_S * 3000, last[rank]
        assert float(last[rank][15]) < 10.0  # idle s: it is training
        assert last[rank][15], "no sparkline"
    assert last[0][0].startswith("0 ")  # node 0 and its host, on its first rank's row
    assert steps_shown(last) > steps_shown(first)

    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and "TRACEML_EXIT=" not in tmux.everything():
        time.sleep(1.0)
    final = tmux.everything()
    assert "TRACEML_EXIT=0" in final, final
    # Redrawn in place: one table in the whole scrollback, training's own output above it
    # (printed through the table's console, never through it), the summary below.
    assert final.count("traceml tmux: 2 ranks, 1 node,") == 1, final
    title = final.index("traceml tmux: 2 ranks")
    for rank in (0, 1):
        assert -1 < final.find(f"faulty_ddp: rank {rank} trained {STEPS} steps") < title, final
    assert "TraceML summary · run 'tmux'" in final[final.rindex("verdict so far: ") :], final
    summary = load_summary(tmp_path / "logs" / "tmux")
    assert [r["steps_completed"] for r in summary["ranks"]] == [STEPS, STEPS]


def test_piped_stdout_gets_one_compact_line_per_refresh(tmp_path):
    result = subprocess.run(
        traceml_cmd() + job_args(tmp_path, "piped", steps=150),
        cwd=tmp_path,
        env=traceml_env(ENV, launcher=True),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout.splitlines()
    live = [line for line in out if line.startswith("[traceml ")]
    with_steps = [line for line in live if "waiting for step data" not in line]
    assert len(with_steps) >= 3, result.stdout
    assert "\x1b" not in result.stdout  # no cursor movement, no colour in a log
    assert all(
        re.fullmatch(r"\[traceml +\d+s\] waiting for step data \(.+\)", line)
        for line in live
        if line not in with_steps
    )
    highest = 0
    for line in with_steps:
        parts = node_parts(line)
        assert list(parts) == [0], line
        ranks, low, high = parts[0]
        assert ranks == "0-1" and 1 <= low <= high <= 150, line
        assert high >= highest, "steps stored never go down"
        highest = high
        assert float(LINE.fullmatch(line)["step"]) >= SLEEP_S * 1000, line  # the sleep: a floor
    # The median over the last window: the planted sleep plus the tiny model's CPU time (the
    # first windows hold warm-up steps; a busy shared machine: < 3x).
    assert float(LINE.fullmatch(with_steps[-1])["step"]) < SLEEP_S * 3000, with_steps[-1]
    assert "TraceML summary · run 'piped'" in result.stdout.split(with_steps[-1], 1)[1]


def test_a_stalled_job_is_flagged_with_its_exact_step_count(tmp_path):
    """Rank 1 stalls in the forward of step 20 and rank 0 waits for it in backward's
    all-reduce: both stop at exactly 20 stored steps, and once their idle time passes
    STALL_MIN_S (10 s) the line names both; SIGTERM then ends the run with its summary (the
    exit code is torchrun's)."""
    from traceml.launcher.terminal_view import STALL_MIN_S

    args = job_args(tmp_path, "stall") + [
        "--fail",
        "stall",
        "--fail-rank",
        "1",
        "--fail-step",
        "20",
    ]
    launcher = start_traceml(args, tmp_path, tmp_path / "stall", env=ENV)
    processes = process_family(launcher.pid)
    out = tmp_path / "stall.out"
    deadline = time.monotonic() + 240
    try:
        while time.monotonic() < deadline and "STALLED" not in out.read_text():
            assert launcher.poll() is None, (tmp_path / "stall.err").read_text()
            time.sleep(0.5)
        processes = process_family(launcher.pid)
        stalled_line = next(line for line in out.read_text().splitlines() if "STALLED" in line)
    finally:
        launcher.send_signal(signal.SIGTERM)
        code = launcher.wait(120)
    assert_all_gone(processes)
    head, flagged = stalled_line.rsplit(" | STALLED ", 1)
    assert node_parts(head) == {0: ("0-1", 20, 20)}, stalled_line
    idle = re.fullmatch(r"rank 0 (\d+)s, rank 1 (\d+)s", flagged)
    assert idle and all(int(s) >= STALL_MIN_S for s in idle.groups()), stalled_line
    # Before the flag, the same ranks were shown idle but not yet stalled.
    earlier = [
        line
        for line in out.read_text().splitlines()
        if line.startswith("[traceml ") and "steps 20 idle" in line
    ]
    assert earlier and "STALLED" not in earlier[0], earlier
    assert code == 1, (tmp_path / "stall.err").read_text()  # torchrun's, stopped by SIGTERM
    summary = load_summary(tmp_path / "logs" / "stall")
    assert [r["steps_completed"] for r in summary["ranks"]] == [20, 20]


@pytest.mark.netns
def test_node0_view_shows_both_nodes_and_node1_points_to_it(hosts, tmp_path):  # noqa: F811
    steps = 60
    flags = [
        f"--aggregator-host={HOST0}",
        "--mode=cli",
        "--steps",
        str(steps),
        "--step-sleep",
        "0.15",
    ]
    os.environ.update(ENV)  # the launchers inherit it (run_nodes starts them)
    try:
        codes = run_nodes(hosts, tmp_path, {0: flags, 1: flags}, nproc=2)
    finally:
        for name in ENV:
            os.environ.pop(name)
    assert codes == {0: 0, 1: 0}, (tmp_path / "node0.err").read_text()
    out = (tmp_path / "node0.out").read_text().splitlines()
    both = [node_parts(line) for line in out if line.startswith("[traceml ") and "node 1:" in line]
    assert both, "\n".join(out)
    for parts in both:
        assert sorted(parts) == [0, 1]
        assert (parts[0][0], parts[1][0]) == ("0-1", "2-3")
        assert all(1 <= lo <= hi <= steps for _, lo, hi in parts.values()), parts
    assert "TraceML summary · run 'netns'" in "\n".join(out)
    node1_err = (tmp_path / "node1.err").read_text()
    assert (
        "traceml: --mode cli: the live view of run netns (every node) is drawn by node 0's "
        f"launcher on {HOST0} (aggregator {HOST0}:29765): watch node 0's terminal or job "
        "output (Slurm: task 0's output)"
    ) in node1_err.splitlines()
    assert "[traceml " not in (tmp_path / "node1.out").read_text()
