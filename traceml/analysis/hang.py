"""Reading a stall record: the suspects of a hang and the one line that tells of it.

The aggregator's hang watch (``traceml_aggregator/hang.py``) writes the record; this module is
shared by it (the suspects), by the health findings (``RANK_HUNG``) and by node 0's launcher
(the console line). A record is a :class:`~traceml.core.records.HangRecord` (its JSON entry,
``to_json()``, is what the aggregator stores and pushes), its ranks
:class:`~traceml.core.records.HungRank`.

``phase`` is one of :data:`PHASE_ORDER`'s keys (the SDK's ``Progress.phase``); ``attempt`` is
the rank's torchrun attempt (``restart_count``). Each rank's entry is its state when it was
found stalled (``alive``: a batch or process sample of it arrived within the aggregator's alive
window then), so a rank that dies afterwards (the user stopping the job) changes nothing;
``silent_s`` is as of the last change of the record. ``ended_unix_s`` is set once every stalled
rank ended (the record is frozen then, ``silent_s`` up to that moment); None while the stall
lasts (see :func:`silent_s`).

A rank whose step stayed open a share of the hang timeout also reported the collective it is
inside and its main thread's stack (``collective``, ``stack``: ``traceml/sdk/stall.py``);
:func:`collective_hang` reads them: which stalled ranks wait in which collective, and which
never entered it (those are the suspects, :func:`suspects`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from traceml.analysis.findings import ranks_text
from traceml.core.records import HangRecord, HungRank

#: Key of the record in the store's ``meta`` table (JSON).
STALL_META_KEY = "stall"

#: Where a phase falls in a step, to tell which rank is behind (a rank between steps, "idle",
#: has not started the step its peers are in; "step" is inside a step, outside the phases).
PHASE_ORDER = {
    "idle": 0,
    "dataloader": 1,
    "step": 2,
    "h2d": 3,
    "forward": 4,
    "backward": 5,
    "optimizer": 6,
}


@dataclass(frozen=True)
class CollectiveHang:
    """Stalled ranks that wait in one collective, and the stalled ranks that never entered it.

    Attributes:
        op, group, seq: the collective (``torch.distributed`` function or ``"ddp_bucket"``,
            process group name, its number in the group, from 1).
        waiting: the ranks inside it, ascending.
        entered_unix_s: when the first of them entered it (Unix s, that rank's clock).
        absent: the other stalled ranks, which never entered it: inside no collective, inside
            an earlier one of the group or one of another group, or not reported (a dead rank).
    """

    op: str
    group: str
    seq: int
    waiting: tuple[int, ...]
    entered_unix_s: float
    absent: tuple[HungRank, ...]

    def waited_s(self, until_unix_s: float) -> float:
        """Seconds the first waiting rank waited in it, up to ``until_unix_s`` (Unix s; 0 when
        before its entry: clocks of two nodes)."""
        return round(max(0.0, until_unix_s - self.entered_unix_s), 1)

    @property
    def name(self) -> str:
        """``"all_reduce #6 of group default"``."""
        return f"{self.op} #{self.seq} of group {self.group}"


def collective_hang(entries: Sequence[HungRank]) -> CollectiveHang | None:
    """The collective the most stalled ``entries`` are inside (a tie: the latest, by sequence
    number), or None when no entry reports one. A rank inside a later collective of the same
    group passed it, so it is neither waiting nor absent."""
    inside = [(e, e.collective) for e in entries if e.collective is not None]
    if not inside:
        return None
    count = Counter((c.group, c.seq) for _, c in inside)
    (group, seq), _ = max(count.items(), key=lambda kv: (kv[1], kv[0][1], kv[0][0]))
    waiting = [(e, c) for e, c in inside if (c.group, c.seq) == (group, seq)]
    passed = {e.rank for e, c in inside if c.group == group and c.seq > seq}
    left_out = passed | {e.rank for e, _ in waiting}
    return CollectiveHang(
        op=waiting[0][1].op,
        group=group,
        seq=seq,
        waiting=tuple(sorted(e.rank for e, _ in waiting)),
        entered_unix_s=min(c.entered_unix_s for _, c in waiting),
        absent=tuple(sorted((e for e in entries if e.rank not in left_out), key=lambda e: e.rank)),
    )


def sits_at(entry: HungRank) -> str | None:
    """Where ``entry``'s main thread sat: the innermost line of its stack ("file:line in
    function"), None when it sent none."""
    return entry.stack.rsplit("\n", 1)[-1] if entry.stack else None


def collective_text(hang: CollectiveHang, until_unix_s: float) -> str:
    """``"ranks 0, 1, 3 wait in all_reduce #6 of group default for 12 s; rank 2 never entered
    it (alive, at train.py:40 in main)"``, the wait up to ``until_unix_s`` (Unix s)."""
    waiting = ranks_text(list(hang.waiting))
    verb = "waits" if len(hang.waiting) == 1 else "wait"
    text = f"{waiting} {verb} in {hang.name} for {hang.waited_s(until_unix_s):.0f} s"
    for e in hang.absent:
        about = ["alive" if e.alive else "dead"]
        if e.collective is not None:
            c = e.collective
            about.append(f"in {c.op} #{c.seq} of group {c.group}")
        at = sits_at(e)
        about.append(f"at {at}" if at else "no stack reported")
        text += f"; rank {e.rank} never entered it ({', '.join(about)})"
    return text


def suspects(entries: Sequence[HungRank], *, others_move: bool) -> list[int]:
    """The ranks to look at first among the stalled ``entries``: the dead ones while others
    live; else the ranks that never entered the collective the others wait in
    (:func:`collective_hang`); else the ranks furthest behind (fewest steps, then the earliest
    phase); else, when all stand at one place while other ranks finished or move on, all of
    them; else none (all stopped at one place: a collective that cannot complete).

    Args:
        entries: the stalled ranks (``rank``, ``steps_completed``, ``phase``, ``alive``,
            ``collective``).
        others_move: some rank with progress is not stalled (finished, or moving on).
    """
    dead = [e.rank for e in entries if not e.alive]
    if dead and len(dead) < len(entries):
        return dead
    hang = collective_hang(entries)
    if hang is not None and hang.absent:
        return [e.rank for e in hang.absent]
    place = {e.rank: (e.steps_completed, PHASE_ORDER.get(e.phase, 2)) for e in entries}
    behind = min(place.values())
    furthest = [r for r, p in place.items() if p == behind]
    if len(furthest) < len(entries) or others_move:
        return furthest
    return []


def silent_s(ended_unix_s: float | None, entry: HungRank, now_unix_s: float) -> float:
    """Seconds ``entry``'s rank went without a step: up to ``ended_unix_s``, the record's end
    when every stalled rank ended, else (None) up to ``now_unix_s`` (Unix s)."""
    until = ended_unix_s or now_unix_s
    return round(max(entry.silent_s, until - entry.last_progress_unix_s), 1)


def describe(record: HangRecord) -> str:
    """One line for the console: who stopped, where, for how long, the collective the ranks
    wait in and who never entered it (when reported), and the suspect."""
    ranks = record.ranks
    where = "; ".join(
        f"rank {e.rank}: {e.steps_completed} steps done, in {e.phase}"
        + ("" if e.alive else ", no sign of life")
        for e in ranks
    )
    silent = max(e.silent_s for e in ranks)
    names = ", ".join(str(e.rank) for e in ranks)
    attempt = max(e.attempt for e in ranks)
    suspect = record.suspects
    tail = (
        f"suspect: rank {', '.join(map(str, suspect))}"
        if suspect
        else "every stalled rank is at the same place, none differs: no suspect (a "
        "collective that cannot complete?)"
    )
    hang = collective_hang(ranks)
    if hang is not None:  # as of the record's last change, as silent_s
        as_of = max(e.last_progress_unix_s + e.silent_s for e in ranks)
        tail = f"{collective_text(hang, as_of)}; {tail}"
    return (
        f"hang: rank{'s' if len(ranks) > 1 else ''} {names} made no progress for "
        f"{silent:.0f} s{f' in attempt {attempt}' if attempt else ''} ({where}); {tail}"
    )
