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
collective timeout of 10 minutes, so the line comes before the job dies of it) has *stalled*. The
stall record
(:meth:`HangWatch.check`) names:

* every stalled rank as it was when found stalled: its attempt, steps completed, phase, the
  seconds since its step count last moved (``silent_s``), and whether it was ``alive``: a
  batch of its own, or a process sample of it from its node's sampler, arrived within
  :data:`ALIVE_WINDOW_S`; and, from its latest ``Progress`` (sent by the rank once its step
  has stayed open a share of the hang timeout, ``traceml/sdk/stall.py``), the collective it
  is inside and its main thread's stack;
* the suspects: stalled ranks that are dead while others live; else the ranks furthest behind
  (fewest steps, then the earliest phase of a step: the rank still in forward while the others
  wait in backward's all-reduce); else, when every stalled rank stands at the same place while
  other ranks finished or move on, all of them; none when all stand at the same place (a
  collective that cannot complete: the network, or mismatched collectives), and the record
  says so rather than naming one. A rank further on than another (waiting for it, in a
  collective or a step that ends in one) is never a suspect, and the suspects are chosen on
  the ranks' states when the stall was detected, never on which rank ended last after.

A rank is followed in its latest torchrun attempt (``restart_count``): after a restart, an
earlier attempt's finish marker does not make the new attempt's rank done, and each stalled
rank's entry names its attempt.

The record is kept in the store's ``meta`` under ``stall`` (the partial and the final summary
read it from there), pushed down every node session (node 0's launcher prints one line from
it: ``traceml_aggregator/sessions.py``) and mirrored in ``aggregator/stall.json`` for the user.
All are written only when the record changes (a stall begins, a rank joins it, every
stalled rank ended: frozen, or it is over: removed), the file off the event loop. A replacing
aggregator takes the record its predecessor left (:meth:`HangWatch.restore`), and removes it
as soon as a stalled rank is seen moving.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from traceml.analysis.hang import describe, silent_s, suspects
from traceml.core.records import CollectiveWait, HangRecord, HungRank
from traceml.core.rundir import write_atomic

#: A rank counts as alive while a batch of its own or a process sample of it arrived this
#: recently, s (three default heartbeats).
ALIVE_WINDOW_S = 15.0
#: How often the watch looks, s.
CHECK_INTERVAL_S = 1.0
#: A new stall waits while another watched rank has been silent this share of the hang
#: timeout (it is about to stall too: the ranks of one hang stop within a step of each other).
ABOUT_TO_STALL_SHARE = 0.5


@dataclass
class RankProgress:
    """What the aggregator last heard of one rank's latest attempt (Unix s on the
    aggregator's clock)."""

    steps_completed: int
    phase: str
    changed_unix_s: float  # when the step count last moved
    seen_unix_s: float  # its last batch or process sample
    attempt: int = 0  # torchrun's restart_count
    collective: CollectiveWait | None = None  # the collective it last said it is inside
    stack: str | None = None  # the main thread's stack it last sent (None: none)
    #: When a stall it waited in ended without it being heard moving: its silence counts
    #: towards the hang timeout from then, not from ``changed_unix_s`` (None: not so).
    waited_until_unix_s: float | None = None

    def silent_s(self, now: float) -> float:
        """Seconds it counts as silent at ``now`` towards the hang timeout."""
        return now - max(self.changed_unix_s, self.waited_until_unix_s or 0.0)


