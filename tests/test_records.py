"""The record model (traceml/core/records.py) against the wire's generated descriptors, and the
store's and the live aggregates' rows against the model."""

from __future__ import annotations

import dataclasses
import json
from typing import ClassVar

import pytest
from google.protobuf.descriptor import FieldDescriptor

from traceml import wire
from traceml.core import phases, records
from traceml.core.records import END_STATE, OPTIONAL, Record, column
from traceml.wire.records import add_steps
from traceml_aggregator.live import LiveAggregates
from traceml_aggregator.load import load
from traceml_aggregator.store import Store

_SQL_OF_WIRE = {
    FieldDescriptor.TYPE_STRING: "TEXT",
    FieldDescriptor.TYPE_FLOAT: "REAL",
    FieldDescriptor.TYPE_DOUBLE: "REAL",
    FieldDescriptor.TYPE_ENUM: "TEXT",  # the end state's name
    **dict.fromkeys(
        (
            FieldDescriptor.TYPE_UINT32,
            FieldDescriptor.TYPE_UINT64,
            FieldDescriptor.TYPE_INT32,
            FieldDescriptor.TYPE_INT64,
            FieldDescriptor.TYPE_BOOL,
        ),
        "INTEGER",
    ),
}
#: Batch's fields that carry records -> the record kind (the others are the batch's header).
_BATCH_RECORDS = {
    "identity": records.Identity,
    "step_groups": records.StepGroup,
    "process_samples": records.ProcessSample,
    "system_samples": records.SystemSample,
    "finish": records.Finish,
    "flops_counts": records.Flops,
    "counts": records.SenderCounts,
}
#: Batch's message fields no record holds -> why.
_BATCH_WIRE_ONLY = {"progress": "the hang watch's evidence of a rank's step now, not stored"}


def disagreements(cls: type[Record]) -> list[str]:
    """What differs between ``cls``'s columns and its wire message's fields (empty: none)."""
    fields = {fd.name: fd for fd in getattr(wire, cls.WIRE).DESCRIPTOR.fields}
    out = [
        f"{name} is listed as wire-only but is no field"
        for name in cls.WIRE_ONLY
        if name not in fields
    ]
    read = set()
    for c in cls.columns():
        if c.given:
            continue
        name = c.wire or c.name
        read.add(name)
        fd = fields.get(name)
        if fd is None:
            out.append(f"column {c.name} reads {name}, which {cls.WIRE} lacks")
            continue
        if c.sql.split()[0] != _SQL_OF_WIRE[fd.type]:
            out.append(f"column {c.name} is {c.sql}, its field {name} is of type {fd.type}")
        if (c.read == OPTIONAL) != fd.has_presence:
            out.append(
                f"column {c.name} is read as {c.read}, its field's presence is {fd.has_presence}"
            )
        if (c.read == END_STATE) != (fd.enum_type is not None):
            out.append(f"column {c.name} is read as {c.read}, its field is of type {fd.type}")
    for name in fields.keys() - read - cls.WIRE_ONLY.keys():
        out.append(f"{cls.WIRE}.{name} has no column (nor a WIRE_ONLY reason)")
    return out


@pytest.mark.parametrize("cls", records.RECORDS, ids=lambda c: c.__name__)
def test_every_wire_field_has_a_column_and_every_column_a_wire_field(cls):
    assert disagreements(cls) == []
    assert all(reason for reason in cls.WIRE_ONLY.values())
    assert cls.KEY == () or set(cls.KEY) <= set(cls.names())
    assert set(cls.GROUP + cls.ORDER) <= set(cls.names())


