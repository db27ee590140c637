"""No import cycles inside a package (docs/architecture.md).

The import graph is grimp's (import-linter's library), imports inside functions included: a
function-level import still ties the two modules together, it only hides the cycle until the
function runs. The layering between packages is import-linter's job (pyproject.toml's
``[tool.importlinter]``, run by tools/test.sh).
"""

from __future__ import annotations

import sys
import textwrap

import grimp
import pytest

#: Every package whose modules must not import each other in a circle.
PACKAGES = (
    "traceml",  # the root package and its plain modules (settings)
    "traceml.sdk",
    "traceml.launcher",
    "traceml.core",
    "traceml.analysis",
    "traceml.report",
    "traceml.wire",
    "traceml_aggregator",
)


def import_cycles(graph: grimp.ImportGraph, package: str) -> list[tuple[list[str], list[str]]]:
    """The import cycles among ``package``'s modules (``package`` itself and every module
    below it): one ``(modules, circle)`` per strongly connected component of more than one
    module, ``modules`` sorted, ``circle`` one shortest circle through its first module, that
    module repeated at the end."""
    modules = {m for m in graph.modules if m == package or m.startswith(package + ".")}
    edges = {m: sorted(graph.find_modules_directly_imported_by(m) & modules) for m in modules}
    # Tarjan's strongly connected components (iterative: no recursion limit).
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    for root in sorted(modules):
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            node, i = work.pop()
            if i == 0:
                index[node] = low[node] = len(index)
                stack.append(node)
                on_stack.add(node)
            if i < len(edges[node]):
                work.append((node, i + 1))
                nxt = edges[node][i]
                if nxt not in index:
                    work.append((nxt, 0))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
    return [(component, _circle(edges, component)) for component in components]


def _circle(edges: dict[str, list[str]], component: list[str]) -> list[str]:
    """A shortest circle through the component's first module (breadth-first search)."""
    start, members = component[0], set(component)
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for nxt in edges[node]:
                if nxt == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return path[::-1] + [start]
                if nxt in members and nxt not in previous:
                    previous[nxt] = node
                    following.append(nxt)
        frontier = following
    raise AssertionError(f"{component} is not strongly connected")


@pytest.fixture(scope="module")
def graph() -> grimp.ImportGraph:
    return grimp.build_graph("traceml", "traceml_aggregator", cache_dir=None)


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_cycle_inside_the_package(graph, package):
    assert package in graph.modules, f"{package} is not a package grimp sees (no __init__.py?)"
    cycles = import_cycles(graph, package)
    assert not cycles, "import cycles: " + "; ".join(
        f"{' -> '.join(circle)} (all tied together: {', '.join(modules)})"
        for modules, circle in cycles
    )


def test_a_function_level_cycle_is_found_and_named(tmp_path, monkeypatch):
    """The check itself: a cycle closed only by an import inside a function is reported, as
    its modules in import order."""
    pkg = tmp_path / "cyclepkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from cyclepkg import b\n")
    (pkg / "b.py").write_text("import cyclepkg.c\n")
    (pkg / "c.py").write_text(
        textwrap.dedent(
            """
            def later():
                from cyclepkg.a import x
            """
        )
    )
    (pkg / "d.py").write_text("from cyclepkg import a\n")  # imports into the cycle, not in it
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "cyclepkg", raising=False)
    cycles = import_cycles(grimp.build_graph("cyclepkg", cache_dir=None), "cyclepkg")
    assert cycles == [
        (
            ["cyclepkg.a", "cyclepkg.b", "cyclepkg.c"],
            ["cyclepkg.a", "cyclepkg.b", "cyclepkg.c", "cyclepkg.a"],
        )
    ]
