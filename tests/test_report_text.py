"""final_summary.txt and `traceml view`: verdict first (verdict, why, next), then compact
tables, never wider than 80 columns."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from conftest import run_traceml
from rundata_factory import rank, rich_run, run_of, steps

from traceml.analysis.summary import build_summary
from traceml.report.fmt import MAX_RANK_ROWS
from traceml.report.text import WIDTH, render_text


def _verdict_first(text: str, kind: str) -> list[str]:
    lines = text.splitlines()
    assert lines[0].startswith("TraceML summary · run '")
    assert lines[2] == "=" * WIDTH
    labels = [line[:10].strip() for line in lines[3:] if line[:10].strip()]
    assert labels[:3] == ["VERDICT", "WHY", "NEXT"]
    assert lines[3].split()[:2] == ["VERDICT", kind]
    assert max(len(line) for line in lines) <= WIDTH
    return lines


@pytest.mark.torchrun
@pytest.mark.slow
def test_real_report_and_view_print_the_same_text(planted, tmp_path):
    run = planted("input_straggler")
    text = (run.run_dir / "final_summary.txt").read_text()
    lines = _verdict_first(text, "INPUT_STRAGGLER")
    assert lines[3].endswith("· rank 1")
    assert text in run.process.stdout  # the launcher printed the report
    table = lines.index("Step time per rank (ms, medians over the window; CPU clock)")
    assert lines[table + 1].split() == (
        "rank node steps step p95 input h2d fwd bwd opt comm resid".split()
    )
    assert lines[table + 2].split()[:3] == ["0", "0", "30"]
    assert lines[table + 3].split()[6] == "-"  # H2D was not measured: "-", not 0

    view = run_traceml(["view", str(run.run_dir / "final_summary.json")], cwd=tmp_path)
    assert view.returncode == 0 and view.stdout == text
    html = tmp_path / "again.html"
    view = run_traceml(["view", str(run.run_dir), "--html", str(html)], cwd=tmp_path)
    assert view.returncode == 0
    assert html.read_text() == (run.run_dir / "final_summary.html").read_text()


def test_view_rejects_a_file_that_is_not_a_summary(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text("[1, 2]")
    proc = run_traceml(["view", str(bad)], cwd=tmp_path)
    assert proc.returncode == 2
    assert (
        proc.stderr.strip()
        == f"traceml: error: {bad}: not a TraceML summary (no primary_diagnosis)"
    )


@pytest.mark.parametrize("where", ["", ".", "/", "..", "{tmp}"])
def test_view_html_to_a_directory_is_one_line(tmp_path, where):
    """--html names a file: a directory (or an empty name) is refused in one line, exit 2 (it
    was a traceback from the atomic write)."""
    import json

    summary = tmp_path / "final_summary.json"
    summary.write_text(json.dumps(build_summary(rich_run())))
    where = where.format(tmp=tmp_path)
    proc = run_traceml(["view", str(summary), "--html", where], cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        f"traceml: error: --html {str(Path(where))!r} is a directory: give the report's file name"
    )


def test_large_run_stays_compact_and_narrow():
    ranks = [rank(r, steps(input_wait=31_000 if r == 37 else 1000), node=r // 8) for r in range(64)]
    for rd in ranks:
        rd.identity = replace(
            rd.identity, hostname="a-very-long-hostname-of-a-cluster-node.example.org"
        )
    run = run_of(ranks)
    run.run_name = "a-run-name-that-is-much-too-long-for-one-line-of-an-eighty-column-terminal"
    text = render_text(build_summary(run))
    lines = _verdict_first(text, "INPUT_STRAGGLER")
    table = next(i for i, line in enumerate(lines) if line.startswith("Step time per rank"))
    rows = lines[table + 2 : table + 2 + MAX_RANK_ROWS]
    listed = [int(row.split()[0]) for row in rows]
    assert 37 in listed and 0 in listed  # the straggler and the typical rank, always
    assert listed == sorted(listed)
    assert lines[table + 2 + MAX_RANK_ROWS].startswith("typical share of the step")
    assert f"... {64 - MAX_RANK_ROWS} more ranks in final_summary.json" in lines


def test_every_section_of_a_gpu_run_fits():
    text = render_text(build_summary(rich_run()))
    lines = _verdict_first(text, "COMPUTE_STRAGGLER")
    for title in ("Other findings", "GPU memory per rank (MiB)", "Nodes (cpu % median"):
        assert any(line.startswith(title) for line in lines), title


def test_a_partial_report_tells_ranks_that_never_finished_from_ranks_never_heard_of():
    """``PARTIAL`` (and the HTML page's note, from the same function) says which missing
    ranks never finished (their data may be incomplete) and which never reported (none)."""
    from traceml.report.fmt import missing_text

    ranks = [rank(r, steps(20)) for r in range(2)] + [
        replace(rank(r, []), identity=None, finish=None, end=None) for r in (2, 3)
    ]
    ranks[1].finish = None
    ranks[1].end = None
    summary = build_summary(run_of(ranks, missing=(1, 2, 3)), now_unix_s=100.0)
    assert [r["end"]["state"] for r in summary["ranks"]] == [
        "completed",
        "running",
        "never_reported",
        "never_reported",
    ]
    said = "rank 1 never finished (its data may be incomplete); ranks 2, 3 never reported (no data)"
    assert missing_text(summary) == said
    lines = render_text(summary).splitlines()
    assert " ".join(line[10:] for line in lines[3:5]) == said, lines[:6]
    assert lines[3].startswith("PARTIAL   ")
