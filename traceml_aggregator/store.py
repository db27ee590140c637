"""The SQLite telemetry store: schema, idempotent batch writes, reads for the analysis.

One :class:`Store` owns one connection and is used from one thread only (the aggregator's
writer thread); it is not thread-safe by design. Writes arrive as lists of batches and are
stored in one transaction per list.

Idempotency: every batch names its sender (a rank or a node sampler), the sender's attempt
(``restart_count``) and a sequence number. ``streams`` keeps the highest stored sequence number
per (sender, attempt); a batch at or below it is acknowledged without being stored again. A
batch and its sequence number commit in one transaction, so each step is stored exactly once.
``steps`` has no key of its own on purpose: maintaining one would double the cost of storing a
step (3.8 against 1.8 µs a row, measured here), and the readers sort what they read.

Shared filesystems: the run directory may live on NFS or Lustre, where SQLite's WAL index in
shared memory (``-shm``) is unreliable. The store sets ``locking_mode=EXCLUSIVE`` *before* the
first WAL access, which makes SQLite keep the WAL index in process memory and never create the
``-shm`` file (see https://sqlite.org/wal.html, "WAL without shared memory"). The cost: no
other process can read the database while the aggregator has it open. ``close()`` checkpoints
the WAL into the main file, so the database is one self-contained file afterwards.

Durability: ``synchronous=NORMAL``, on purpose. In WAL mode a commit then reaches the operating
system but is synced to disk only at checkpoints, so a committed (acknowledged) batch survives the
aggregator process dying in any way and is lost only if node 0's kernel crashes or loses power
before the next checkpoint. ``FULL`` syncs every commit: measured 8.7 ms against 0.8 ms per
64-row transaction on a local disk (more on NFS/Lustre), for a failure that kills node 0's ranks
and the job's rendezvous as well (docs/distributed-training.md).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import sqlite3
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from google.protobuf.message import Message

from traceml.core import records
from traceml.core.phases import STEP_REQUIRED_FIELDS
from traceml.core.records import (
    Finish,
    Flops,
    GpuSample,
    Identity,
    NodeExit,
    ProcessSample,
    RankEnd,
    SenderCounts,
    SystemSample,
    step_group_columns,
)
from traceml.core.rundir import DATABASE_NAME
from traceml.wire.records import add_steps

#: Version of the table layout below; stored in ``meta``.
SCHEMA_VERSION = 5
#: ``meta`` key of the aggregator's refused calls by kind (a JSON object), written before the
#: reports (see traceml_aggregator/senders.py).
REJECTED_META_KEY = "rejected"
#: The store's meta key of the first refusal's reason of each kind (JSON: kind -> reason).
REJECTED_REASONS_META_KEY = "rejected_reasons"

#: The tables: the store's own (meta, streams, the live checkpoint), the records'
#: (:mod:`traceml.core.records`) and the steps.
_SCHEMA = "\n".join(
    [
        "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);",
        records.table_sql(
            "streams",
            [
                ("sender", "TEXT NOT NULL"),
                ("sender_id", "INTEGER NOT NULL"),
                ("restart", "INTEGER NOT NULL"),
                ("stored_seq", "INTEGER NOT NULL"),
            ],
            key=("sender", "sender_id", "restart"),
        ),
        records.create_table(records.Identity),
        records.table_sql("steps", records.STEPS_TABLE),
        *(records.create_table(r) for r in records.RECORDS if r is not records.Identity),
        "CREATE TABLE IF NOT EXISTS live_checkpoint (id INTEGER PRIMARY KEY CHECK (id = 0),"
        " written_unix_us INTEGER NOT NULL, state BLOB NOT NULL);",
        "CREATE TABLE IF NOT EXISTS live_checkpoint_ranks (rank INTEGER PRIMARY KEY,"
        " mark INTEGER NOT NULL, state BLOB NOT NULL);",
        "CREATE TABLE IF NOT EXISTS live_checkpoint_series (rank INTEGER PRIMARY KEY,"
        " attempt INTEGER NOT NULL, folds INTEGER NOT NULL, state BLOB NOT NULL);",
        "CREATE TABLE IF NOT EXISTS live_checkpoint_window (rank INTEGER NOT NULL,"
        " upto INTEGER NOT NULL, attempt INTEGER NOT NULL, steps INTEGER NOT NULL,"
        " columns BLOB NOT NULL, PRIMARY KEY (rank, upto));",
    ]
)
#: The INSERT of one row of each record (:func:`traceml.core.records.insert`).
_INSERT = {r: records.insert(r) for r in records.RECORDS}


#: ``meta`` key of the run's aggregator restarts: a JSON list, one entry per replacement
#: aggregator (see :func:`traceml_aggregator.server.record_restart`).
RESTARTS_META_KEY = "aggregator_restarts"
#: ``meta`` key of the loss of node 0's aggregator for good: one JSON object (see
#: :func:`traceml_aggregator.server.record_loss`), absent when it was not lost.
LOSS_META_KEY = "aggregator_loss"
#: ``meta`` key of the nodes the aggregator lost: a JSON list, one entry per loss (see
#: :class:`traceml_aggregator.sessions.NodeSessions`).
NODE_LOSSES_META_KEY = "node_losses"
#: ``meta`` key of each node's clock offset from node 0's: a JSON list of
#: :class:`traceml.core.records.NodeClock`, by node rank (see
#: :class:`traceml_aggregator.sessions.NodeSessions`).
NODE_CLOCKS_META_KEY = "node_clocks"


#: Largest integer the store takes (SQLite's INTEGER is signed 64-bit). The wire's integers
#: are unsigned 64-bit: a value above this one (a FLOPs count of a large model with gradient
#: accumulation can reach 2**63) is dropped by :func:`drop_unstorable`, and counted.
STORE_INT_MAX = (1 << 63) - 1
_REQUIRED = frozenset(STEP_REQUIRED_FIELDS)


def drop_unstorable(batch) -> int:
    """Drop from ``batch`` (a wire Batch, changed in place) every integer above
    :data:`STORE_INT_MAX`; returns how many were dropped.

    A step's optional field is dropped alone (the step is stored without it); a step whose
    step number, end or duration is beyond is dropped whole (one value counted). A field of
    any other record is cleared (absent where it is optional, else 0). The batch's sequence
    number is left as it is (a batch beyond it cannot be stored: it is refused as malformed).
    """
    dropped = 0
    for fd, value in batch.ListFields():
        if fd.name == "step_groups":
            dropped += _drop_unstorable_steps(batch)
        elif fd.message_type is not None:
            dropped += sum(map(_drop_unstorable_fields, _messages(value)))
    return dropped


def _messages(value) -> tuple | list:
    """The messages of a message field's value: itself (singular), or its items (repeated)."""
    return (value,) if isinstance(value, Message) else value


