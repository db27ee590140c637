"""The terminal view of ``--mode cli`` on node 0 (the live table), and a pointer to node 0's view
elsewhere.

While training runs, node 0's launcher asks its aggregator for the verdict so far and one row
per rank (the ``Summarize`` RPC with ``with_ranks``: the same analysis as the final summary over
each rank's live window, see ``traceml_aggregator/live/rows.py``) every
``TRACEML_LIVE_REFRESH_SEC`` seconds (default 5) and shows it for every node of the run:

- on a terminal, a table redrawn in place (:func:`table`, drawn by ``rich.live.Live``): one row
  per rank, grouped by node, with its step time (median over the window), each part of the
  step, the input wait share, GPU utilisation and memory where measured, process CPU, steps
  stored, seconds since its last step (a stalled rank, :func:`stalled`, is shown in red), and a
  sparkline of its latest step times; under it the verdict so far with its evidence;
- when stdout is not a terminal (a log file, a pipe, CI), one compact line per refresh
  (:func:`compact_line`), so logs stay readable.

Both end with the same final summary as ``--mode summary``. A view that cannot refresh (the
aggregator is busy or restarting) shows nothing that time; a closed stdout (``| head``) ends
the view only: it never touches training. The other nodes' launchers print one line saying
where node 0's view is (:func:`node0_view_line`).
"""

from __future__ import annotations

import codecs
import sys
import time

from traceml import settings
from traceml.core import log, phases
from traceml.launcher import aggregator
from traceml.report.fmt import NA, mib, num

#: Step parts shown, as (summary name, label); the residual reads "other" here.
_PARTS = tuple((p.name, "other" if p is phases.RESIDUAL else p.short) for p in phases.PARTS)
#: A running rank whose last step ended longer ago than this is stalled, s ...
STALL_MIN_S = 10.0
#: ... or than this many of its median steps, whichever is longer.
STALL_STEPS = 20
#: Latest step times drawn per rank in the table's sparkline.
SPARK_WIDTH = 24
_SPARK_BARS = "▁▂▃▄▅▆▇█"
#: Most rank rows in the table; past that the verdict's and stalled ranks come first, the
#: rest are counted.
MAX_TABLE_ROWS = 32

_log = log.get("launcher")


def idle_s(rank, now_unix_s: float) -> float | None:
    """Seconds since ``rank`` (a :class:`~traceml.wire.LiveRank`) ended its last step, by
    the aggregator's clock ``now_unix_s`` against the rank's (0 when the clocks disagree the
    other way); None before its first step or once it ended."""
    if rank.end_state != "running" or not rank.HasField("last_step_unix_s"):
        return None
    return max(0.0, now_unix_s - rank.last_step_unix_s)


def stalled(rank, now_unix_s: float) -> bool:
    """Whether a running ``rank`` went without a step for longer than :data:`STALL_MIN_S`
    or :data:`STALL_STEPS` of its median steps, whichever is longer."""
    idle = idle_s(rank, now_unix_s)
    if idle is None:
        return False
    step_s = rank.step_time_ms / 1000 if rank.HasField("step_time_ms") else 0.0
    return idle > max(STALL_MIN_S, STALL_STEPS * step_s)


def sparkline(values, low: float, high: float) -> str:
    """One block character per value (ms), ``low`` the lowest bar and ``high`` the highest
    (the job's range, so a slow rank's bars stand taller than its peers')."""
    span = high - low
    top = len(_SPARK_BARS) - 1
    return "".join(_SPARK_BARS[round((v - low) / span * top) if span > 0 else 0] for v in values)


def _opt(rank, name: str):
    return getattr(rank, name) if rank.HasField(name) else None


