"""The slowest tests of one or more pytest JUnit XML files (``--junitxml``), and their total.

    python tools/slowest_tests.py N FILE.xml [FILE.xml ...]

tools/test.sh runs the suite in three invocations (the parallel one, the ``serial`` tests beside
it or after it, then the ``alone`` tests) and prints, at the end, the N slowest tests of all
together: setup, call and teardown (JUnit's ``time``), in seconds; skipped tests count too.
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET


def slowest(paths: list[str], n: int) -> tuple[list[tuple[float, str]], float, int]:
    """(the ``n`` slowest ``(seconds, test id)``, the sum of every test's seconds, the number
    of tests) over the JUnit XML files ``paths`` (a missing file counts as empty)."""
    times = []
    for path in paths:
        try:
            root = ET.parse(path).getroot()
        except (OSError, ET.ParseError):
            continue
        for case in root.iter("testcase"):
            name = f"{case.get('classname', '')}::{case.get('name', '')}"
            times.append((float(case.get("time", 0) or 0), name))
    times.sort(reverse=True)
    return times[:n], sum(t for t, _ in times), len(times)


def main() -> None:
    n, paths = int(sys.argv[1]), sys.argv[2:]
    top, total, count = slowest(paths, n)
    print(f"===== slowest {len(top)} of {count} tests (test time summed: {total:.0f} s) =====")
    for seconds, name in top:
        print(f"{seconds:8.2f}s  {name}")


if __name__ == "__main__":
    main()