def _drop_unstorable_fields(message) -> int:
    """Clear the integers above :data:`STORE_INT_MAX` in ``message`` and the messages it
    holds; returns how many."""
    dropped = 0
    for fd, value in message.ListFields():
        if fd.message_type is not None:
            dropped += sum(map(_drop_unstorable_fields, _messages(value)))
        elif type(value) is int and value > STORE_INT_MAX:  # a singular integer field
            message.ClearField(fd.name)
            dropped += 1
    return dropped


def _drop_unstorable_steps(batch) -> int:
    """Rebuild ``batch.step_groups`` without the values above :data:`STORE_INT_MAX` (see
    :func:`drop_unstorable`); returns how many were dropped. A malformed group is left for
    the store to refuse."""
    rows: list[dict[str, int]] = []
    dropped = 0
    for group in batch.step_groups:
        try:
            names, columns = step_group_columns(group)
        except ValueError:
            return 0
        for values in zip(*columns, strict=True):
            step = dict(zip(names, values, strict=True))
            beyond = [name for name, value in step.items() if value > STORE_INT_MAX]
            if _REQUIRED.isdisjoint(beyond):
                rows.append({k: v for k, v in step.items() if k not in beyond})
                dropped += len(beyond)
            else:
                dropped += 1
    if dropped:
        del batch.step_groups[:]
        add_steps(batch, rows)
    return dropped