def test_a_disagreement_is_caught_both_ways():
    @dataclasses.dataclass(frozen=True, slots=True)
    class Wrong(Record):
        TABLE: ClassVar[str] = "wrong"
        WIRE: ClassVar[str] = "SenderCounts"

        records_produced: int = column("INTEGER NOT NULL")
        records_droped: int = column("INTEGER NOT NULL")  # a typo: no such field
        steps_produced: float = column("REAL")  # the wrong type
        steps_dropped: int = column("INTEGER", read=OPTIONAL)  # no presence on the wire

    assert sorted(disagreements(Wrong)) == sorted(
        [
            "column records_droped reads records_droped, which SenderCounts lacks",
            f"column steps_produced is REAL, its field steps_produced is of type "
            f"{FieldDescriptor.TYPE_UINT64}",
            "column steps_dropped is read as optional, its field's presence is False",
            "SenderCounts.records_dropped has no column (nor a WIRE_ONLY reason)",
        ]
    )


def test_the_batch_and_the_steps_agree_with_the_model():
    batch_messages = {fd.name for fd in wire.Batch.DESCRIPTOR.fields if fd.message_type}
    assert batch_messages == _BATCH_RECORDS.keys() | _BATCH_WIRE_ONLY.keys()
    for name, cls in _BATCH_RECORDS.items():
        expected = "StepColumns" if cls is records.StepGroup else cls.WIRE
        assert wire.Batch.DESCRIPTOR.fields_by_name[name].message_type.name == expected
    step_fields = tuple(fd.name for fd in wire.StepColumns.DESCRIPTOR.fields)
    assert [name for name, _ in records.STEPS_TABLE] == ["rank", "restart", *step_fields]
    assert step_fields == phases.STEP_FIELDS
    assert (
        records.END_STATE_NAMES
        == tuple(records.end_state_name(v.number) for v in wire.EndState.DESCRIPTOR.values)
        == tuple(wire.end_state_name(v.number) for v in wire.EndState.DESCRIPTOR.values)
    )
    for number in (9, -1):  # refused as malformed with the same words as protobuf's
        with pytest.raises(ValueError) as ours:
            records.end_state_name(number)
        with pytest.raises(ValueError) as theirs:
            wire.end_state_name(number)
        assert str(ours.value) == str(theirs.value)


def _batch() -> wire.Batch:
    """One batch carrying every record kind, each optional field set on some and absent on
    others."""
    batch = wire.Batch(rank=1, seq=3, restart_count=2)
    batch.identity.CopyFrom(
        wire.RankIdentity(
            rank=1,
            restart_count=2,
            node_rank=0,
            local_rank=1,
            world_size=2,
            local_world_size=2,
            hostname="h0",
            pid=41,
            start_unix_us=1_000_000,
            torch_version="2.4",
            cuda_version="",
            backend="gloo",
            parallelism="ddp",
            device="cpu",
            gpu_uuid="",
        )
    )
    add_steps(batch, [{"step": 0, "end_us": 900, "step_us": 800, "forward_us": 300}])
    batch.process_samples.add(unix_us=5, rank=1, cpu_percent=12.5, rss_bytes=1 << 30)
    batch.process_samples.add(unix_us=6, rank=1, gpu_reserved_bytes=2 << 30)
    sample = batch.system_samples.add(
        unix_us=5, node_rank=0, hostname="h0", cpu_percent=50.0, ram_total_bytes=8 << 30
    )
    sample.gpus.add(nvml_index=0, uuid="GPU-0", util_percent=90.0, power_w=250.5)
    sample.gpus.add(nvml_index=1, uuid="GPU-1", unavailable_reason="MIG")
    batch.flops_counts.add(step=0, forward_flops=10**12, count_us=5, dtype="bf16")
    batch.finish.CopyFrom(
        wire.RankFinish(last_seq=3, steps_completed=1, end_state=2, reason="RuntimeError: x")
    )
    batch.counts.CopyFrom(wire.SenderCounts(records_produced=4, steps_produced=1))
    return batch


def _node_exit() -> wire.NodeExit:
    report = wire.NodeExit(run_name="r", node_rank=0, hostname="h0", exit_code=1, restart_count=2)
    report.ranks.add(rank=0, local_rank=0, end_state=1, exit_code=0)
    report.ranks.add(rank=1, local_rank=1, end_state=3, signal=9, reason="killed")
    return report


