"""The run directory ``<logs-dir>/<run-name>/`` and the manifests written into it.

Layout (each file has exactly one writer, so nodes sharing one directory never clobber each
other)::

    manifest.json                     node 0: the run (launch, status, times, artifacts,
                                      aggregator health)
    nodes/node_<r>/manifest.json      node r: its launch, status, torchrun and rank exit codes
    nodes/node_<r>/training.stdout.log, training.stderr.log   node r's torchrun output
    nodes/node_<r>/rank_ends.json     node r's torchrun: ranks started, how failed ones ended
    nodes/node_0/node_exit.pb         node 0: its exit report, for a finalization from the store
    aggregator/process.stderr.log     node 0: the aggregator's own log
    aggregator/stall.json             node 0's aggregator: the current hang, while there is one
    telemetry.sqlite                  node 0's aggregator: the telemetry store
    run_token                         node 0: the run's token (mode 0600), read by the others
    final_summary.json/.txt/.html     node 0's aggregator: the reports
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Mapping
from pathlib import Path

from traceml.core import log

#: Files the aggregator writes at the top of the run directory (also read by the launcher).
DATABASE_NAME = "telemetry.sqlite"
SUMMARY_JSON_NAME = "final_summary.json"
SUMMARY_TEXT_NAME = "final_summary.txt"
SUMMARY_HTML_NAME = "final_summary.html"
#: The aggregator's current stall record (a hang), under ``aggregator/``; node 0's launcher
#: prints one line when it appears.
STALL_NAME = "stall.json"
#: Bytes the aggregator holds on the run's disk for the end of the run, at the top of the run
#: directory (:mod:`traceml.core.disk_reserve`); node 0's launcher removes one a killed
#: aggregator left.
DISK_RESERVE_NAME = ".disk_reserve"
#: Node 0's launcher writes the run's token there (mode 0600, atomically); the other nodes read
#: it (:func:`traceml.core.transport.write_token_file`, :func:`~.transport.read_token_file`).
TOKEN_FILE_NAME = "run_token"
#: The dashboard's link with the run token in it (mode 0600): what a user opens, since no
#: console line ever holds the token (:func:`traceml.core.endpoint.dashboard_link`).
DASHBOARD_LINK_FILE_NAME = "dashboard_link"


#: A run name is one safe path segment: letters, digits, '.', '_' and '-', not '.' or '..'.
_RUN_NAME = re.compile(r"^[A-Za-z0-9._-]{1,128}$")


def validate_run_name(name: str) -> str:
    """An error message for an unsafe run name, or "" when ``name`` is fine."""
    if not _RUN_NAME.match(name) or name in (".", ".."):
        return (
            f"run name {name!r} must be one path segment of letters, digits, '.', '_' or '-' "
            "(at most 128 characters, not '.' or '..')"
        )
    return ""


class RunDir:
    """Paths of one run directory, seen from one node.

    Args:
        root: ``<logs-dir>/<run-name>``.
        node_rank: the node this launcher runs on.
    """

    def __init__(self, root: Path, node_rank: int) -> None:
        self.root = Path(root)
        self.node_rank = node_rank
        self.node_dir = self.root / "nodes" / f"node_{node_rank}"
        self.training_stdout = self.node_dir / "training.stdout.log"
        self.training_stderr = self.node_dir / "training.stderr.log"
        self.node_manifest = self.node_dir / "manifest.json"
        self.rank_ends = self.node_dir / "rank_ends.json"
        self.run_manifest = self.root / "manifest.json"
        self.aggregator_dir = self.root / "aggregator"
        self.aggregator_stderr = self.aggregator_dir / "process.stderr.log"
        self.stall_file = self.aggregator_dir / STALL_NAME
        self.disk_reserve = self.root / DISK_RESERVE_NAME
        self.database = self.root / DATABASE_NAME
        self.final_summary_json = self.root / SUMMARY_JSON_NAME
        self.token_file = self.root / TOKEN_FILE_NAME
        self.dashboard_link = self.root / DASHBOARD_LINK_FILE_NAME

    def create(self, *, owner: bool) -> list[Path]:
        """Create the directories this node writes into; those it made, deepest first (what
        undoing a launch refused after it removes)."""
        made: set[Path] = set()
        for directory in [self.node_dir] + ([self.aggregator_dir] if owner else []):
            made.update(d for d in (directory, *directory.parents) if not d.exists())
            directory.mkdir(parents=True, exist_ok=True)
        return sorted(made, key=lambda d: len(d.parts), reverse=True)


def write_atomic(
    path: Path, content: str | bytes, *, mode: int | None = None, sync: bool = False
) -> None:
    """Write ``content`` (text as UTF-8) to ``path`` through a temporary file beside it and a
    rename: a reader (or a node sharing the directory) sees the old file or the new one, never
    half of one. ``mode``: the file's permission bits from its creation (default: the umask's);
    ``sync``: flushed to the disk before the rename. A write that fails (a full disk) removes
    its temporary file.

    Raises:
        OSError: the directory is not writable, or the disk is full.
    """
    path = Path(path)
    data = content.encode("utf-8") if isinstance(content, str) else content
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666 if mode is None else mode)
        try:
            if mode is not None:
                os.fchmod(fd, mode)  # O_CREAT's mode does not apply to a file left over
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            if sync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_json(path: Path, data: Mapping[str, object]) -> None:
    """Write ``data`` as indented JSON with :func:`write_atomic`."""
    write_atomic(path, json.dumps(data, indent=2, default=str) + "\n")


class Manifest:
    """A manifest that is rewritten whole after every change (so it is always valid JSON).

    Args:
        path: where it lives.
        initial: its first content (its lifecycle events are the manifest's own: :meth:`event`).
    """

    def __init__(self, path: Path, initial: Mapping[str, object]) -> None:
        self.path = path
        #: lifecycle event -> when it happened (Unix s): ``data["lifecycle"]``.
        self.lifecycle: dict[str, float] = {}
        self.data: dict[str, object] = {**initial, "lifecycle": self.lifecycle}

    def event(self, name: str, **fields: object) -> None:
        """Record lifecycle event ``name`` at the current wall time (Unix s), plus fields."""
        self.lifecycle[name] = round(time.time(), 3)
        self.update(**fields)

    def update(self, **fields: object) -> None:
        """Merge ``fields`` into the top level and rewrite the file (a failure only warns)."""
        self.data.update(fields)
        try:
            write_json(self.path, self.data)
        except OSError as exc:
            log.get("core").warning(f"cannot write {self.path}: {exc}")