#: Most step rows one INSERT carries. A multi-row ``VALUES`` list stores a row for about 35 %
#: less CPU than one statement per row (measured here: 1.2-1.3 against 1.7 µs a row at best), and
#: 32 rows of at most 21 columns stay under the 999 bound variables of SQLite before 3.32.
MAX_ROWS_PER_INSERT = 32


@functools.cache
def _step_insert(names: tuple[str, ...], rows: int) -> str:
    """The INSERT of ``rows`` step rows ``(rank, restart, *values of names)``; the other
    columns stay NULL (not measured)."""
    columns = ", ".join(("rank", "restart") + names)
    row = f"({', '.join(['?'] * (2 + len(names)))})"
    return f"INSERT INTO steps ({columns}) VALUES {', '.join([row] * rows)}"


def _insert_steps(db: sqlite3.Connection, groups: list[tuple]) -> None:
    """Insert the steps of ``groups`` (``(rank, restart, names, columns)``: a step group
    decoded by :func:`step_group_columns`, in arrival order) as rows of their ranks'
    attempts, in that order.

    Consecutive groups that measured the same fields (the common case: every rank's batch of
    a node's relay message, or of a burst, alike) are bound together, so a transaction of
    many one-step batches costs a few statements, not one per batch. The rows' values are laid
    out flat in C (``zip`` over the packed columns, ``chain``) and bound
    :data:`MAX_ROWS_PER_INSERT` rows a statement, then in halving statements for the rest (at
    most 5 more), so no step is decoded one by one in Python.
    """
    names: tuple[str, ...] = ()
    values: list[int | None] = []
    for rank, restart, group_names, columns in groups:
        if not group_names:  # an empty group: no row (zip over the repeats would never end)
            continue
        if group_names != names:
            _insert_rows(db, names, values)
            names, values = group_names, []
        values += itertools.chain.from_iterable(
            zip(itertools.repeat(rank), itertools.repeat(restart), *columns)
        )
    _insert_rows(db, names, values)


def _insert_rows(db: sqlite3.Connection, names: tuple[str, ...], values: list) -> None:
    """Insert step rows ``(rank, restart, *values of names)`` laid out flat in ``values``."""
    width = 2 + len(names)
    start, rows_left, rows = 0, len(values) // width, MAX_ROWS_PER_INSERT
    while rows_left:
        while rows > rows_left:
            rows //= 2
        span = rows * width
        end = start + rows_left // rows * span
        db.executemany(
            _step_insert(names, rows), (values[i : i + span] for i in range(start, end, span))
        )
        rows_left -= (end - start) // width
        start = end


#: The records of a batch stored at the end of its transaction, by :func:`_batch_rows`.
_BATCH_ROWS = (ProcessSample, SystemSample, GpuSample, Flops, Finish)


def _batch_rows(batch, sender: str, received_unix_us: int, rows: dict[type, list]) -> None:
    """Append the rows of ``batch``'s samples, FLOPs counts and finish marker to ``rows``
    (record -> rows), ``sender`` being the kind of its sender (``rank``, ``node_rank``).

    Raises:
        ValueError: an unknown end state.
    """
    rank, restart = batch.rank, batch.restart_count
    # (each repeated field is looked at before it is iterated: iterating an empty one costs
    # three times the look, and most batches carry only steps or only samples)
    if batch.process_samples:
        process = rows[ProcessSample]
        for s in batch.process_samples:
            if sender == "node_rank":  # a node sampler reports for its local workers
                process.append(ProcessSample.wire_row(s, rank=s.rank, restart=s.restart_count))
            else:  # a rank for itself
                process.append(ProcessSample.wire_row(s, rank=rank, restart=restart))
    if batch.system_samples:
        gpus = rows[GpuSample]
        for s in batch.system_samples:
            rows[SystemSample].append(SystemSample.wire_row(s))
            if s.gpus:
                gpus += [
                    GpuSample.wire_row(g, node_rank=s.node_rank, unix_us=s.unix_us) for g in s.gpus
                ]
    if batch.flops_counts:
        rows[Flops] += [Flops.wire_row(c, rank=rank, restart=restart) for c in batch.flops_counts]
    if batch.HasField("finish"):
        rows[Finish].append(
            Finish.wire_row(
                batch.finish, rank=rank, restart=restart, received_unix_us=received_unix_us
            )
        )


