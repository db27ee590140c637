"""The real components a test starts, and the markers that must say so.

Every process a test starts goes through :class:`subprocess.Popen`; :func:`watch` records each
one (its argv and the process) for the test that is running, and :meth:`Watch.problems` names
the markers that the test lacks for what it started. ``tests/conftest.py`` fails the test at
teardown when one is missing, so ``-m "not slow"`` (``tools/test.sh --quick``) never starts a
real job by surprise, and ``-m netns``/``-m browser``... select every test that needs one.

Kinds (pyproject.toml's ``[tool.pytest.ini_options] markers`` describes each):

- ``torchrun``: ``traceml run`` or ``python -m torch.distributed.run`` (a real launcher);
- ``aggregator``: a ``traceml_aggregator`` process started by the test itself;
- ``netns``: ``ip netns ...`` or ``ip -n NS ...`` (network namespaces);
- ``browser``: chromium (or chrome);
- ``slurm``: the Slurm lab (``tests/slurm_lab/lab.sh``).

``slow`` (the test takes seconds: a real job) goes with every kind but ``aggregator``; a
launcher that refused its arguments (exit code 2, before any rank started) needs no ``slow``.

Tests run side by side (pytest-xdist), so a launcher on this host's network must not take a
default port: :func:`default_ports` names the port flags a command leaves at their defaults
(the aggregator's 29765, the rendezvous 29500 of a run of several nodes). Inside a network
namespace (``ip netns exec``) the defaults are private to the test and allowed.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Sequence

#: The exit code of ``traceml run`` and ``traceml-aggregator`` when they refuse their arguments.
REFUSED = 2

#: Kinds that always take seconds, so a test with one must carry ``slow`` too.
SLOW_KINDS = ("torchrun", "netns", "browser", "slurm")


def _has_flag(words: list[str], *flags: str) -> bool:
    return any(w == f or w.startswith(f + "=") for w in words for f in flags)


def _nnodes(words: list[str]) -> str:
    for i, w in enumerate(words):
        if w.startswith("--nnodes="):
            return w.split("=", 1)[1]
        if w == "--nnodes" and i + 1 < len(words):
            return words[i + 1]
    return "1"


def default_ports(kind: str, argv: Sequence[str]) -> list[str]:
    """The port flags that ``argv`` (a command of ``kind``) leaves at a default that every
    parallel test would share; empty inside a network namespace."""
    words = [str(a) for a in argv]
    if words[:3] == ["ip", "netns", "exec"]:
        return []
    if kind == "torchrun":
        # One node: torchrun picks a free rendezvous port itself; several: 29500 by default.
        plain = "torch.distributed.run" in words
        missing = [] if plain or _has_flag(words, "--aggregator-port") else ["--aggregator-port"]
        if _nnodes(words) != "1" and not _has_flag(words, "--master-port", "--master_port"):
            missing.append("--master-port")
        return missing
    if kind == "aggregator" and not _has_flag(words, "--port", "--finalize-only"):
        return ["--port"]
    return []


def kind_of(argv: Sequence[str]) -> str | None:
    """The kind (a marker name) of the command ``argv`` (as given to Popen), or None."""
    words = [str(a) for a in argv]
    if not words:
        return None
    names = [os.path.basename(w) for w in words]
    if "lab.sh" in names:
        return "slurm"
    if names[0] == "ip" and ("netns" in words or "-n" in words):
        return "netns"
    if any(n in ("chromium", "chromium-browser", "google-chrome") for n in names):
        return "browser"
    for i, w in enumerate(words[:-1]):
        if w == "-m" and words[i + 1] in ("torch.distributed.run", "traceml_aggregator"):
            return "torchrun" if words[i + 1] == "torch.distributed.run" else "aggregator"
        if w == "-m" and words[i + 1] == "traceml" and "run" in words[i + 2 : i + 3]:
            return "torchrun"
    if names[0] in ("torchrun", "traceml-aggregator"):
        return "torchrun" if names[0] == "torchrun" else "aggregator"
    if names[0] == "traceml" and words[1:2] == ["run"]:
        return "torchrun"
    return None


class Watch:
    """The processes started since :meth:`reset` (``(kind, argv, Popen)`` each)."""

    def __init__(self) -> None:
        self.started: list[tuple[str, list[str], subprocess.Popen]] = []

    def reset(self) -> None:
        self.started = []

    def problems(self, markers: set[str]) -> list[str]:
        """One line per marker that ``markers`` (a test's marker names) lacks for what it
        started, and per default port a started command took; empty when all is well."""
        lines = []
        for kind, argv, proc in self.started:
            refused = kind in ("torchrun", "aggregator") and proc.returncode == REFUSED
            needed = [kind]
            if kind in SLOW_KINDS and not refused:
                needed.append("slow")
            command = repr(" ".join(argv)[:160])
            for name in needed:
                if name not in markers:
                    lines.append(f"starts {command} without @pytest.mark.{name}")
            for flag in [] if refused else default_ports(kind, argv):
                lines.append(f"starts {command} without {flag} (take one from free_port())")
        return list(dict.fromkeys(lines))


def watch() -> Watch:
    """Record every Popen of this process into the returned :class:`Watch` from now on."""
    record = Watch()
    original = subprocess.Popen.__init__

    def init(self, args, *a, **kw):
        original(self, args, *a, **kw)
        argv = [args] if isinstance(args, (str, bytes, os.PathLike)) else list(args)
        if isinstance(args, str) and kw.get("shell"):
            argv = args.split()
        kind = kind_of(argv)
        if kind is not None:
            record.started.append((kind, [str(a) for a in argv], self))

    subprocess.Popen.__init__ = init
    return record
