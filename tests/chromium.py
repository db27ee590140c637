"""The old import path of the headless Chromium driver: ``benchmarks/headless_chromium.py`` (the
dashboard's benchmark drives it too, and the benchmarks import nothing from ``tests/``)."""

import sys
from pathlib import Path

import pytest

_BENCHMARKS = str(Path(__file__).resolve().parents[1] / "benchmarks")
if _BENCHMARKS not in sys.path:
    sys.path.append(_BENCHMARKS)

from headless_chromium import CHROMIUM, DevTools  # noqa: E402

#: The marks of a test that drives Chromium: slow, and skipped when none is installed.
BROWSER_MARKS = [
    pytest.mark.browser,
    pytest.mark.slow,
    pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed"),
]

__all__ = ["BROWSER_MARKS", "CHROMIUM", "DevTools"]
