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
"""

from __future__ import annotations

from collections.abc import Sequence

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


def suspects(entries: Sequence[HungRank], *, others_move: bool) -> list[int]:
    """The ranks to look at first among the stalled ``entries``: the dead ones while others
    live; else the ranks furthest behind (fewest steps, then the earliest phase); else, when
    all stand at one place while other ranks finished or move on, all of them; else none (all
    stopped at one place: a collective that cannot complete).

    Args:
        entries: the stalled ranks (``rank``, ``steps_completed``, ``phase``, ``alive``).
        others_move: some rank with progress is not stalled (finished, or moving on).
    """
    dead = [e.rank for e in entries if not e.alive]
    if dead and len(dead) < len(entries):
        return dead
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
    """One line for the console: who stopped, where, for how long, and the suspect."""
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
    return (
        f"hang: rank{'s' if len(ranks) > 1 else ''} {names} made no progress for "
        f"{silent:.0f} s{f' in attempt {attempt}' if attempt else ''} ({where}); {tail}"
    )
