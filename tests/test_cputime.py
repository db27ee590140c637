"""``pytest --cpu-times=N`` (tests/helpers/cputime.py): each test's CPU seconds, its waited-for
children included, printed heaviest first, the same under xdist."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers import cputime

TESTS = Path(__file__).resolve().parent
#: CPU seconds the child of the measured test burns.
BURN_S = 1.0

MEASURED = textwrap.dedent(f"""
    import subprocess, sys, time

    def test_burns_in_a_child():
        subprocess.run([sys.executable, "-c",
                        "import time\\nt = time.process_time()\\n"
                        "while time.process_time() - t < {BURN_S}: pass"], check=True)

    def test_idles():
        time.sleep(0.2)
""")


@pytest.mark.slow  # a pytest run (two with xdist's workers) each: seconds of start-ups
@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["plain", "xdist"])
def test_a_childs_cpu_seconds_count_in_its_test(tmp_path, workers):
    (tmp_path / "test_measured.py").write_text(MEASURED)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "conftest",
            "--cpu-times=5",
            *workers,
            "test_measured.py",
        ],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": f"{TESTS}:{os.environ.get('PYTHONPATH', '')}"},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    header = re.search(
        r"===== heaviest 2 of 2 tests by CPU seconds, children included "
        r"\(summed: (\d+) s\) =====\n(.*)\n(.*)\n",
        result.stdout,
    )
    assert header, result.stdout
    rows = [re.fullmatch(r"\s*([\d.]+)s  (\S+)", line) for line in header.group(2, 3)]
    assert [r.group(2) for r in rows] == [
        "test_measured.py::test_burns_in_a_child",
        "test_measured.py::test_idles",
    ]
    burned, idled = (float(r.group(1)) for r in rows)
    assert BURN_S <= burned < BURN_S + 5.0  # the child's second, plus its Python start-up
    assert idled < 0.5  # a sleep costs no CPU


def test_the_table_is_heaviest_first_with_the_total():
    figures = [(1.5, "a"), (12.25, "b"), (0.0, "c")]
    assert cputime.table(figures, 2) == [
        "===== heaviest 2 of 3 tests by CPU seconds, children included (summed: 14 s) =====",
        "   12.25s  b",
        "    1.50s  a",
    ]
