"""The record model: one typed record per kind of thing the aggregator receives and stores.

Between the wire (:mod:`traceml.wire`, protobuf) and the analysis (:mod:`traceml.analysis`)
every record has one declaration here: a frozen dataclass whose fields are the columns of its
store table, in order, each with its SQL type and, in the class docstring, its unit. Everything
else derives from these classes:

* the store's tables and inserts (:func:`create_table`, :func:`insert`, used by
  :mod:`traceml_aggregator.store`);
* reading a wire message (:meth:`Record.from_wire` for a record object, :meth:`Record.wire_row`
  for the store's row tuple, without a Python object per field: the ingest path);
* what :class:`~traceml.analysis.rundata.RunData` holds: the record objects themselves, read
  from the store's rows by the loader (:meth:`Record.from_row`) and from the wire by the live
  aggregates (:meth:`Record.from_wire`); their sample rows are :meth:`Record.wire_dict`, the
  store's row as ``{column: value}``, which is what the loader reads back;
* the loader's and the checkpoint's sample tables (:attr:`Record.TABLE`, :attr:`Record.GROUP`,
  :attr:`Record.ORDER`, the column types).

A column is read from the message's field of the same name (``wire=`` names another), or given
by the caller (``given=`` says what it is: the batch's rank, the time it was received); its
``read`` says how (:data:`VALUE` as is, :data:`OPTIONAL` None when absent, :data:`NONZERO` None
when unset, :data:`END_STATE` the end state's name). Reading only touches attributes, so this
module imports no generated code (the offline library may import it);
``tests/test_records.py`` fails when a message's fields and its record's columns disagree (a
wire field that no column reads must be listed in :attr:`Record.WIRE_ONLY` with the reason).

Adding a stored field: the field in the ``.proto`` (then ``tools/gen_proto.sh``), and its
column in the record's class (raising ``SCHEMA_VERSION`` in :mod:`traceml_aggregator.store`);
see ``docs/architecture.md``. A step field is a row of the phase table instead
(:mod:`traceml.core.phases`): steps travel and are stored as columns (:class:`StepGroup`).

The run's own records that the aggregator keeps as JSON entries of the store's ``meta`` table
(not rows) are declared here too (:class:`MetaRecord`: :class:`HangRecord`, its
:class:`HungRank` and their :class:`CollectiveWait`, :class:`ScriptWorld`,
:class:`AggregatorRestart`, :class:`AggregatorLoss`, :class:`LostNode`, :class:`StreamEnd`);
``META_RECORDS`` in
:mod:`traceml_aggregator.load` lists every such entry with its key and record.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

from traceml.core import ends, phases

#: How a column is read from its wire field: as it is.
VALUE = "value"
#: An ``optional`` field: None when absent.
OPTIONAL = "optional"
#: None when unset: an empty string, or 0 (proto3 cannot tell it from unset).
NONZERO = "nonzero"
#: An ``EndState`` number: its name (:data:`END_STATE_NAMES`).
END_STATE = "end_state"

#: ``EndState`` names by number (0 is ``END_STATE_UNSPECIFIED``): what the store keeps.
END_STATE_NAMES = ("unspecified",) + ends.REPORTED_END_STATES


def end_state_name(number: int) -> str:
    """The name of ``EndState`` ``number`` (``3`` -> ``"signaled"``).

    Raises:
        ValueError: not a number of the enum.
    """
    if 0 <= number < len(END_STATE_NAMES):
        return END_STATE_NAMES[number]
    raise ValueError(f"Enum EndState has no name defined for value {number}")  # protobuf's words


def column(sql: str, *, wire: str | None = None, read: str = VALUE, given: str = "") -> Any:
    """A record's field that is a column of its table.

    Args:
        sql: the column's SQL type and constraint (``"INTEGER NOT NULL"``, ``"TEXT"``).
        wire: the wire field it is read from, when not the column's own name.
        read: how the wire field is read (:data:`VALUE`, :data:`OPTIONAL`, :data:`NONZERO`,
            :data:`END_STATE`).
        given: not read from the message: what the caller gives (why it is not the message's).
    """
    return field(metadata={"sql": sql, "wire": wire, "read": read, "given": given})


@dataclass(frozen=True, slots=True)
class Column:
    """One column of a record's table (see :func:`column`)."""

    name: str
    sql: str
    wire: str | None
    read: str
    given: str


#: A record class's own type (what its ``from_wire`` returns).
_R = TypeVar("_R", bound="Record")


class Record:
    """Base of the stored records (a frozen dataclass each). Class attributes:

    Attributes:
        TABLE: the store's table.
        KEY: the table's primary key, when it has one of several columns (a table ``WITHOUT
            ROWID``); one column's is in its SQL (``INTEGER PRIMARY KEY``).
        REPLACE: a row replaces the one of the same key (``INSERT OR REPLACE``).
        GROUP: the columns a sample table's rows are grouped by when read (one group per
            rank's attempt, or per node).
        ORDER: the columns a sample table is read in order of, within a group.
        WIRE: the wire message it is read from (its name in :mod:`traceml.wire`).
        WIRE_ONLY: the wire message's fields no column reads -> why.
    """

    __slots__ = ()
    TABLE: ClassVar[str]
    KEY: ClassVar[tuple[str, ...]] = ()
    REPLACE: ClassVar[bool] = False
    GROUP: ClassVar[tuple[str, ...]] = ()
    ORDER: ClassVar[tuple[str, ...]] = ()
    WIRE: ClassVar[str]
    WIRE_ONLY: ClassVar[dict[str, str]] = {}

    @classmethod
    def columns(cls) -> tuple[Column, ...]:
        """The table's columns, in order (the dataclass's fields)."""
        return _columns(cls)

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The table's column names, in order."""
        return _names(cls)

    @classmethod
    def of_type(cls, sql_type: str) -> frozenset[str]:
        """The names of the columns of SQL type ``sql_type`` (``"INTEGER"``, ``"REAL"``,
        ``"TEXT"``)."""
        return frozenset(c.name for c in _columns(cls) if c.sql.split()[0] == sql_type)

    @classmethod
    def wire_row(cls, message: Any, **given: Any) -> tuple[Any, ...]:
        """The store's row of wire ``message`` (a tuple in column order); ``given`` holds the
        columns not read from the message (by name).

        Raises:
            ValueError: an unknown end state.
            TypeError: a given column is missing.
        """
        row: tuple[Any, ...] = _reader(cls, False)(message, **given)
        return row

    @classmethod
    def wire_dict(cls, message: Any, **given: Any) -> dict[str, Any]:
        """:meth:`wire_row` as ``{column: value}`` (a row as the loader reads it back)."""
        row: dict[str, Any] = _reader(cls, True)(message, **given)
        return row

    @classmethod
    def from_wire(cls: type[_R], message: Any, **given: Any) -> _R:
        """The record of wire ``message`` (see :meth:`wire_row`)."""
        return cls(*_reader(cls, False)(message, **given))

    @classmethod
    def from_row(cls: type[_R], row: Mapping[str, Any]) -> _R:
        """The record of the store's ``row`` (``{column: value}``, e.g. a ``sqlite3.Row`` of
        ``SELECT *``).

        Raises:
            KeyError: a column is missing.
        """
        return cls(*(row[name] for name in _names(cls)))

    def row(self) -> tuple[Any, ...]:
        """This record as the store's row (a tuple in column order)."""
        return tuple(getattr(self, name) for name in _names(type(self)))

    def as_dict(self) -> dict[str, Any]:
        """This record as ``{column: value}``."""
        return dict(zip(self.names(), self.row(), strict=True))


def _columns_of(cls: type) -> tuple[Column, ...]:
    return tuple(
        Column(
            f.name, f.metadata["sql"], f.metadata["wire"], f.metadata["read"], f.metadata["given"]
        )
        for f in dataclasses.fields(cls)
    )


#: The columns of a record class (cached: a class's fields do not change).
_columns: Callable[[type], tuple[Column, ...]] = functools.cache(_columns_of)


def _names_of(cls: type) -> tuple[str, ...]:
    return tuple(c.name for c in _columns(cls))


_names: Callable[[type], tuple[str, ...]] = functools.cache(_names_of)


def _reader_of(cls: type, as_dict: bool) -> Callable[..., Any]:
    """A function ``(message, **given) -> row`` for ``cls`` (a tuple in column order, or with
    ``as_dict`` a dict), compiled from its columns: one expression per column, no loop, no
    ``ListFields`` (a ``HasField`` per optional field costs a third of it), as the ingest
    path and the live aggregates read every sample through it."""
    given = [c.name for c in _columns(cls) if c.given]
    values = []
    for c in _columns(cls):
        if c.given:
            values.append(c.name)
            continue
        attr = f"m.{c.wire or c.name}"
        values.append(
            {
                VALUE: attr,
                OPTIONAL: f"({attr} if m.HasField({c.wire or c.name!r}) else None)",
                NONZERO: f"({attr} or None)",
                END_STATE: f"_end_state({attr})",
            }[c.read]
        )
    params = ", ".join(["m", *(["*"] if given else []), *given])
    if as_dict:
        items = ", ".join(f"{c.name!r}: {v}" for c, v in zip(_columns(cls), values, strict=True))
        source = f"def read({params}):\n    return {{{items}}}\n"
    else:
        source = f"def read({params}):\n    return ({', '.join(values)},)\n"
    scope: dict[str, Any] = {"_end_state": end_state_name}
    exec(compile(source, f"<{cls.__name__} reader>", "exec"), scope)  # noqa: S102 (our text)
    read: Callable[..., Any] = scope["read"]
    return read


#: The compiled reader of a record class (see :func:`_reader_of`), one per class and shape.
_reader: Callable[[type, bool], Callable[..., Any]] = functools.cache(_reader_of)


def create_table(cls: type[Record]) -> str:
    """The ``CREATE TABLE IF NOT EXISTS`` statement of ``cls``'s table."""
    return table_sql(cls.TABLE, [(c.name, c.sql) for c in cls.columns()], cls.KEY)


def table_sql(table: str, columns: Sequence[tuple[str, str]], key: Sequence[str] = ()) -> str:
    """``CREATE TABLE IF NOT EXISTS table`` of ``columns`` ((name, SQL) pairs), with a primary
    key of the columns ``key`` (then ``WITHOUT ROWID``) when given."""
    parts = [f"{name} {sql}" for name, sql in columns]
    if key:
        parts.append(f"PRIMARY KEY ({', '.join(key)})")
    rowid = " WITHOUT ROWID" if key else ""
    return f"CREATE TABLE IF NOT EXISTS {table} ({', '.join(parts)}){rowid};"


def insert(cls: type[Record]) -> str:
    """The INSERT of one row of ``cls`` (``INSERT OR REPLACE`` when :attr:`Record.REPLACE`),
    its values bound in column order."""
    verb = "INSERT OR REPLACE" if cls.REPLACE else "INSERT"
    names = cls.names()
    return f"{verb} INTO {cls.TABLE} ({', '.join(names)}) VALUES ({', '.join(['?'] * len(names))})"


# --- the records a batch carries -------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Identity(Record):
    """Who a rank is (``ranks``): once per attempt, from the first batch of its stream.

    Columns: rank (global), restart (the attempt: ``TORCHELASTIC_RESTART_COUNT``), node_rank,
    local_rank, world_size, local_world_size (torchrun's, or the script's own process group),
    hostname, pid, start_unix_us (wall clock at ``traceml.init()``, µs since the epoch; a
    step's ``end_us`` counts from it), torch_version, cuda_version ("" without CUDA), backend
    ("gloo", "nccl", ""), parallelism ("ddp", "fsdp", "single"), device ("cpu",
    "cuda:<index>"), gpu_uuid (the device's, as NVML names it; "" on CPU).
    """

    TABLE: ClassVar[str] = "ranks"
    KEY: ClassVar[tuple[str, ...]] = ("rank", "restart")
    REPLACE: ClassVar[bool] = True
    WIRE: ClassVar[str] = "RankIdentity"
    WIRE_ONLY: ClassVar[dict[str, str]] = {
        "run_name": "the run is the store's: a batch of another run is refused before",
        "own_process_group": "read by the aggregator when it adopts the script's world "
        "(traceml_aggregator/script_world.py), which it keeps in meta",
    }

    rank: int = column("INTEGER NOT NULL")
    restart: int = column("INTEGER NOT NULL", wire="restart_count")
    node_rank: int = column("INTEGER")
    local_rank: int = column("INTEGER")
    world_size: int = column("INTEGER")
    local_world_size: int = column("INTEGER")
    hostname: str = column("TEXT")
    pid: int = column("INTEGER")
    start_unix_us: int = column("INTEGER")
    torch_version: str = column("TEXT")
    cuda_version: str = column("TEXT")
    backend: str = column("TEXT")
    parallelism: str = column("TEXT")
    device: str = column("TEXT")
    gpu_uuid: str = column("TEXT")


@dataclass(frozen=True, slots=True)
class ProcessSample(Record):
    """One sample of a rank's process (``process_samples``), about once a second.

    Columns: rank, restart (the process's attempt), unix_us (µs since the epoch), cpu_percent
    (% of one core; above 100 with many threads), rss_bytes, gpu_allocated_bytes,
    gpu_reserved_bytes (the CUDA caching allocator's, bytes); None where not measured.
    """

    TABLE: ClassVar[str] = "process_samples"
    ORDER: ClassVar[tuple[str, ...]] = ("unix_us",)
    WIRE: ClassVar[str] = "ProcessSample"
    GROUP: ClassVar[tuple[str, ...]] = ("rank", "restart")
    WIRE_ONLY: ClassVar[dict[str, str]] = {
        "rank": "the owner is given: the sample's for a node sampler, the batch's for a rank",
        "restart_count": "the owner's attempt is given, as its rank",
    }

    rank: int = column("INTEGER NOT NULL", given="the process's rank (see WIRE_ONLY)")
    restart: int = column("INTEGER NOT NULL", given="the process's attempt")
    unix_us: int = column("INTEGER NOT NULL")
    cpu_percent: float | None = column("REAL", read=OPTIONAL)
    rss_bytes: int | None = column("INTEGER", read=OPTIONAL)
    gpu_allocated_bytes: int | None = column("INTEGER", read=OPTIONAL)
    gpu_reserved_bytes: int | None = column("INTEGER", read=OPTIONAL)


@dataclass(frozen=True, slots=True)
class SystemSample(Record):
    """One sample of a node (``system_samples``), about once a second.

    Columns: node_rank, unix_us (µs since the epoch), hostname, cpu_percent (all cores,
    0-100), ram_used_bytes, ram_total_bytes; gpu_unavailable_reason (why the sample has no
    GPU, None when it has). The sample's GPUs are :class:`GpuSample` rows.
    """

    TABLE: ClassVar[str] = "system_samples"
    ORDER: ClassVar[tuple[str, ...]] = ("unix_us",)
    WIRE: ClassVar[str] = "SystemSample"
    GROUP: ClassVar[tuple[str, ...]] = ("node_rank",)
    WIRE_ONLY: ClassVar[dict[str, str]] = {"gpus": "stored as GpuSample rows"}

    node_rank: int = column("INTEGER NOT NULL")
    unix_us: int = column("INTEGER NOT NULL")
    hostname: str = column("TEXT")
    cpu_percent: float | None = column("REAL", read=OPTIONAL)
    ram_used_bytes: int | None = column("INTEGER", read=OPTIONAL)
    ram_total_bytes: int | None = column("INTEGER", read=OPTIONAL)
    gpu_unavailable_reason: str | None = column("TEXT", read=NONZERO)


@dataclass(frozen=True, slots=True)
class GpuSample(Record):
    """One GPU of a system sample (``gpu_samples``).

    Columns: node_rank, unix_us (the system sample's), nvml_index, uuid, util_percent (0-100),
    memory_used_bytes, memory_total_bytes, temperature_c (°C), power_w (W);
    unavailable_reason (why NVML gave a figure none, None when it gave all).
    """

    TABLE: ClassVar[str] = "gpu_samples"
    ORDER: ClassVar[tuple[str, ...]] = ("unix_us", "nvml_index")
    WIRE: ClassVar[str] = "GpuSample"
    GROUP: ClassVar[tuple[str, ...]] = ("node_rank",)

    node_rank: int = column("INTEGER NOT NULL", given="the system sample's node")
    unix_us: int = column("INTEGER NOT NULL", given="the system sample's time")
    nvml_index: int = column("INTEGER NOT NULL")
    uuid: str = column("TEXT")
    util_percent: float | None = column("REAL", read=OPTIONAL)
    memory_used_bytes: int | None = column("INTEGER", read=OPTIONAL)
    memory_total_bytes: int | None = column("INTEGER", read=OPTIONAL)
    temperature_c: float | None = column("REAL", read=OPTIONAL)
    power_w: float | None = column("REAL", read=OPTIONAL)
    unavailable_reason: str | None = column("TEXT", read=NONZERO)


@dataclass(frozen=True, slots=True)
class Finish(Record):
    """A rank's finish marker (``rank_finish``): the last batch of its attempt.

    Columns: rank, restart, steps_completed, records_dropped (records the client gave up),
    steps_gpu_unresolved (steps whose CUDA events never completed), end_state (a name of
    :data:`END_STATE_NAMES`), reason (exception type and message; None when none), last_seq
    (the sequence number of the batch carrying it), received_unix_us (µs since the epoch, the
    aggregator's clock).
    """

    TABLE: ClassVar[str] = "rank_finish"
    KEY: ClassVar[tuple[str, ...]] = ("rank", "restart")
    REPLACE: ClassVar[bool] = True
    WIRE: ClassVar[str] = "RankFinish"

    rank: int = column("INTEGER NOT NULL", given="the batch's rank")
    restart: int = column("INTEGER NOT NULL", given="the batch's attempt")
    steps_completed: int = column("INTEGER NOT NULL")
    records_dropped: int = column("INTEGER NOT NULL")
    steps_gpu_unresolved: int = column("INTEGER NOT NULL")
    end_state: str = column("TEXT NOT NULL", read=END_STATE)
    reason: str | None = column("TEXT", read=NONZERO)
    last_seq: int = column("INTEGER NOT NULL")
    received_unix_us: int = column("INTEGER NOT NULL", given="the aggregator's clock")


@dataclass(frozen=True, slots=True)
class Flops(Record):
    """How a rank counted its model's FLOPs (``rank_flops``; the latest count replaces).

    Columns: rank, restart, step (whose forward was counted), forward_flops (FLOPs of that
    forward; a multiply-add is 2), count_us (its wall time, µs, counting included), dtype
    ("bf16", ...), device_name, peak_tflops (TFLOPS the user gave; None when none).
    """

    TABLE: ClassVar[str] = "rank_flops"
    KEY: ClassVar[tuple[str, ...]] = ("rank", "restart")
    REPLACE: ClassVar[bool] = True
    WIRE: ClassVar[str] = "FlopsCount"

    rank: int = column("INTEGER NOT NULL", given="the batch's rank")
    restart: int = column("INTEGER NOT NULL", given="the batch's attempt")
    step: int = column("INTEGER NOT NULL")
    forward_flops: int = column("INTEGER NOT NULL")
    count_us: int = column("INTEGER NOT NULL")
    dtype: str | None = column("TEXT", read=NONZERO)
    device_name: str | None = column("TEXT", read=NONZERO)
    peak_tflops: float | None = column("REAL", read=NONZERO)  # 0: not given


@dataclass(frozen=True, slots=True)
class SenderCounts(Record):
    """A rank's client's running totals of its attempt (``sender_counts``; the latest
    replaces), with the ``seq`` of the batch that carried them.

    Columns: rank, restart, seq, records_produced, records_dropped, steps_produced,
    steps_dropped (counts).
    """

    TABLE: ClassVar[str] = "sender_counts"
    KEY: ClassVar[tuple[str, ...]] = ("rank", "restart")
    REPLACE: ClassVar[bool] = True
    WIRE: ClassVar[str] = "SenderCounts"

    rank: int = column("INTEGER NOT NULL", given="the batch's rank")
    restart: int = column("INTEGER NOT NULL", given="the batch's attempt")
    seq: int = column("INTEGER NOT NULL", given="the batch's sequence number")
    records_produced: int = column("INTEGER NOT NULL")
    records_dropped: int = column("INTEGER NOT NULL")
    steps_produced: int = column("INTEGER NOT NULL")
    steps_dropped: int = column("INTEGER NOT NULL")


@dataclass(frozen=True, slots=True)
class StepGroup:
    """Steps of one rank's attempt as columns (a wire ``StepColumns``), stored as rows of
    ``steps`` (:data:`STEPS_TABLE`: rank, restart, then :data:`traceml.core.phases.STEP_FIELDS`;
    µs, bytes, counts; NULL where not measured).

    Attributes:
        names: the fields measured, in :data:`~traceml.core.phases.STEP_FIELDS` order.
        columns: one sequence per name, one entry per step.
    """

    rank: int
    restart: int
    names: tuple[str, ...]
    columns: Sequence[Sequence[int]]

    @classmethod
    def from_wire(cls, group: Any, *, rank: int, restart: int) -> StepGroup:
        """The steps of ``group`` (a StepColumns) of ``rank``'s attempt ``restart``.

        Raises:
            ValueError: the group is malformed (:func:`step_group_columns`).
        """
        return cls(rank, restart, *step_group_columns(group))


def step_group_columns(group: Any) -> tuple[tuple[str, ...], list[Sequence[int]]]:
    """The names and columns of the fields measured in ``group`` (a StepColumns).

    Returns:
        ``(names, columns)``: the non-empty columns in field order, each with one entry per
        step of the group (µs or bytes); ``((), [])`` for an empty group.

    Raises:
        ValueError: the group is malformed: a required column is missing, or the columns
            differ in length (the sender's bug; nothing of its batch may be stored).
    """
    fields = group.ListFields()  # the non-empty columns, in field number order
    if not fields:
        return (), []
    descriptors, columns = zip(*fields, strict=True)
    names, lacking = _group_layout(descriptors)
    if lacking or len(set(map(len, columns))) != 1:
        steps = len(group.step)
        uneven = [name for name, column in zip(names, columns, strict=True) if len(column) != steps]
        raise ValueError(
            f"malformed step group: {steps} steps, "
            + (f"no {', '.join(lacking)} column" if lacking else "")
            + ("; " if lacking and uneven else "")
            + (f"columns of another length: {', '.join(uneven)}" if uneven else "")
        )
    return names, list(columns)


@functools.lru_cache(maxsize=256)
def _group_layout(descriptors: tuple[Any, ...]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The names of a StepColumns' measured fields (``descriptors``: theirs, in field number
    order) and the required fields missing among them; cached, as a run's groups measure the
    same few sets of fields (decoding each group's names cost a third of the decode)."""
    names = tuple(fd.name for fd in descriptors)
    return names, tuple(name for name in phases.STEP_REQUIRED_FIELDS if name not in names)


#: The ``steps`` table: (column, SQL) in order. No key on purpose (see the store).
STEPS_TABLE = (
    ("rank", "INTEGER NOT NULL"),
    ("restart", "INTEGER NOT NULL"),
    *((name, "INTEGER NOT NULL") for name in phases.STEP_REQUIRED_FIELDS),
    *((name, "INTEGER") for name in phases.STEP_OPTIONAL_FIELDS),
)


# --- the records of a node's exit ------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class NodeExit(Record):
    """A node's torchrun exit (``node_exits``; a later report replaces).

    Columns: node_rank, hostname, exit_code (torchrun's), restart_count (attempts torchrun
    made), received_unix_us (µs since the epoch, the aggregator's clock).
    """

    TABLE: ClassVar[str] = "node_exits"
    REPLACE: ClassVar[bool] = True
    WIRE: ClassVar[str] = "NodeExit"
    WIRE_ONLY: ClassVar[dict[str, str]] = {
        "run_name": "the run is the store's: a report of another run is refused before",
        "ranks": "stored as RankEnd rows",
    }

    node_rank: int = column("INTEGER PRIMARY KEY")
    hostname: str = column("TEXT")
    exit_code: int = column("INTEGER NOT NULL")
    restart_count: int = column("INTEGER NOT NULL")
    received_unix_us: int = column("INTEGER NOT NULL", given="the aggregator's clock")


@dataclass(frozen=True, slots=True)
class RankEnd(Record):
    """How a rank ended, as its node's launcher saw it (``rank_ends``; a later report
    replaces).

    Columns: rank, local_rank, node_rank, end_state (a name of :data:`END_STATE_NAMES`),
    exit_code, signal (None when unknown), reason (torchrun's error file's; None when none).
    """

    TABLE: ClassVar[str] = "rank_ends"
    REPLACE: ClassVar[bool] = True
    WIRE: ClassVar[str] = "RankEnd"

    rank: int = column("INTEGER PRIMARY KEY")
    local_rank: int = column("INTEGER")
    node_rank: int = column("INTEGER NOT NULL", given="the NodeExit's node")
    end_state: str = column("TEXT NOT NULL", read=END_STATE)
    exit_code: int | None = column("INTEGER", read=OPTIONAL)
    signal: int | None = column("INTEGER", read=OPTIONAL)
    reason: str | None = column("TEXT", read=NONZERO)


#: Every stored record, in the order of their tables in the store.
RECORDS: tuple[type[Record], ...] = (
    Identity,
    ProcessSample,
    SystemSample,
    GpuSample,
    Finish,
    Flops,
    SenderCounts,
    NodeExit,
    RankEnd,
)
#: The sample records, whose tables the loader reads as columns grouped by their ``GROUP``.
SAMPLES: tuple[type[Record], ...] = (ProcessSample, SystemSample, GpuSample)


# --- the run's own records, kept as JSON entries of the store's meta table -------------------

#: A meta record class's own type (what its ``from_json`` returns).
_M = TypeVar("_M", bound="MetaRecord")


class MetaRecord:
    """Base of the run's own records (a frozen dataclass each), kept by the aggregator as JSON
    entries of the store's ``meta`` table: the entry is ``dataclasses.asdict`` of the record
    (:meth:`to_json`), or a list of them."""

    __slots__ = ()

    @classmethod
    def from_json(cls: type[_M], entry: Mapping[str, Any]) -> _M:
        """The record of the decoded JSON ``entry`` (``{field: value}``).

        Raises:
            TypeError: a field is missing or unknown.
        """
        return cls(**entry)

    def to_json(self) -> dict[str, Any]:
        """This record as its JSON entry (``dataclasses.asdict``)."""
        # each subclass is a dataclass; mypy cannot know it of the base
        entry: dict[str, Any] = dataclasses.asdict(self)  # type: ignore[call-overload]
        return entry


@dataclass(frozen=True, slots=True)
class CollectiveWait(MetaRecord):
    """The collective a stalled rank was inside (its ``Progress.inside``; see
    ``proto/traceml/wire/v1/step.proto``).

    Attributes:
        op: the ``torch.distributed`` function name, or ``"ddp_bucket"``.
        group: process group name (``"default"`` for the default group).
        seq: its number in ``group`` on that rank, from 1 (the same collective has the same
            number on every rank of the group).
        entered_unix_s: when the rank entered it (Unix s, the rank's clock).
    """

    op: str
    group: str
    seq: int
    entered_unix_s: float


@dataclass(frozen=True, slots=True)
class HungRank(MetaRecord):
    """One rank of a :class:`HangRecord`: its state when it was found stalled.

    Attributes:
        rank: global rank.
        attempt: its torchrun attempt (``restart_count``).
        steps_completed: steps it had finished; ``last_step`` is that minus 1.
        phase: where it stood (the SDK's ``Progress.phase``: "idle", "dataloader", "step",
            "h2d", "forward", "backward", "optimizer").
        silent_s: seconds without a step, as of the record's last change (s).
        alive: a batch or process sample of it arrived within the aggregator's alive window.
        last_progress_unix_s: when its step count last moved (Unix s).
        collective: the collective it was inside, None: inside none, or not reported (an
            older SDK, a rank that sent nothing since its step stayed open, or a failed read).
        stack: its main thread's Python stack as it reported it (``Progress.stack``:
            "file:line in function" lines, outermost first, newline-separated), None: not
            reported.
    """

    rank: int
    attempt: int
    steps_completed: int
    last_step: int
    phase: str
    silent_s: float
    alive: bool
    last_progress_unix_s: float
    collective: CollectiveWait | None = None
    stack: str | None = None

    @classmethod
    def from_json(cls, entry: Mapping[str, Any]) -> HungRank:
        """The rank of the decoded JSON ``entry`` (an entry stored before ranks had an
        ``attempt`` reads as attempt 0; one without ``collective`` or ``stack``, as None).

        Raises:
            TypeError: a field is missing or unknown.
        """
        inside = entry.get("collective")
        if isinstance(inside, Mapping):
            entry = {**entry, "collective": CollectiveWait.from_json(inside)}
        return cls(**{"attempt": 0, **entry})


@dataclass(frozen=True, slots=True)
class HangRecord(MetaRecord):
    """The aggregator's record of a hang (stored under the meta key ``stall``, its on-disk
    name; read by :mod:`traceml.analysis.hang`), as JSON: ``dataclasses.asdict`` of this.

    Attributes:
        detected_unix_s: when the first rank of it was found stalled (Unix s).
        hang_timeout_s: the hang timeout then (s).
        ended_unix_s: when every stalled rank ended (the record is frozen from then on; Unix
            s), None while the stall lasts.
        ranks: the stalled ranks, by rank.
        suspects: the ranks to look at first (see :func:`traceml.analysis.hang.suspects`).
    """

    detected_unix_s: float
    hang_timeout_s: float
    ended_unix_s: float | None
    ranks: tuple[HungRank, ...]
    suspects: tuple[int, ...]

    @classmethod
    def from_json(cls, entry: Mapping[str, Any]) -> HangRecord:
        """The record of the decoded JSON ``entry``, its ranks as :class:`HungRank`.

        Raises:
            KeyError: ``ranks`` or ``suspects`` is missing.
            TypeError: another field is missing, or one is unknown.
        """
        ranks = tuple(HungRank.from_json(e) for e in entry["ranks"])
        return cls(**{**entry, "ranks": ranks, "suspects": tuple(entry["suspects"])})

    def to_json(self) -> dict[str, Any]:
        """This record as its JSON entry (lists where the record holds tuples)."""
        entry = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return {
            **entry,
            "ranks": [e.to_json() for e in self.ranks],
            "suspects": list(self.suspects),
        }


@dataclass(frozen=True, slots=True)
class ScriptWorld(MetaRecord):
    """The world the script built itself, when the aggregator took it as the run's (meta key
    ``script_world``; see ``traceml_aggregator/script_world.py``), as JSON:
    ``dataclasses.asdict`` of this.

    Attributes:
        world_size: ranks of the script's own process group.
        node_rank: the node they run on.
        launched_world_size: torchrun's world size (None when unknown).
        adopted_unix_s: when the aggregator took it (Unix s).
    """

    world_size: int
    node_rank: int
    launched_world_size: int | None
    adopted_unix_s: float


@dataclass(frozen=True, slots=True)
class AggregatorRestart(MetaRecord):
    """One replacement of node 0's aggregator on the run's store (meta key
    ``aggregator_restarts``: a JSON list of these, in order; written by
    ``traceml_aggregator/server.py``).

    Attributes:
        reason: why the previous aggregator ended (one line).
        gap_s: seconds from the death the launcher saw to the replacement serving (s).
        restarted_unix_s: when the replacement served (Unix s).
    """

    reason: str
    gap_s: float
    restarted_unix_s: float


@dataclass(frozen=True, slots=True)
class AggregatorLoss(MetaRecord):
    """Node 0's aggregator lost for good: it died (or a replacement did not serve) and the
    launcher did not restart it, or its store stopped committing (a full disk), so nothing
    sent after ``lost_unix_s`` was stored (meta key ``aggregator_loss``: one JSON object;
    written by ``traceml-aggregator --finalize-only`` from the launcher's supervisor, or by
    the aggregator's own finalization, ``traceml_aggregator/server.py``).

    Attributes:
        reason: why it was lost, as the launcher's warning says it, or ``its store failed to
            commit: ERROR`` (one line).
        lost_unix_s: when the launcher saw the death that ended the telemetry, or the store's
            first failed commit (Unix s).
    """

    reason: str
    lost_unix_s: float


@dataclass(frozen=True, slots=True)
class LostNode(MetaRecord):
    """A node the aggregator lost: nothing came from its launcher in time (its session stream
    broke and no new one came, or the launcher or its host stalled) (meta key
    ``node_losses``: a JSON list of these, in order; written by
    ``traceml_aggregator/sessions.py``).

    Attributes:
        node_rank: the node.
        hostname: its host, as its claim named it (None when unknown).
        last_heard_unix_s: the last message of its launcher (Unix s).
        lost_unix_s: when the aggregator marked it lost (Unix s).
        resumed_unix_s: when it was heard again (Unix s), None: never.
        lost_after_s: the silence after which it was marked lost (s): the bound
            (``TRACEML_NODE_LOST_AFTER_SEC``), or less when its session broke and it reported
            no exit before the run's summary.
    """

    node_rank: int
    hostname: str | None
    last_heard_unix_s: float
    lost_unix_s: float
    resumed_unix_s: float | None
    lost_after_s: float


@dataclass(frozen=True, slots=True)
class NodeClock(MetaRecord):
    """A node's clock offset from node 0's aggregator, as its launcher estimated it over its
    session (:mod:`traceml.core.clock`; meta key ``node_clocks``: a JSON list of these, one per
    node, by node rank; written by ``traceml_aggregator/sessions.py``).

    Attributes:
        node_rank: the node.
        offset_us: node 0's clock minus the node's, µs: add it to the node's wall times (a
            rank's ``start_unix_us`` and what is measured from it) to read them on node 0's.
        error_us: the estimate's bound: the true offset is within ``offset_us ± error_us``.
        measured_unix_s: when the aggregator took this estimate (Unix s, its clock).
    """

    node_rank: int
    offset_us: int
    error_us: int
    measured_unix_s: float


@dataclass(frozen=True, slots=True)
class StreamEnd(MetaRecord):
    """How one sender's latest stream to the aggregator ended (meta key ``sender_streams``: a
    JSON list of these, ranks first; written by ``traceml_aggregator/streams.py``).

    Attributes:
        sender: "rank" (a rank's SDK) or "node" (a node's sampler).
        id: the rank, or the node rank.
        restart: the sender's torchrun attempt.
        state: "open" (still open), "closed" (the sender closed it), "lost" (cancelled, reset,
            or no keepalive answer).
        finished: the sender's finish marker was stored.
        streams: streams the sender opened (one more after each fork, outage or restart).
        since_unix_s: when the state was reached (Unix s).
    """

    sender: str
    id: int
    restart: int
    state: str
    finished: bool
    streams: int
    since_unix_s: float