def test_the_store_the_loader_and_the_live_aggregates_hold_the_same_rows(tmp_path):
    store = Store(tmp_path / "t.sqlite")
    store.write_batches([_batch()], received_unix_us=7)
    store.write_node_exit(_node_exit(), received_unix_us=8)
    run = load(store, [])
    live = LiveAggregates("r")
    live.on_batch(_batch())
    live.on_node_exit(_node_exit())
    stored, rl = run.ranks[1], live.ranks[1]
    clock = {"received_unix_us": None}  # the live aggregates stamp their own clock
    assert (
        stored.identity.as_dict()
        == rl.identity.as_dict()
        == {
            "rank": 1,
            "restart": 2,
            "node_rank": 0,
            "local_rank": 1,
            "world_size": 2,
            "local_world_size": 2,
            "hostname": "h0",
            "pid": 41,
            "start_unix_us": 1_000_000,
            "torch_version": "2.4",
            "cuda_version": "",
            "backend": "gloo",
            "parallelism": "ddp",
            "device": "cpu",
            "gpu_uuid": "",
        }
    )
    assert (
        {**stored.finish.as_dict(), **clock}
        == {**rl.finish.as_dict(), **clock}
        == {
            "rank": 1,
            "restart": 2,
            "steps_completed": 1,
            "records_dropped": 0,
            "steps_gpu_unresolved": 0,
            "end_state": "failed",
            "reason": "RuntimeError: x",
            "last_seq": 3,
            "received_unix_us": None,
        }
    )
    assert stored.finish.received_unix_us == 7
    assert (
        stored.flops.as_dict()
        == rl.flops.as_dict()
        == {
            "rank": 1,
            "restart": 2,
            "step": 0,
            "forward_flops": 10**12,
            "count_us": 5,
            "dtype": "bf16",
            "device_name": None,
            "peak_tflops": None,
        }
    )
    assert (
        stored.counts.as_dict()
        == rl.counts.as_dict()
        == {
            "rank": 1,
            "restart": 2,
            "seq": 3,
            "records_produced": 4,
            "records_dropped": 0,
            "steps_produced": 1,
            "steps_dropped": 0,
        }
    )
    assert (
        list(stored.process_samples)
        == list(rl.process_samples)
        == [
            {
                "rank": 1,
                "restart": 2,
                "unix_us": 5,
                "cpu_percent": 12.5,
                "rss_bytes": 1 << 30,
                "gpu_allocated_bytes": None,
                "gpu_reserved_bytes": None,
            },
            {
                "rank": 1,
                "restart": 2,
                "unix_us": 6,
                "cpu_percent": None,
                "rss_bytes": None,
                "gpu_allocated_bytes": None,
                "gpu_reserved_bytes": 2 << 30,
            },
        ]
    )
    assert (
        list(run.system_samples[0])
        == list(live.system_samples[0])
        == [
            {
                "node_rank": 0,
                "unix_us": 5,
                "hostname": "h0",
                "cpu_percent": 50.0,
                "ram_used_bytes": None,
                "ram_total_bytes": 8 << 30,
                "gpu_unavailable_reason": None,
            },
        ]
    )
    assert (
        list(run.gpu_samples[0])
        == list(live.gpu_samples[0])
        == [
            {
                "node_rank": 0,
                "unix_us": 5,
                "nvml_index": 0,
                "uuid": "GPU-0",
                "util_percent": 90.0,
                "memory_used_bytes": None,
                "memory_total_bytes": None,
                "temperature_c": None,
                "power_w": 250.5,
                "unavailable_reason": None,
            },
            {
                "node_rank": 0,
                "unix_us": 5,
                "nvml_index": 1,
                "uuid": "GPU-1",
                "util_percent": None,
                "memory_used_bytes": None,
                "memory_total_bytes": None,
                "temperature_c": None,
                "power_w": None,
                "unavailable_reason": "MIG",
            },
        ]
    )
    assert (
        {**run.node_exits[0].as_dict(), **clock}
        == {**live.node_exits[0].as_dict(), **clock}
        == {
            "node_rank": 0,
            "hostname": "h0",
            "exit_code": 1,
            "restart_count": 2,
            "received_unix_us": None,
        }
    )
    assert (
        {r: run.ranks[r].end.as_dict() for r in (0, 1)}
        == {r: e.as_dict() for r, e in live.rank_ends.items()}
        == {
            0: {
                "rank": 0,
                "local_rank": 0,
                "node_rank": 0,
                "end_state": "completed",
                "exit_code": 0,
                "signal": None,
                "reason": None,
            },
            1: {
                "rank": 1,
                "local_rank": 1,
                "node_rank": 0,
                "end_state": "signaled",
                "exit_code": None,
                "signal": 9,
                "reason": "killed",
            },
        }
    )
    store.close()