class HangWatch:
    """Follows every rank's progress and keeps the stall record (see the module docstring).

    Args:
        timeout_s: seconds without a step before a live rank has stalled (> 0).
        is_done: ``is_done(rank, attempt)``: the rank finished that attempt (or a later one)
            or its node's torchrun exited.
        stall_file: where the record is mirrored for the user (``aggregator/stall.json``).
    """

    def __init__(self, timeout_s: float, is_done, stall_file: Path) -> None:
        self.timeout_s = timeout_s
        self._is_done = is_done
        self.stall_file = Path(stall_file)
        self.ranks: dict[int, RankProgress] = {}
        self.record: dict | None = None

    def restore(self, record: dict | None, now: float | None = None) -> None:
        """Take the stall record an earlier aggregator of this run left (None: none): its
        ranks stand where the record says until they are heard of again, so the stall goes
        on, is frozen, or ends (their steps move) as if no aggregator had been replaced."""
        if not record:
            return
        now = time.time() if now is None else now
        self.record = record
        for e in map(HungRank.from_json, record["ranks"]):
            self.ranks[e.rank] = RankProgress(
                e.steps_completed,
                e.phase,
                e.last_progress_unix_s,
                now,
                e.attempt,
                e.collective,
                e.stack,
            )

    def on_batch(self, batch, now: float | None = None) -> None:
        """Account a stored batch: a rank's progress, or a node sampler's process samples (of
        the ranks' latest attempts; an earlier attempt's are stale)."""
        now = time.time() if now is None else now
        if batch.WhichOneof("sender") != "rank":
            for sample in batch.process_samples:
                seen = self.ranks.get(sample.rank)
                if seen is not None and sample.restart_count == seen.attempt:
                    seen.seen_unix_s = now
            return
        if not batch.HasField("progress"):
            return
        p = batch.progress
        known = self.ranks.get(batch.rank)
        if known is not None and batch.restart_count < known.attempt:
            return
        if (
            known is None
            or known.attempt != batch.restart_count
            or known.steps_completed != p.steps_completed
        ):
            known = self.ranks[batch.rank] = RankProgress(
                p.steps_completed, p.phase, now, now, batch.restart_count
            )
        else:
            known.phase = p.phase
            known.seen_unix_s = now
        known.collective = (
            CollectiveWait(
                p.inside.op, p.inside.group, p.inside.seq, round(p.inside.entered_unix_us / 1e6, 3)
            )
            if p.HasField("inside")
            else None
        )
        known.stack = p.stack or None

    def _moved(self, entry: dict) -> bool:
        known = self.ranks[entry["rank"]]
        return (known.attempt, known.steps_completed) != (
            entry.get("attempt", 0),
            entry["steps_completed"],
        )

    def _entry(self, rank: int, now: float) -> dict:
        p = self.ranks[rank]
        return asdict(
            HungRank(
                rank=rank,
                attempt=p.attempt,
                steps_completed=p.steps_completed,
                last_step=p.steps_completed - 1,
                phase=p.phase,
                silent_s=round(now - p.changed_unix_s, 1),
                alive=now - p.seen_unix_s < ALIVE_WINDOW_S,
                last_progress_unix_s=round(p.changed_unix_s, 3),
                collective=p.collective,
                stack=p.stack,
            )
        )

    def check(self, now: float | None = None) -> dict | None:
        """The stall record as of ``now`` (Unix s), or None: no stall, or one of the stalled
        ranks moved again.

        A record changes only when a stall begins, when another rank joins it, when every
        stalled rank ended (frozen from then on, with ``ended_unix_s``), or when it is over
        (one of its ranks moved; the others' silence counts from then on):
        each rank's entry is its state when it was found stalled, and the suspects are chosen
        on those states (a rank that dies after the stall was detected, as the user stops the
        job, is no evidence). A new stall waits while another watched rank that is not yet
        stalled has been silent :data:`ABOUT_TO_STALL_SHARE` of the hang timeout: the ranks of
        one hang stop within a step of each other, and the suspects are chosen once all of
        them are in.
        """
        now = time.time() if now is None else now
        record = self.record
        if record is not None:
            still = [e["rank"] for e in record["ranks"] if not self._moved(e)]
            if len(still) < len(record["ranks"]):
                # Progress again: the stall is over for all its ranks. Those not heard moving
                # yet (their batches trail the mover's by up to a flush interval) wait a whole
                # timeout from now before they can stall again: each waited for the suspect
                # and is no suspect of a stall of its own in the meantime.
                for rank in still:
                    self.ranks[rank].waited_until_unix_s = now
                record = None
            elif record.get("ended_unix_s") is not None:
                return record  # frozen: the stalled ranks ended without moving
            elif all(self._is_done(e["rank"], e.get("attempt", 0)) for e in record["ranks"]):
                ended = record.get("ended_unix_s")
                self.record = {
                    **record,
                    "ended_unix_s": round(now, 3),
                    "ranks": [
                        {**e, "silent_s": silent_s(ended, HungRank.from_json(e), now)}
                        for e in record["ranks"]
                    ],
                }
                return self.record
        watched = {
            r: p
            for r, p in self.ranks.items()
            if p.steps_completed  # watched from the first step on: set-up takes what it takes
            and not self._is_done(r, p.attempt)
        }
        joined = {e["rank"] for e in record["ranks"]} if record else set()
        stalled = sorted(
            r for r, p in watched.items() if r not in joined and p.silent_s(now) >= self.timeout_s
        )
        quiet = any(
            r not in joined
            and self.timeout_s * ABOUT_TO_STALL_SHARE <= p.silent_s(now) < self.timeout_s
            for r, p in watched.items()
        )
        if not stalled or (record is None and quiet):
            self.record = record
            return record
        entries = sorted(
            (record["ranks"] if record else []) + [self._entry(r, now) for r in stalled],
            key=lambda e: e["rank"],
        )
        members = {e["rank"] for e in entries}
        others_move = any(p.steps_completed for r, p in self.ranks.items() if r not in members)
        hung = tuple(HungRank.from_json(e) for e in entries)
        self.record = HangRecord(
            detected_unix_s=record["detected_unix_s"] if record else round(now, 3),
            hang_timeout_s=self.timeout_s,
            ended_unix_s=None,
            ranks=hung,
            suspects=tuple(suspects(hung, others_move=others_move)),
        ).to_json()
        return self.record

    async def run(self, persist, say) -> None:
        """Check every :data:`CHECK_INTERVAL_S`; hand each new or changed record (or None once
        a stall is over, including one an earlier aggregator left: :meth:`restore`) to
        ``await persist(record)``, then mirror it in :attr:`stall_file` (written off the event
        loop, its directory made if missing); ``say(line)`` once as a stall is detected and
        once as it ends."""
        last = self.record
        while True:
            await asyncio.sleep(CHECK_INTERVAL_S)
            record = self.check()
            if record == last:
                continue
            detected = (last or {}).get("detected_unix_s")
            if record is None:
                say("the stalled ranks make progress again")
            elif record["detected_unix_s"] != detected:
                say(describe(HangRecord.from_json(record)))
            last = record
            try:
                await persist(record)
                await asyncio.to_thread(self._mirror, record)
            except Exception as exc:  # a full disk must not end the watch; the next check retries
                say(f"could not store the stall record ({type(exc).__name__}: {exc})")
                last = {"detected_unix_s": record["detected_unix_s"]} if record else None

    def _mirror(self, record: dict | None) -> None:
        if record is None:
            self.stall_file.unlink(missing_ok=True)
        else:  # (a standalone aggregator's run directory may not have it yet)
            self.stall_file.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(self.stall_file, json.dumps(record))
