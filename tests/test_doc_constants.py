"""The documents and the code cannot drift apart: every constant a document names, with the
value it states, is read from the code and compared.

Two forms are parsed in ``docs/*.md`` and ``README.md``:

* a value followed by its constant: ``30 s (`CLIENT_KEEPALIVE_MS`)``, ``4 MiB
  (`MAX_MESSAGE_BYTES`)``, ``65,536 (`TRACEML_BUFFER_MAX_RECORDS`)``;
* a constant given its value: ```FINISH_RESERVE_S` = 0.5 s``.

The value is converted to the constant's unit, read from its name (``_MS``: ms, ``_S`` and
``_SEC``: s, ``_BYTES``: bytes), and compared with the constant imported from the module that
defines it (found by its ``NAME =`` line), or, for a ``TRACEML_*`` variable, with its default
in :mod:`traceml.settings`. Any backticked name that looks like a duration or size constant
(``_MS``, ``_S``, ``_SEC``, ``_US``, ``_BYTES``) must exist in the code.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
import sys
from pathlib import Path

from traceml import settings

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
SOURCES = [
    p
    for tree in ("traceml", "traceml_aggregator", "benchmarks")
    for p in sorted((ROOT / tree).rglob("*.py"))
]

_NUMBER = r"(\d[\d,]*(?:\.\d+)?)"
_UNIT = r"(ms|s|MiB|GiB|KiB|%)?"
#: ``30 s (`NAME`)``, ``**25 s** (`NAME`)``.
VALUE_THEN_NAME = re.compile(rf"\**{_NUMBER}\s*{_UNIT}\**\s+\(`(_?[A-Z][A-Z0-9_]+)`")
#: ```NAME` = 0.5 s``.
NAME_THEN_VALUE = re.compile(rf"`(_?[A-Z][A-Z0-9_]{{3,}})`\s*=\s*\**{_NUMBER}\s*{_UNIT}")
#: Backticked names of durations and sizes.
UNIT_NAME = re.compile(r"`(_?[A-Z][A-Z0-9_]*_(?:MS|S|SEC|US|BYTES))`")
_SCALE = {None: 1, "%": 1, "s": 1, "ms": 1e-3, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}


def documented() -> list[tuple[str, int, str, float, str | None]]:
    """``(file, line, name, value, unit)`` of every value a document states for a constant."""
    out = []
    for path in DOCS:
        text = path.read_text()
        for pattern, order in ((VALUE_THEN_NAME, (3, 1, 2)), (NAME_THEN_VALUE, (1, 2, 3))):
            for m in pattern.finditer(text):
                name, value, unit = (m.group(i) for i in order)
                line = text.count("\n", 0, m.start()) + 1
                out.append((path.name, line, name, float(value.replace(",", "")), unit))
    return out


def defined(name: str):
    """The value of the constant ``name`` in the code (the module with its ``NAME =`` line, or
    a ``TRACEML_*`` setting's default); raises LookupError when nothing defines it."""
    for value in vars(settings).values():
        if isinstance(value, settings.Setting) and value.name == name:
            return value.default
    line = re.compile(rf"^{re.escape(name)}\s*(?::[^=\n]*)?=", re.MULTILINE)
    modules = [p for p in SOURCES if line.search(p.read_text())]
    if not modules:
        raise LookupError(
            f"{name} is defined nowhere in traceml/, traceml_aggregator/ or benchmarks/"
        )
    values = set()
    for path in modules:
        values.add(getattr(_module(path), name))
    assert len(values) == 1, f"{name} has several values: {values}"
    return values.pop()


def _module(path: Path):
    """The module of source file ``path``: imported by its dotted name in the packages, loaded
    from its file in benchmarks/ (scripts, not a package)."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    if parts[0] != "benchmarks":
        return importlib.import_module(".".join(parts))
    spec = importlib.util.spec_from_file_location(f"_documented_{parts[-1]}", path)
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def in_code_unit(name: str, value: float, unit: str | None) -> float:
    """A documented ``value`` in ``unit``, in the unit of the constant ``name``."""
    value *= _SCALE[unit]
    if name.endswith("_MS"):
        return value * 1000 if unit in ("s", "ms") else value
    return value


def test_every_documented_value_is_the_codes():
    checked, wrong = set(), []
    for file, line, name, value, unit in documented():
        try:
            code = float(defined(name))
        except LookupError as exc:
            wrong.append(f"{file}:{line}: {exc}")
            continue
        if abs(in_code_unit(name, value, unit) - code) > 1e-9 * max(1.0, abs(code)):
            wrong.append(
                f"{file}:{line}: {name} documented as {value:g} {unit or ''}, code has {code:g}"
            )
        checked.add(name)
    assert wrong == []
    # The parser found what it must (a change that stops it finding them fails here).
    assert {
        "CLIENT_KEEPALIVE_MS",
        "SERVER_KEEPALIVE_MS",
        "SERVER_MIN_PING_INTERVAL_MS",
        "KEEPALIVE_TIMEOUT_MS",
        "NODE_LOST_AFTER_S",
        "NODE_HEARTBEAT_INTERVAL_S",
        "MAX_MESSAGE_BYTES",
        "FINISH_RESERVE_S",
        "TRACEML_BUFFER_MAX_RECORDS",
    } <= checked, checked


def test_every_duration_or_size_constant_a_document_names_exists():
    names = {m.group(1) for path in DOCS for m in UNIT_NAME.finditer(path.read_text())}
    missing = []
    for name in sorted(names):
        try:
            defined(name)
        except LookupError as exc:
            missing.append(str(exc))
    assert missing == []
    # The fork's bound is stated by these names (docs/wire.md, "Fork safety").
    assert {"FORK_CLOSE_WAIT_S", "FORK_WAIT_MAX_S"} <= names


def test_the_claim_that_a_scrape_never_delays_an_acknowledgement_is_gone():
    # What a scrape costs is measured instead (benchmarks/ingest.py --scrapers 0 8).
    assert "never delays" not in (ROOT / "docs" / "prometheus.md").read_text()