def test_a_record_object_is_its_row():
    finish = records.Finish.from_wire(
        wire.RankFinish(last_seq=3, steps_completed=1, end_state=1),
        rank=0,
        restart=0,
        received_unix_us=7,
    )
    assert finish.row() == (0, 0, 1, 0, 0, "completed", None, 3, 7)
    assert finish.as_dict() == records.Finish.wire_dict(
        wire.RankFinish(last_seq=3, steps_completed=1, end_state=1),
        rank=0,
        restart=0,
        received_unix_us=7,
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        finish.rank = 1
    with pytest.raises(TypeError):  # a given column left out
        records.Finish.wire_row(wire.RankFinish(), rank=0, restart=0)
    assert records.Finish.of_type("TEXT") == {"end_state", "reason"}
    assert records.ProcessSample.of_type("INTEGER") == {
        "rank",
        "restart",
        "unix_us",
        "rss_bytes",
        "gpu_allocated_bytes",
        "gpu_reserved_bytes",
    }


def test_every_meta_record_is_written_as_its_declared_schema(tmp_path):
    """Each JSON entry the aggregator keeps in meta is written by its producer as its
    META_RECORDS schema, field for field (what the analysis then reads back)."""
    from traceml_aggregator.hang import HangWatch
    from traceml_aggregator.load import META_RECORDS, run_records
    from traceml_aggregator.script_world import ScriptWorld
    from traceml_aggregator.server import record_loss, record_restart
    from traceml_aggregator.streams import StreamLedger

    def fields(name: str) -> list[str]:
        return [f.name for f in dataclasses.fields(META_RECORDS[name][2])]

    watch = HangWatch(10.0, lambda rank, attempt: False, tmp_path / "stall.json")
    batch = wire.Batch(rank=0, restart_count=1)
    batch.progress.steps_completed, batch.progress.phase = 5, "backward"
    batch.progress.inside.op, batch.progress.inside.group = "ddp_bucket", "default"
    batch.progress.inside.seq, batch.progress.inside.entered_unix_us = 9, 99_500_000
    batch.progress.stack = "train.py:10 in <module>\ntrain.py:4 in main"
    watch.on_batch(batch, now=100.0)
    stall = watch.check(now=111.0)
    assert list(stall) == fields("stall")
    assert stall["ranks"] == [
        {
            "rank": 0,
            "attempt": 1,
            "steps_completed": 5,
            "last_step": 4,
            "phase": "backward",
            "silent_s": 11.0,
            "alive": True,
            "last_progress_unix_s": 100.0,
            "collective": {
                "op": "ddp_bucket",
                "group": "default",
                "seq": 9,
                "entered_unix_s": 99.5,
            },
            "stack": "train.py:10 in <module>\ntrain.py:4 in main",
        }
    ]
    assert list(stall["ranks"][0]["collective"]) == [
        f.name for f in dataclasses.fields(records.CollectiveWait)
    ]
    assert list(stall["ranks"][0]) == [f.name for f in dataclasses.fields(records.HungRank)]
    identity = wire.RankIdentity(rank=0, world_size=4, node_rank=0, own_process_group=True)
    world = ScriptWorld().adopt(identity, 1)
    assert list(world) == fields("script_world")
    store = Store(tmp_path / "t.sqlite")
    restart = record_restart(store, "killed", 0.0)
    assert list(restart) == fields("aggregator_restarts")
    loss = record_loss(store, "exited with code 137 during the run", 1700000000.1234)
    assert loss == {"reason": "exited with code 137 during the run", "lost_unix_s": 1700000000.123}
    assert list(loss) == fields("aggregator_loss")
    assert json.loads(store.meta()[META_RECORDS["aggregator_loss"][0]]) == loss
    store.close()
    ledger = StreamLedger()
    ledger.opened(("rank", 0, 0))
    assert sorted(ledger.entries()[0]) == sorted(fields("sender_streams"))
    # the loader reads each entry as its record, and the record writes the entry back as it was
    typed = run_records(
        {
            "stall": stall,
            "script_world": world,
            "aggregator_restarts": [restart],
            "aggregator_loss": loss,
            "sender_streams": ledger.entries(),
        }
    )
    assert typed["stall"].ranks[0].phase == "backward" and typed["stall"].suspects == ()
    assert typed["stall"].ranks[0].collective == records.CollectiveWait(
        "ddp_bucket", "default", 9, 99.5
    )
    assert typed["stall"].to_json() == stall
    assert typed["script_world"].to_json() == world
    assert [r.to_json() for r in typed["aggregator_restarts"]] == [restart]
    assert typed["aggregator_loss"] == records.AggregatorLoss(
        "exited with code 137 during the run", 1700000000.123
    )
    assert [s.to_json() for s in typed["sender_streams"]] == ledger.entries()
    assert [name for name, (_, _, schema) in META_RECORDS.items() if schema is None] == [
        "rejected",
        "rejected_reasons",  # plain mappings: kind -> count, kind -> reason
    ]


#: sha256 of the tables each store schema version creates (sqlite_master's SQL, whitespace
#: normalized; tests/test_records.py's _layout_digest): version 3 is 963fd02's hand-written
#: DDL, which the model's must equal so that an existing store loads. The checkpoint's ranks'
#: rows, their series and windows (``live_checkpoint_ranks``, ``live_checkpoint_series``,
#: ``live_checkpoint_window``) are left out:
#: those tables are added on open to a store of the same version that lacks them, as
#: ``live_checkpoint`` was, and their layout is ``CHECKPOINT_VERSION``'s
#: (tests/test_checkpoint_units.py).
SCHEMA_DIGESTS = {
    3: "f625c03b0316c2c8b3faa156c39ab22ea68f1021e006e27c852e38165cc455c4",
    4: "91cd9e213155ef8ee6cee85be8cfaaa2e4ad169ebc0deb62e80d8a58cc9e2df6",  # comm_us
    5: "890da51ec89d2b00351788977fdedf3139705140a7f7f6806b022f1b45d0bc5c",  # arrive_*
}


def _layout_digest(path) -> str:
    import hashlib
    import re
    import sqlite3

    db = sqlite3.connect(path)
    text = "\n".join(
        re.sub(r"\s+", " ", sql).replace("( ", "(").replace(" )", ")")
        for (sql,) in db.execute(
            "SELECT sql FROM sqlite_master WHERE sql IS NOT NULL "
            "AND name NOT LIKE 'live_checkpoint_%' ORDER BY name"
        )
    )
    db.close()
    return hashlib.sha256(text.encode()).hexdigest()


def test_the_tables_change_only_with_the_schema_version(tmp_path):
    """A column added to (or changed in) a record changes the store's tables: this fails until
    SCHEMA_VERSION is raised and its digest added here (a store of another version is refused
    when opened, instead of being read with the wrong columns)."""
    from traceml_aggregator.store import SCHEMA_VERSION

    Store(tmp_path / "t.sqlite").close()
    digest = _layout_digest(tmp_path / "t.sqlite")
    assert digest == SCHEMA_DIGESTS.get(SCHEMA_VERSION), (
        f"the store's tables are {digest}, not those of SCHEMA_VERSION {SCHEMA_VERSION}: a new "
        "layout takes a new SCHEMA_VERSION and its digest in SCHEMA_DIGESTS"
    )
