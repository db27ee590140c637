"""Hang detection: ranks that stopped making progress while the run goes on, and the suspect.

Every batch of a rank carries its ``Progress`` (steps completed, phase now; see
``proto/traceml/wire/v1/step.proto``), and a rank's sender ships one about every
``TRACEML_HEARTBEAT_SEC`` even when no step completes. :class:`HangWatch` follows them on the
aggregator's clock (immune to clock skew between nodes): a rank that completed a step (set-up
before the first one, loading a model or a data set, takes as long as it takes), is not done
(no finish marker, its node's torchrun not exited) and whose step count has not moved for the
hang timeout
(``--hang-timeout-sec``, default ``TRACEML_HANG_TIMEOUT_SEC`` or 300 s: long enough for a
checkpoint save or an evaluation between steps on most jobs, and well inside NCCL's default
collective timeout of 10 minutes, so the line comes before the job dies of it) has *stalled*. The stall record
(:meth:`HangWatch.check`) names:

* every stalled rank, with its steps completed, its phase, the seconds since its step count
  last moved (``silent_s``), and whether it is ``alive``: a batch of its own, or a process
  sample of it from its node's sampler, arrived within :data:`ALIVE_WINDOW_S`;
* the suspects: stalled ranks that are dead while others live; else the ranks furthest behind
  (fewest steps, then the earliest phase of a step: the rank still in forward while the others
  wait in backward's all-reduce); else, when every stalled rank stands at the same place while
  other ranks finished or move on, all of them; none when all stand at the same place (a
  collective that cannot complete: the network, or mismatched collectives).

The record is kept in the store's ``meta`` under ``stall`` (the partial and the final summary
read it from there) and in ``aggregator/stall.json``, which node 0's launcher watches to print
one line. It is refreshed while the stall lasts, frozen when the stalled ranks end (killed by
the user, say), and removed when one of them makes progress again.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from pathlib import Path

from traceml.analysis.hang import describe, suspects
from traceml.core.rundir import write_atomic

#: A rank counts as alive while a batch of its own or a process sample of it arrived this
#: recently, s (three default heartbeats).
ALIVE_WINDOW_S = 15.0
#: How often the watch looks, s.
CHECK_INTERVAL_S = 1.0


@dataclass
class RankProgress:
    """What the aggregator last heard of one rank (Unix s on the aggregator's clock)."""

    steps_completed: int
    phase: str
    changed_unix_s: float  # when the step count last moved
    seen_unix_s: float  # its last batch or process sample


class HangWatch:
    """Follows every rank's progress and keeps the stall record (see the module docstring).

    Args:
        timeout_s: seconds without a step before a live rank has stalled (> 0).
        is_done: ``is_done(rank)``: the rank finished or its node's torchrun exited.
        stall_file: where the record goes for node 0's launcher (``aggregator/stall.json``).
    """

    def __init__(self, timeout_s: float, is_done, stall_file: Path) -> None:
        self.timeout_s = timeout_s
        self._is_done = is_done
        self.stall_file = Path(stall_file)
        self.ranks: dict[int, RankProgress] = {}
        self.record: dict | None = None

    def on_batch(self, batch, now: float | None = None) -> None:
        """Account a stored batch: a rank's progress, or a node sampler's process samples."""
        now = time.time() if now is None else now
        if batch.WhichOneof("sender") != "rank":
            for sample in batch.process_samples:
                seen = self.ranks.get(sample.rank)
                if seen is not None:
                    seen.seen_unix_s = now
            return
        if not batch.HasField("progress"):
            return
        p = batch.progress
        known = self.ranks.get(batch.rank)
        if known is None or known.steps_completed != p.steps_completed:
            self.ranks[batch.rank] = RankProgress(p.steps_completed, p.phase, now, now)
        else:
            known.phase = p.phase
            known.seen_unix_s = now

    def check(self, now: float | None = None) -> dict | None:
        """The stall record as of ``now`` (Unix s), or None: no stall, or one of the stalled
        ranks moved again. A record whose ranks have all ended since is kept as it was."""
        now = time.time() if now is None else now
        if self.record is not None:
            stalled = [r["rank"] for r in self.record["ranks"]]
            if any(self.ranks[r].changed_unix_s > self.record["detected_unix_s"] for r in stalled):
                self.record = None  # progress again
            elif all(self._is_done(r) for r in stalled):
                return self.record  # frozen: the stalled ranks ended without moving
        stalled = sorted(
            r for r, p in self.ranks.items()
            if p.steps_completed  # watched from the first step on: set-up takes what it takes
            and not self._is_done(r)
            and now - p.changed_unix_s >= self.timeout_s
        )
        if not stalled:
            return self.record
        entries = [
            {
                "rank": r,
                "steps_completed": self.ranks[r].steps_completed,
                "last_step": self.ranks[r].steps_completed - 1,
                "phase": self.ranks[r].phase,
                "silent_s": round(now - self.ranks[r].changed_unix_s, 1),
                "alive": now - self.ranks[r].seen_unix_s < ALIVE_WINDOW_S,
                "last_progress_unix_s": round(self.ranks[r].changed_unix_s, 3),
            }
            for r in stalled
        ]
        others_move = len(self.ranks) > len(stalled)
        self.record = {
            "detected_unix_s": (self.record or {}).get("detected_unix_s", round(now, 3)),
            "hang_timeout_s": self.timeout_s,
            "ranks": entries,
            "suspects": suspects(entries, others_move=others_move),
        }
        return self.record

    async def run(self, persist, say) -> None:
        """Check every :data:`CHECK_INTERVAL_S`; hand each new or changed record (or None once
        a stall is over) to ``await persist(record)`` and mirror it in :attr:`stall_file`;
        ``say(line)`` once as a stall is detected and once as it ends."""
        last = None
        while True:
            await asyncio.sleep(CHECK_INTERVAL_S)
            record = self.check()
            if record == last:
                continue
            detected = (last or {}).get("detected_unix_s")
            if record is None:
                say("the stalled ranks make progress again")
            elif record["detected_unix_s"] != detected:
                say(describe(record))
            last = record
            try:
                if record is None:
                    self.stall_file.unlink(missing_ok=True)
                else:
                    write_atomic(self.stall_file, json.dumps(record))
                await persist(record)
            except Exception as exc:  # a full disk must not end the watch; the next check retries
                say(f"could not store the stall record ({type(exc).__name__}: {exc})")
                last = {"detected_unix_s": record["detected_unix_s"]} if record else None