def _ranges(numbers: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``0-2,5``."""
    out: list[str] = []
    for n in sorted(numbers):
        if out and out[-1][1] == n - 1:
            out[-1] = (out[-1][0], n)
        else:
            out.append((n, n))
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in out)


def _by_node(ranks) -> dict:
    """Rows grouped by node rank (None: identity not arrived yet, last), ranks in order."""
    nodes: dict = {}
    for r in sorted(ranks, key=lambda r: r.rank):
        nodes.setdefault(_opt(r, "node_rank"), []).append(r)
    return dict(sorted(nodes.items(), key=lambda kv: (kv[0] is None, kv[0] or 0)))


def _verdict(labels) -> str:
    """``INPUT_STRAGGLER (warning) ranks 1`` (the ranks only when the verdict names some)."""
    who = f" ranks {labels['ranks']}" if labels.get("ranks") else ""
    return f"{labels.get('verdict', '?')} ({labels.get('severity', '?')}){who}"


def _waiting(labels) -> str:
    return f"waiting for step data ({labels.get('verdict', 'no verdict yet')})"


def _typical(metrics) -> str:
    """``step 8.2 ms over 40 steps | input 6% fwd 9% ...``: the typical rank's step and its
    parts' shares (what ``traceml.summary()`` returns)."""
    shares = " ".join(
        f"{label} {metrics[f'{part}_pct']:.0f}%"
        for part, label in _PARTS
        if f"{part}_pct" in metrics
    )
    step = f"step {metrics['step_time_ms']:.1f} ms over {metrics.get('window_steps', 0):.0f} steps"
    return f"{step} | {shares}" if shares else step


def compact_line(reply, elapsed_s: float) -> str:
    """The view as one line (stdout not a terminal), for a SummarizeReply with ranks.

    ``[traceml    12s] VERDICT (severity)[ ranks R] | step 8.2 ms over 40 steps | input 6%
    fwd 9% ... | node 0: ranks 0-1 steps 118-120 idle 0.4s | node 1: ... [| STALLED rank 3
    14s, ...]``: the typical step time (ms) and the parts' shares (%, what
    ``traceml.summary()`` returns), then per node its ranks, their range of steps stored and
    the longest a running one of them has gone without a step (s; ``-`` when none runs),
    then the stalled ranks (:func:`stalled`) with their idle time.
    """
    stamp = f"[traceml {elapsed_s:5.0f}s]"
    if "step_time_ms" not in reply.metrics:
        return f"{stamp} {_waiting(reply.labels)}"
    parts = [f"{stamp} {_verdict(reply.labels)}", _typical(reply.metrics)]
    for node, ranks in _by_node(reply.ranks).items():
        steps = sorted(r.steps_stored for r in ranks)
        idles = [i for i in (idle_s(r, reply.now_unix_s) for r in ranks) if i is not None]
        parts.append(
            f"node {NA if node is None else node}: ranks {_ranges([r.rank for r in ranks])} "
            f"steps {steps[0]}"
            + (f"-{steps[-1]}" if steps[-1] != steps[0] else "")
            + f" idle {num(max(idles)) + 's' if idles else NA}"
        )
    stuck = [r for r in reply.ranks if stalled(r, reply.now_unix_s)]
    if stuck:
        parts.append(
            "STALLED "
            + ", ".join(f"rank {r.rank} {idle_s(r, reply.now_unix_s):.0f}s" for r in stuck)
        )
    return " | ".join(parts)


def _shown(reply) -> tuple[list, int]:
    """The ranks the table lists (at most :data:`MAX_TABLE_ROWS`: the verdict's and stalled
    ones first, then by rank) and how many are left out."""
    ranks = list(reply.ranks)
    if len(ranks) <= MAX_TABLE_ROWS:
        return ranks, 0
    named = {int(r) for r in reply.labels.get("ranks", "").split(",") if r}
    first = sorted(
        ranks, key=lambda r: (r.rank not in named and not stalled(r, reply.now_unix_s), r.rank)
    )
    return first[:MAX_TABLE_ROWS], len(ranks) - MAX_TABLE_ROWS


def table(reply, elapsed_s: float, run_name: str):
    """The view as a rich renderable (a terminal): the title, the ranks' table, the verdict.

    Columns: node (and host), rank, steps (stored), step (median ms over the window), each
    part of the step (median ms), input (input wait share, %), GPU (its GPU's utilisation,
    %), GPU mem (CUDA peak allocated, else the GPU's memory used, MiB), CPU (the rank's
    process, %, 100 = one core), idle (s since its last step; red when :func:`stalled`; how
    it ended once it did), recent (a sparkline of its latest step times on the job's
    scale). ``-``: not measured.
    """
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    now = reply.now_unix_s
    shown, hidden = _shown(reply)
    nodes = _by_node(shown)
    recent = [v for r in shown for v in r.recent_step_ms[-SPARK_WIDTH:]]
    low, high = (min(recent), max(recent)) if recent else (0.0, 0.0)

    n_nodes = len(_by_node(reply.ranks))
    grid = Table(
        title=f"traceml {run_name}: {len(reply.ranks)} ranks, "
        f"{n_nodes} node{'' if n_nodes == 1 else 's'}, {elapsed_s:.0f} s",
        title_justify="left",
        header_style="bold",
    )
    for name in (
        "node",
        "rank",
        "steps",
        "step ms",
        *(label for _, label in _PARTS),
        "input %",
        "GPU %",
        "GPU MiB",
        "CPU %",
        "idle s",
        "recent",
    ):
        grid.add_column(name, justify="left" if name in ("node", "recent") else "right")
    for node, ranks in nodes.items():
        for i, r in enumerate(ranks):
            idle = idle_s(r, now)
            grid.add_row(
                (f"{node} {r.hostname}" if node is not None else NA) if i == 0 else "",
                str(r.rank),
                str(r.steps_stored),
                num(_opt(r, "step_time_ms")),
                *(num(r.phase_median_ms[p]) if p in r.phase_median_ms else NA for p, _ in _PARTS),
                num(_opt(r, "input_wait_pct"), 0),
                num(_opt(r, "gpu_util_pct"), 0),
                mib(_opt(r, "gpu_memory_bytes")),
                num(_opt(r, "cpu_pct"), 0),
                Text(num(idle), style="bold red" if stalled(r, now) else "")
                if idle is not None
                else NA
                if r.end_state == "running"
                else r.end_state,
                sparkline(r.recent_step_ms[-SPARK_WIDTH:], low, high),
                end_section=i == len(ranks) - 1,
            )
    lines = [grid]
    if hidden:
        lines.append(Text(f"... {hidden} more ranks not shown (the summary lists every rank)"))
    if "step_time_ms" in reply.metrics:
        lines.append(Text.assemble("verdict so far: ", (_verdict(reply.labels), "bold")))
        lines.append(Text(reply.verdict_summary))
        lines.append(Text(_typical(reply.metrics)))
    else:
        lines.append(Text(_waiting(reply.labels)))
    return Group(*lines)


def node0_view_line(
    mode: str,
    node0_host: str,
    aggregator_target: str,
    run_name: str,
    dashboard_url: str | None = None,
) -> str:
    """The one line a node other than 0 prints about the live view: where node 0's view is.

    Args:
        mode: the launcher's ``--mode`` (``cli`` or ``dashboard``).
        node0_host: node 0's address as this node knows it (``--aggregator-host``, else
            ``--master-addr``).
        aggregator_target: ``host:port`` of node 0's aggregator.
        run_name: the run.
        dashboard_url: ``--mode dashboard``: the page's URL on node 0 and where its link is
            (never the token itself), None when this node cannot know it (then node 0's
            output has it).
    """
    if mode == "dashboard":
        where = dashboard_url or "its URL is in node 0's launcher output"
        return (
            f"--mode dashboard: the live page of run {run_name} (every node) is served by "
            f"node 0's aggregator on {node0_host}: {where}"
        )
    return (
        f"--mode {mode}: the live view of run {run_name} (every node) is drawn by node 0's "
        f"launcher on {node0_host} (aggregator {aggregator_target}): watch node 0's terminal "
        f"or job output (Slurm: task 0's output)"
    )


class AboveTable:
    """A binary stream that copies training output (torchrun's, :class:`~traceml.launcher.
    torchrun.Tee`) to the terminal above node 0's live table, so the table stays whole.

    Before the table is first drawn and after it closed, bytes go straight to ``target``;
    while it is drawn, whole lines go through the table's console (which prints them above
    it; ANSI colours kept) and a partial line waits for its end (or for :meth:`release`).
    Called from the Tee's pump thread; rich's console serialises it with the redraws.

    Args:
        target: the terminal's binary stream (``sys.stdout.buffer`` or ``sys.stderr.buffer``).
        view: the live view whose table it prints above.
    """

    def __init__(self, target, view: TerminalView) -> None:
        self.target = target
        self.view = view
        self._decode = codecs.getincrementaldecoder("utf-8")("replace").decode
        self._pending = ""

    def write(self, data: bytes) -> int:
        """Print ``data`` (bytes); returns its length. Raises OSError on a closed terminal."""
        console = self.view.table_console
        if console is None:
            self.release()
            self.target.write(data)
            return len(data)
        from rich.text import Text

        text = self._pending + self._decode(data)
        lines, newline, self._pending = text.rpartition("\n")
        if newline:
            console.print(Text.from_ansi(lines), soft_wrap=True, highlight=False)
        return len(data)

    def flush(self) -> None:
        if self.view.table_console is None:
            self.target.flush()

    def release(self) -> None:
        """Write the partial line held back, if any, straight to ``target``."""
        pending, self._pending = self._pending + self._decode(b"", final=True), ""
        if pending:
            self.target.write(pending.encode())
            self.target.flush()


class TerminalView:
    """Refreshes node 0's live view from ``target`` (see the module docstring).

    Args:
        target: ``host:port`` of the aggregator.
        run_name: the run.
        out: where the view is written (stdout).
    """

    def __init__(self, target: str, run_name: str, out=None) -> None:
        self.out = out or sys.stdout
        self.target = target
        self.run_name = run_name
        self.refresh_s = settings.read(settings.LIVE_REFRESH_SEC)
        self._started = time.monotonic()
        self._next = self._started + self.refresh_s
        self._live = None  # rich.live.Live on a terminal, once drawn
        self._above: list[AboveTable] = []
        try:
            self.in_place = self.out.isatty()
        except (OSError, ValueError):
            self.in_place = False

    @property
    def table_console(self):
        """rich's console of the table while it is drawn (a terminal), else None."""
        live = self._live
        return live.console if live is not None else None

    def consoles(self) -> tuple:
        """The binary streams training's stdout and stderr are copied to: on a terminal,
        streams that print above the table (:class:`AboveTable`; stderr too when it is the
        terminal), else the launcher's own ``sys.stdout.buffer`` and ``sys.stderr.buffer``."""
        out, err = sys.stdout.buffer, sys.stderr.buffer
        if not self.in_place:
            return out, err
        return self.above(out), self.above(err) if sys.stderr.isatty() else err

    def above(self, target) -> AboveTable:
        """A stream that prints to ``target`` (binary) above the table while it is drawn;
        :meth:`close` releases its held-back partial line."""
        stream = AboveTable(target, self)
        self._above.append(stream)
        return stream

    def tick(self) -> bool:
        """Refresh if one is due (called about once a second by the launcher).

        Returns:
            False once the view cannot be shown any more: its stream is closed (``--mode cli
            | head`` after head exited); the launcher then stops calling it, and training,
            its output and the summary files go on as before.
        """
        now = time.monotonic()
        if now < self._next:
            return True
        self._next = now + self.refresh_s
        import grpc  # loaded by now: the launcher waited for its aggregator over gRPC

        try:
            reply = aggregator.summarize(self.target, self.run_name, timeout_s=self.refresh_s / 2)
        except grpc.RpcError:
            return True
        if reply.error:
            return True
        try:
            self._draw(reply, now - self._started)
        except (OSError, ValueError) as exc:
            _log.warning(
                f"warning: the live view stopped: stdout is closed ({exc}); training goes on"
            )
            self._live = None  # nothing more can be written to restore the terminal
            return False
        return True

    def _draw(self, reply, elapsed_s: float) -> None:
        if not self.in_place:
            self.out.write(compact_line(reply, elapsed_s) + "\n")
            self.out.flush()
            return
        view = table(reply, elapsed_s, self.run_name)
        if self._live is None:
            from rich.console import Console
            from rich.live import Live

            # The launcher's own lines (stderr, looked up per line) print above the table
            # when they share its terminal.
            self._live = Live(
                view,
                console=Console(file=self.out),
                auto_refresh=False,
                redirect_stdout=False,
                redirect_stderr=sys.stderr.isatty(),
            )
            self._live.start(refresh=True)
        else:
            self._live.update(view, refresh=True)

    def close(self) -> None:
        """Leave the last table on the terminal (and its cursor shown) before the summary."""
        live, self._live = self._live, None
        try:
            if live is not None:
                live.stop()
            for stream in self._above:
                stream.release()
        except (OSError, ValueError):
            pass
