"""Where the dashboard's data comes from: the live aggregates, or a stored run.

A source answers three things (the whole boundary between the dashboard and the rest of the
aggregator, so a change in how the live aggregates are kept touches only :class:`LiveSource`):

* ``version()``: a counter that changes whenever the data may have changed;
* ``await snapshot(summary, version)``: the run's
  :class:`~traceml_aggregator.dashboard.frames.Snapshot` with ``summary``, built off the event
  loop;
* ``await summary()``: the run's summary document, or None while there is none.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
from pathlib import Path

from traceml.core import log
from traceml.core.rundir import SUMMARY_JSON_NAME
from traceml_aggregator.dashboard.frames import Snapshot

_log = log.get("aggregator")


class LiveSource:
    """The running aggregator's :class:`~traceml_aggregator.live.LiveAggregates` (event-loop
    use only): its windows (the latest steps and samples of each rank and node) and its live
    verdict (``Summarize``'s, the final summary's analysis over the windows)."""

    live = True

    def __init__(self, aggregates) -> None:
        self._live = aggregates
        self._failed = ""

    def version(self) -> int:
        """Changes applied to the aggregates so far."""
        return self._live.version

    async def snapshot(self, summary: dict | None, version: int) -> Snapshot:
        """The windows' snapshot, built in the live analysis process
        (:meth:`~traceml_aggregator.live.LiveAggregates.snapshot`): the loop pays only what
        changed since the last one."""
        return await self._live.snapshot(summary, version)

    async def summary(self) -> dict | None:
        """The live summary document; None when its analysis failed (said once)."""
        try:
            return await self._live.summary()
        except Exception as exc:  # an analysis bug costs the verdict, never the page
            message = f"{type(exc).__name__}: {exc}"
            if message != self._failed:
                _log.warning(f"warning: the dashboard's live verdict failed ({message})")
                self._failed = message
            return None


class StoredSource:
    """A finished (or stopped) run read once from its run directory, read-only: the whole
    stored series (:func:`traceml_aggregator.load.load`) and ``final_summary.json`` when it is
    there, else a summary computed from the store.

    Raises:
        StoreUnavailable: ``run_dir`` holds no store, or it cannot be read (one line).
    """

    live = False

    def __init__(self, run_dir: Path) -> None:
        from traceml_aggregator.load import load
        from traceml_aggregator.store import open_run_store, unreadable

        store = open_run_store(run_dir, read_only=True)
        try:
            self._run = load(store, [])
        except sqlite3.DatabaseError as exc:  # damaged beyond its first pages
            raise unreadable(store.path, exc) from exc
        finally:
            store.close()
        summary_path = Path(run_dir) / SUMMARY_JSON_NAME
        if summary_path.is_file():
            self._summary = json.loads(summary_path.read_text(encoding="utf-8"))
        else:
            from traceml.analysis.summary import build_summary

            self._summary = build_summary(self._run)

    def version(self) -> int:
        """Always 0: a stored run does not change."""
        return 0

    async def snapshot(self, summary: dict | None, version: int) -> Snapshot:
        """The whole stored run's snapshot, built on a thread."""
        return await asyncio.to_thread(Snapshot, self._run, summary, live=False, version=version)

    async def summary(self) -> dict | None:
        """``final_summary.json``, or the summary computed from the store."""
        return self._summary