@dataclass
class WriteResult:
    """Outcome of one batch: the sender's highest stored sequence number, whether the batch
    was already stored, and why it was refused ("" unless it was)."""

    stored_seq: int
    duplicate: bool
    rejected: str = ""
    #: The kind of refusal (see :mod:`traceml_aggregator.senders`), "" unless refused.
    kind: str = ""
    #: Values above :data:`STORE_INT_MAX` dropped from the batch before it was stored.
    values_dropped: int = 0
    #: A batch stored now: its step groups as the store decoded them, ``(names, columns)``
    #: of :func:`step_group_columns` each, in the batch's order (the live fold takes them, so
    #: the event loop does not decode a group again); empty otherwise.
    groups: list[tuple[tuple[str, ...], list]] = field(default_factory=list)


class StoreVersionError(RuntimeError):
    """The database was written with another table layout (``meta.schema_version``)."""


class StoreUnavailable(RuntimeError):
    """A run directory's store cannot be used: there is none, it has another schema version,
    it is not a database or is damaged, or a running aggregator holds it. The message is one
    line that names the file and the cause (:func:`open_run_store`, :func:`unreadable`)."""


def unreadable(database: Path, exc: sqlite3.Error) -> StoreUnavailable:
    """The one-line refusal of ``database`` for the SQLite error ``exc`` met opening or
    reading it: a lock (``database is locked``: an aggregator holds the store, in
    ``locking_mode=EXCLUSIVE``) is said as such; any other error is quoted."""
    if "is locked" in str(exc):  # SQLITE_BUSY / SQLITE_LOCKED (no error codes before 3.11)
        return StoreUnavailable(
            f"{database} is locked: another aggregator holds it (a live run's store)"
        )
    return StoreUnavailable(f"cannot read {database}: {exc}")


def is_unreadable(exc: sqlite3.Error) -> bool:
    """Whether ``exc`` says the file is not a database, is damaged or is locked (the store's
    fault, said by :func:`unreadable`), rather than a failed write (a full disk, ...)."""
    return type(exc) is sqlite3.DatabaseError or "is locked" in str(exc)


