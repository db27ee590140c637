"""The launcher's state machines: every legal move of the launch and of node 0's aggregator,
and an illegal one, which is logged as a bug and never raised (fail-open)."""

from __future__ import annotations

import itertools

import pytest

from traceml.launcher.states import (
    AGGREGATOR_TRANSITIONS,
    LAUNCH_TRANSITIONS,
    AggregatorStatus,
    Machine,
    Phase,
)

TABLES = [
    ("launch", LAUNCH_TRANSITIONS, Phase),
    ("aggregator", AGGREGATOR_TRANSITIONS, AggregatorStatus),
]
# In the enums' order, not the frozensets': every xdist worker must collect the same list.
LEGAL = [
    (name, table, old, new)
    for name, table, states in TABLES
    for old in states
    for new in states
    if new in table[old]
]
ILLEGAL = [
    (name, table, old, new)
    for name, table, states in TABLES
    for old, new in itertools.permutations(states, 2)
    if new not in table[old]
]


def test_the_phases_are_the_manifest_statuses_and_every_one_has_a_row():
    assert [p.value for p in Phase] == [
        "starting",
        "training",
        "finalizing",
        "completed",
        "failed",
        "interrupted",
        "abandoned",
    ]
    assert [s.value for s in AggregatorStatus] == [
        "not_started",
        "starting",
        "serving",
        "failed",
        "stopped",
    ]
    for _, table, states in TABLES:
        assert set(table) == set(states)


def test_the_launch_table_is_exactly_the_documented_one():
    assert {old: set(new) for old, new in LAUNCH_TRANSITIONS.items()} == {
        Phase.STARTING: {Phase.TRAINING, Phase.FAILED, Phase.ABANDONED},
        Phase.TRAINING: {Phase.FINALIZING, Phase.ABANDONED},
        Phase.FINALIZING: {Phase.COMPLETED, Phase.FAILED, Phase.INTERRUPTED, Phase.ABANDONED},
        Phase.COMPLETED: set(),
        Phase.FAILED: set(),
        Phase.INTERRUPTED: set(),
        Phase.ABANDONED: set(),
    }
    assert len(LEGAL) == 9 + 9 and len(ILLEGAL) == 7 * 6 + 5 * 4 - 18


def test_every_state_is_reachable_and_every_launch_can_end():
    for _, table, states in TABLES:
        seen, todo = set(), [next(iter(states))]
        while todo:
            state = todo.pop()
            if state not in seen:
                seen.add(state)
                todo.extend(table[state])
        assert seen == set(states)
    ends = {p for p, nexts in LAUNCH_TRANSITIONS.items() if not nexts}
    assert ends == {Phase.COMPLETED, Phase.FAILED, Phase.INTERRUPTED, Phase.ABANDONED}


def ids(moves) -> list[str]:
    return [f"{name}:{old.value}->{new.value}" for name, _, old, new in moves]


@pytest.mark.parametrize("name,table,old,new", LEGAL, ids=ids(LEGAL))
def test_a_legal_move_is_made_silently(name, table, old, new, capsys):
    machine = Machine(name, table, old)
    assert machine.to(new) is True
    assert machine.state is new
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("name,table,old,new", ILLEGAL, ids=ids(ILLEGAL))
def test_an_illegal_move_is_logged_as_a_bug_and_made_anyway(name, table, old, new, capsys):
    machine = Machine(name, table, old)
    assert machine.to(new, "why") is False  # never raised: training goes on
    assert machine.state is new
    assert capsys.readouterr().err == (
        f"traceml: traceml bug: the {name} went from {old.value} to {new.value} (why), which "
        "its transition table does not allow; going on\n"
    )


def test_staying_is_no_move():
    machine = Machine("launch", LAUNCH_TRANSITIONS, Phase.COMPLETED)
    assert machine.to(Phase.COMPLETED) is True and machine.state is Phase.COMPLETED
