"""Shared fixtures and the marker check; the helpers themselves are in ``tests/helpers/``.

The names the test modules import from here (``from conftest import free_port, ...``) stay
importable: they are re-exported from the helpers package.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import pytest
from helpers import components, cputime, jobs, schedule
from helpers.aggregator import free_port
from helpers.jobs import *  # noqa: F403 (re-exported: see the module docstring)
from helpers.jobs import TEST_RUN_TOKEN
from helpers.planted import PlantedRun, run_planted
from helpers.tls import make_cert
from helpers.waiting import wait_for

__all__ = [*jobs.__all__, "free_port", "make_cert", "wait_for"]

os.environ["TRACEML_RUN_TOKEN"] = TEST_RUN_TOKEN

#: Every process the tests start, by kind (tests/helpers/components.py).
_STARTED = components.watch()


#: CPU seconds at the start of the running test's setup (``--cpu-times``).
_CPU_AT_SETUP: dict[str, float] = {}
#: (CPU seconds, test id) of every finished test, on the controller (``--cpu-times``).
_CPU_FIGURES: list[tuple[float, str]] = []


def pytest_addoption(parser):
    parser.addoption(
        "--cpu-times",
        type=int,
        default=0,
        metavar="N",
        help="print the N tests that took the most CPU seconds, children included "
        "(tests/helpers/cputime.py)",
    )


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    _STARTED.reset()
    if item.config.getoption("cpu_times"):
        _CPU_AT_SETUP[item.nodeid] = cputime.cpu_seconds()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """Fail a test that started a real component (a launcher, an aggregator, a namespace, a
    browser, the Slurm lab) without its marker (and ``slow`` where the kind takes seconds),
    or a launcher on a default port (tests/helpers/components.py)."""
    result = yield
    if item.nodeid in _CPU_AT_SETUP:
        spent = cputime.cpu_seconds() - _CPU_AT_SETUP.pop(item.nodeid)
        item.user_properties.append((cputime.PROPERTY, round(spent, 2)))
    problems = _STARTED.problems({m.name for m in item.iter_markers()})
    _STARTED.reset()
    if problems:
        pytest.fail("what the test starts: " + "; ".join(problems), pytrace=False)
    return result


def pytest_runtest_logreport(report):
    if report.when == "teardown":
        _CPU_FIGURES.extend(
            (float(v), report.nodeid) for k, v in report.user_properties if k == cputime.PROPERTY
        )


def pytest_terminal_summary(terminalreporter, config):
    n = config.getoption("cpu_times")
    if n and _CPU_FIGURES:
        for line in cputime.table(_CPU_FIGURES, n):
            terminalreporter.write_line(line)


@pytest.fixture
def port() -> int:
    """A free aggregator port."""
    return free_port()


@pytest.fixture
def tracer(monkeypatch):
    """``(tracer, steps)``: a step tracer installed as the SDK's, appending each finished step
    to ``steps`` (the forward timer's tests: tests/test_forward_timer.py, test_gpu_paths.py)."""
    from traceml.sdk import instrumentation
    from traceml.sdk.step import StepTracer

    steps = []
    tracer = StepTracer(steps.append, time.perf_counter_ns())
    monkeypatch.setattr(instrumentation, "_tracer", instrumentation._tracer)  # restored after
    instrumentation.install(tracer)
    yield tracer, steps


@pytest.fixture(scope="session")
def planted(tmp_path_factory) -> Callable[[str], PlantedRun]:
    """``planted(scenario)``: the run of ``scenario`` (tests/helpers/planted.py), made on first
    use and shared by every test of this session (with xdist: of this worker; the tests that
    use it are one xdist group, so one worker makes each scenario once)."""
    base = tmp_path_factory.mktemp("planted")
    runs: dict[str, PlantedRun] = {}

    def get(scenario: str) -> PlantedRun:
        if scenario not in runs:
            runs[scenario] = run_planted(scenario, base)
        return runs[scenario]

    return get


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items):
    """pytest-xdist 3.8 names a grouped test's group in ``item._nodeid`` (``...@group``),
    which pytest 9.2 no longer reads (its node id is ``item._id``), so ``--dist loadgroup``
    silently stops grouping (pytest-dev/pytest-xdist#1386): carry the suffix over."""
    for item in items:
        legacy = getattr(item, "_nodeid", None)
        if legacy and "@" in legacy and legacy != item.nodeid and hasattr(item, "_id"):
            from _pytest.nodeid import NodeId

            item._id = NodeId.parse(legacy)
    _order_serial(items)


def _order_serial(items) -> None:
    """Put the ``serial`` tests, in the places they hold among ``items``, in the order that
    evens out the serial phase's workers (tests/helpers/schedule.py); the tests of one xdist
    group stay together, in their order. Every other test keeps its place."""
    places = [i for i, item in enumerate(items) if item.get_closest_marker("serial")]
    units: dict[str, list] = {}
    for i in places:
        group = items[i].get_closest_marker("xdist_group")
        units.setdefault(group.args[0] if group else items[i].nodeid, []).append(items[i])

    def seconds(unit: list) -> float:
        return sum(schedule.SERIAL_SECONDS.get(t.nodeid.split("@")[0], 0) for t in unit)

    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    ordered = [t for unit in schedule.snake(list(units.values()), seconds, workers) for t in unit]
    for i, item in zip(places, ordered, strict=True):
        items[i] = item


def pytest_itemcollected(item):
    """Keep the tests that share one real job on one xdist worker (``--dist loadgroup``), so
    the job runs once: the users of the ``planted`` runs are group ``planted``, and the tests
    of a module that share a module-scoped fixture of that module are the module's group. A
    test's own ``xdist_group`` mark wins. (At collection of each item: xdist reads the marks
    in its own ``pytest_collection_modifyitems``.)"""
    if item.get_closest_marker("xdist_group") is not None:
        return
    fixtures = getattr(item, "_fixtureinfo", None)
    if "planted" in getattr(item, "fixturenames", ()):
        item.add_marker(pytest.mark.xdist_group("planted"))
    elif fixtures is not None and any(
        d.scope == "module" and getattr(d.func, "__module__", None) == item.module.__name__
        for defs in fixtures.name2fixturedefs.values()
        for d in defs
    ):
        item.add_marker(pytest.mark.xdist_group(item.module.__name__))