class Store:
    """The run's SQLite database (see the module docstring for the guarantees).

    Args:
        path: database file; created with its parent directory if missing.
        read_only: open an existing file for reading only (``traceml view --serve``): no
            lock beyond SQLite's shared one, no table or row written, no checkpoint at close.
            A store its aggregator closed is one file (its close checkpointed the ``-wal``
            and removed it) and is read as immutable, so that SQLite makes no ``-wal`` or
            ``-shm`` file beside it (a read-only connection to a WAL database makes both and
            leaves them); with a ``-wal`` (an aggregator that died, or one still running)
            it is read through it, and a running aggregator's lock refuses the read.

    Raises:
        StoreVersionError: the file holds another schema version than :data:`SCHEMA_VERSION`.
        sqlite3.Error: the file cannot be opened or is not a TraceML database (read-only: it
            is missing, or a running aggregator holds it).
    """

    def __init__(self, path: str | Path, *, read_only: bool = False) -> None:
        self.path = Path(path)
        self.read_only = read_only
        if read_only:
            wal = self.path.with_name(self.path.name + "-wal")
            mode = "mode=ro" if wal.exists() else "mode=ro&immutable=1"
            self._db = sqlite3.connect(
                f"{self.path.absolute().as_uri()}?{mode}", uri=True, check_same_thread=False
            )
            self._check_version()
            self._seqs, self._latest = {}, {}
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(str(self.path), isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA locking_mode=EXCLUSIVE")
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")  # see "Durability" above
        self._check_version()
        self._db.executescript(_SCHEMA)
        self._db.execute(
            "INSERT OR IGNORE INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),)
        )
        self._seqs: dict[tuple[str, int, int], int] = {}
        self._latest: dict[tuple[str, int], int] = {}  # (sender, id) -> highest restart stored
        self._load_streams()
        #: The highest rowid of ``steps`` committed (0: none): the steps of every committed
        #: transaction lie at or below it (see :mod:`traceml_aggregator.checkpoint`).
        self.steps_rowid = self.max_rowid("steps")
        #: Records stored by :meth:`write_batches` since this store was opened: steps,
        #: process samples, system samples and FLOPs counts (a Batch's records).
        self.records_stored = 0

    def _load_streams(self) -> None:
        """Read the stored sequence numbers and latest attempts back from ``streams``."""
        self._seqs = {(s, i, r): q for s, i, r, q in self._db.execute("SELECT * FROM streams")}
        self._index_latest()

    def _index_latest(self) -> None:
        """Each sender's latest attempt, from the stored sequence numbers in memory."""
        self._latest = {}
        for sender, sender_id, restart in self._seqs:
            key = (sender, sender_id)
            self._latest[key] = max(restart, self._latest.get(key, restart))

    def _check_version(self) -> None:
        """Refuse a database whose ``schema_version`` is not :data:`SCHEMA_VERSION` (before
        the layout below is applied to it); a new file, or one without the ``meta`` table, has
        none yet."""
        has_meta = self._db.execute(
            "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'meta'"
        ).fetchone()
        row = (
            has_meta
            and self._db.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
        )
        if row and row[0] != str(SCHEMA_VERSION):
            self._db.close()
            raise StoreVersionError(
                f"{self.path} has store schema version {row[0]}, this TraceML writes version "
                f"{SCHEMA_VERSION}: use a new run directory (or the TraceML that wrote it)"
            )

    # --- meta ------------------------------------------------------------------------------------
    def set_meta(self, key: str, value: str) -> None:
        """Store one run-level fact (run name, expected world size, ...)."""
        self._db.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (key, value))

    def delete_meta(self, key: str) -> None:
        """Forget one run-level fact (no error when absent)."""
        self._db.execute("DELETE FROM meta WHERE key = ?", (key,))

    def meta(self) -> dict[str, str]:
        """All run-level facts."""
        return dict(self._db.execute("SELECT key, value FROM meta"))

    # --- writes ----------------------------------------------------------------------------------
    def write_batches(self, batches: list, received_unix_us: int) -> list[WriteResult]:
        """Store ``batches`` (wire Batch messages of this run) in one transaction.

        Returns one :class:`WriteResult` per batch, in order. A batch whose sequence number
        was already stored is skipped (``duplicate=True``).

        Raises:
            OverflowError: an integer above :data:`STORE_INT_MAX` (see :func:`drop_unstorable`).
            ValueError: a malformed batch (a step group, an end state); nothing was stored.
            sqlite3.Error: the disk (full, I/O error); nothing was stored.
        """
        steps: list[tuple] = []  # (rank, restart, names, columns) of the groups to store
        rows: dict[type, list[tuple]] = {record: [] for record in _BATCH_ROWS}
        counts: dict[tuple[int, int], tuple] = {}  # (rank, restart) -> its latest SenderCounts
        results: list[WriteResult] = []
        touched: dict[tuple[str, int, int], int] = {}
        before: dict[tuple[str, int, int], int] = {}  # stored seqs as they were, to restore
        db = self._db
        db.execute("BEGIN")
        try:
            for batch in batches:
                sender = batch.WhichOneof("sender") or "rank"
                sender_id = getattr(batch, sender)
                key = (sender, sender_id, batch.restart_count)
                stored = self._seqs.get(key, 0)
                if batch.seq <= stored:
                    results.append(self._seen_before(batch, stored))
                    continue
                refusal = self._refusal(batch, sender, sender_id)
                if refusal is not None:
                    results.append(refusal)
                    continue
                before.setdefault(key, stored)
                self._seqs[key] = touched[key] = batch.seq
                latest = self._latest.get(key[:2], 0)
                self._latest[key[:2]] = max(latest, batch.restart_count)
                groups = list(map(step_group_columns, batch.step_groups))
                results.append(WriteResult(batch.seq, False, groups=groups))
                restart = batch.restart_count
                if batch.HasField("identity"):
                    db.execute(_INSERT[Identity], Identity.wire_row(batch.identity))
                steps += [(batch.rank, restart, *group) for group in groups]
                _batch_rows(batch, sender, received_unix_us, rows)
                if sender == "rank" and batch.HasField("counts"):
                    counts[batch.rank, restart] = SenderCounts.wire_row(
                        batch.counts, rank=batch.rank, restart=restart, seq=batch.seq
                    )
            _insert_steps(db, steps)
            for record, values in rows.items():
                if values:  # in the batches' order: a later FLOPs count or finish replaces
                    db.executemany(_INSERT[record], values)
            if counts:  # a stream's batches are stored in order: the last one is the latest
                db.executemany(_INSERT[SenderCounts], counts.values())
            if touched:
                db.executemany(
                    "INSERT OR REPLACE INTO streams VALUES (?,?,?,?)",
                    [k + (v,) for k, v in touched.items()],
                )
            steps_rowid = self.max_rowid("steps") if steps else self.steps_rowid
            db.execute("COMMIT")
            self.steps_rowid = steps_rowid
            self.records_stored += sum(len(group[3][0]) for group in steps if group[2]) + sum(
                len(rows[record]) for record in (ProcessSample, SystemSample, Flops)
            )
        except BaseException:
            # Forget the sequence numbers of what was rolled back, from memory: after an I/O
            # error the database may not answer a read either.
            for key, seq in before.items():
                if seq:
                    self._seqs[key] = seq
                else:  # a stream this transaction began
                    del self._seqs[key]
            self._index_latest()
            self._rollback()
            raise
        return results

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        """``BEGIN``, then the block's statements on the yielded connection, then ``COMMIT``;
        an exception in the block or the commit rolls back (:meth:`_rollback`) and is raised."""
        db = self._db
        db.execute("BEGIN")
        try:
            yield db
            db.execute("COMMIT")
        except BaseException:
            self._rollback()
            raise

    def _rollback(self) -> None:
        """End a failed transaction. SQLite rolls back by itself on some errors (disk full,
        I/O error: https://sqlite.org/lang_transaction.html, "Response To Errors Within A
        Transaction"); an explicit ROLLBACK then raises "no transaction is active" and would
        hide the error that matters."""
        if self._db.in_transaction:
            self._db.execute("ROLLBACK")

    def _seen_before(self, batch, stored: int) -> WriteResult:
        """A batch at or below the stored sequence number: a resend (a duplicate), or, when its
        identity names another process than the stored one, a second job reusing this run's
        name and rank, whose data would otherwise be dropped as duplicates without a word."""
        return self._second_sender(batch, stored) or WriteResult(stored, True)

    def _second_sender(self, batch, stored: int) -> WriteResult | None:
        """The refusal of a batch whose identity names another process than the one stored
        for its (rank, restart); None otherwise."""
        if not batch.HasField("identity"):
            return None
        row = self._db.execute(
            "SELECT pid, hostname FROM ranks WHERE rank = ? AND restart = ?",
            (batch.rank, batch.restart_count),
        ).fetchone()
        ident = batch.identity
        if row is None or (row[0], row[1]) == (ident.pid, ident.hostname):
            return None
        return WriteResult(
            stored,
            False,
            f"rank {batch.rank} (attempt {batch.restart_count}) of this run already "
            f"streamed from pid {row[0]} on {row[1]}, not from pid {ident.pid}: use a "
            "new run name, or, for processes the script starts itself "
            "(torch.multiprocessing.spawn), call traceml.init() after "
            "init_process_group so that each reports its own rank",
            "second_sender",
        )

    def _refusal(self, batch, sender: str, sender_id: int) -> WriteResult | None:
        """The refusal of a new batch (above the stored sequence number) that would overwrite
        what another sender stored: an attempt older than the sender's latest one stored, or
        a second process's identity for a stored (rank, restart). None when it may be stored."""
        latest = self._latest.get((sender, sender_id))
        if latest is not None and batch.restart_count < latest:
            return WriteResult(
                0,
                False,
                f"a batch of {sender.replace('_', ' ')} {sender_id} from attempt "
                f"{batch.restart_count}: attempt {latest} is already stored",
                "restart_regressed",
            )
        return self._second_sender(batch, 0)

    def write_node_exit(self, report, received_unix_us: int) -> None:
        """Store a node's torchrun exit and its ranks' end states (a later report replaces)."""
        # Built first: an unknown end state raises before the transaction.
        rank_ends = [RankEnd.wire_row(r, node_rank=report.node_rank) for r in report.ranks]
        with self._transaction() as db:
            db.execute(
                _INSERT[NodeExit], NodeExit.wire_row(report, received_unix_us=received_unix_us)
            )
            db.executemany(_INSERT[RankEnd], rank_ends)

    # --- reads -----------------------------------------------------------------------------------
    def query(self, sql: str, params: tuple = (), *, by_name: bool = True) -> list:
        """Rows of a read-only query: :class:`sqlite3.Row` (access by column name), or plain
        tuples with ``by_name=False`` (no Row object per row: for the millions of steps)."""
        cur = self._db.cursor()
        if by_name:
            cur.row_factory = sqlite3.Row
        return cur.execute(sql, params).fetchall()

    def stream(self, sql: str, chunk_rows: int = 8192):
        """The rows of a read-only query as plain tuples, ``chunk_rows`` at a time (lists):
        a scan of millions of steps without holding them all."""
        cur = self._db.cursor()
        cur.execute(sql)
        while rows := cur.fetchmany(chunk_rows):
            yield rows

    def max_rowid(self, table: str) -> int:
        """The highest rowid of ``table`` (0 when empty); O(log rows): SQLite reads the last
        entry of the table's b-tree."""
        return self._db.execute(f"SELECT max(rowid) FROM {table}").fetchone()[0] or 0

    def delete_rows(self, table: str, rowids: list[int], meta: dict[str, str]) -> None:
        """Delete the rows of ``table`` (``steps`` or a sample table) of ``rowids`` and set the
        ``meta`` keys to their values, in one transaction (the retention's prune:
        :mod:`traceml_aggregator.retention`).

        Raises:
            sqlite3.Error: the disk (full, I/O error); nothing was deleted.
        """
        with self._transaction() as db:
            db.executemany(f"DELETE FROM {table} WHERE rowid = ?", ((r,) for r in rowids))
            db.executemany("INSERT OR REPLACE INTO meta VALUES (?, ?)", meta.items())

    def write_live_checkpoint(self, state: bytes, written_unix_us: int) -> None:
        """Replace the live aggregates' checkpoint (:mod:`traceml_aggregator.checkpoint`) by
        ``state``, in one transaction of its own: after a crash at any moment the store holds
        the previous checkpoint or this one, whole.

        Raises:
            sqlite3.Error: the disk (full, I/O error); the previous checkpoint stays.
        """
        with self._transaction() as db:
            db.execute(
                "INSERT OR REPLACE INTO live_checkpoint VALUES (0, ?, ?)", (written_unix_us, state)
            )

    def write_live_checkpoint_ranks(
        self,
        rows: list[tuple[int, int, bytes]],
        series: list[tuple[int, int, int, bytes]],
        windows: list[tuple[int, int, int, int, bytes]],
        dropped: list[tuple[int, int, int]],
    ) -> None:
        """Replace the checkpointed states of some ranks (:mod:`traceml_aggregator.checkpoint`),
        ``(rank, mark, state)`` each, and the series of some of them, ``(rank, attempt, folds,
        series)`` each; delete the window rows of some, ``(rank, before, after)``: those ending
        at or below its ``before``-th step or after its ``after``-th; and add window rows,
        ``(rank, upto, attempt, steps, columns)`` each: a span of ``steps`` steps of the rank's
        attempt, ending at its ``upto``-th. In one transaction of its own; each rank row names
        the ``steps`` rowid its state covers, the series it goes with and its window's steps,
        so it is whole on its own, whatever the other rows.

        Raises:
            sqlite3.Error: the disk (full, I/O error); the previous rows stay.
        """
        with self._transaction() as db:
            db.executemany("INSERT OR REPLACE INTO live_checkpoint_ranks VALUES (?, ?, ?)", rows)
            db.executemany(
                "INSERT OR REPLACE INTO live_checkpoint_series VALUES (?, ?, ?, ?)", series
            )
            db.executemany(
                "DELETE FROM live_checkpoint_window WHERE rank = ? AND (upto <= ? OR upto > ?)",
                dropped,
            )
            db.executemany(
                "INSERT OR REPLACE INTO live_checkpoint_window VALUES (?, ?, ?, ?, ?)", windows
            )

    def live_checkpoint_ranks(self) -> Iterator[tuple]:
        """Each checkpointed rank's ``(rank, mark, state, attempt, folds, series)`` (see
        :meth:`write_live_checkpoint_ranks`; the last three None where it has no series
        row), read one row at a time, by rank."""
        yield from self._db.execute(
            "SELECT r.rank, r.mark, r.state, s.attempt, s.folds, s.state "
            "FROM live_checkpoint_ranks r LEFT JOIN live_checkpoint_series s USING (rank) "
            "ORDER BY r.rank"
        )

    def live_checkpoint_window(self, rank: int) -> list[tuple[int, int, int, bytes]]:
        """The window rows of ``rank`` (see :meth:`write_live_checkpoint_ranks`), ``(upto,
        attempt, steps, columns)`` each, by ``upto``."""
        return self._db.execute(
            "SELECT upto, attempt, steps, columns FROM live_checkpoint_window WHERE rank = ? "
            "ORDER BY upto",
            (rank,),
        ).fetchall()

    def live_checkpoint(self) -> bytes | None:
        """The live aggregates' latest checkpoint (see :meth:`write_live_checkpoint`), None
        when none was written (a new store, or one an older TraceML wrote)."""
        row = self._db.execute("SELECT state FROM live_checkpoint WHERE id = 0").fetchone()
        return row[0] if row else None

    def checkpoint(self) -> None:
        """Fold the WAL into the main database file (``wal_checkpoint(TRUNCATE)``)."""
        self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")

    def close(self) -> None:
        """Checkpoint (unless read-only) and close; the database is a single file afterwards."""
        try:
            if not self.read_only:
                self.checkpoint()
        finally:
            self._db.close()


def open_run_store(run_dir: Path, *, read_only: bool = False) -> Store:
    """The existing store of the run directory ``run_dir`` (``traceml view --serve``,
    ``traceml-aggregator --finalize-only``); unlike :class:`Store`, never creates one.

    Raises:
        StoreUnavailable: ``run_dir`` holds no store (nothing is created), or the store has
            another schema version, is not a database or cannot be opened, or (SQLite's
            ``database is locked``, after its 5 s busy timeout) a running aggregator holds it.
    """
    database = Path(run_dir) / DATABASE_NAME
    if not database.is_file():
        raise StoreUnavailable(f"{run_dir} holds no TraceML store ({DATABASE_NAME})")
    try:
        return Store(database, read_only=read_only)
    except StoreVersionError as exc:
        raise StoreUnavailable(str(exc)) from exc
    except sqlite3.Error as exc:
        raise unreadable(database, exc) from exc
