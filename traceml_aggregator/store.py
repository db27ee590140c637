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

import functools
import itertools
import sqlite3
from dataclasses import dataclass
from pathlib import Path

from traceml import wire
from traceml.wire.records import STEP_OPTIONAL_FIELDS, step_group_columns

#: Version of the table layout below; stored in ``meta``.
SCHEMA_VERSION = 3
#: ``meta`` key of the aggregator's refused calls by kind (a JSON object), written before the
#: reports (see traceml_aggregator/senders.py).
REJECTED_META_KEY = "rejected"

_SCHEMA = f"""
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS streams (
    sender TEXT NOT NULL, sender_id INTEGER NOT NULL, restart INTEGER NOT NULL,
    stored_seq INTEGER NOT NULL, PRIMARY KEY (sender, sender_id, restart)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS ranks (
    rank INTEGER NOT NULL, restart INTEGER NOT NULL, node_rank INTEGER, local_rank INTEGER,
    world_size INTEGER, local_world_size INTEGER, hostname TEXT, pid INTEGER,
    start_unix_us INTEGER, torch_version TEXT, cuda_version TEXT, backend TEXT,
    parallelism TEXT, device TEXT, gpu_uuid TEXT,
    PRIMARY KEY (rank, restart)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS steps (
    rank INTEGER NOT NULL, restart INTEGER NOT NULL, step INTEGER NOT NULL,
    end_us INTEGER NOT NULL, step_us INTEGER NOT NULL,
    {", ".join(f"{name} INTEGER" for name in STEP_OPTIONAL_FIELDS)});
CREATE TABLE IF NOT EXISTS process_samples (
    rank INTEGER NOT NULL, restart INTEGER NOT NULL, unix_us INTEGER NOT NULL,
    cpu_percent REAL, rss_bytes INTEGER, gpu_allocated_bytes INTEGER,
    gpu_reserved_bytes INTEGER);
CREATE TABLE IF NOT EXISTS system_samples (
    node_rank INTEGER NOT NULL, unix_us INTEGER NOT NULL, hostname TEXT,
    cpu_percent REAL, ram_used_bytes INTEGER, ram_total_bytes INTEGER,
    gpu_unavailable_reason TEXT);
CREATE TABLE IF NOT EXISTS gpu_samples (
    node_rank INTEGER NOT NULL, unix_us INTEGER NOT NULL, nvml_index INTEGER NOT NULL,
    uuid TEXT, util_percent REAL, memory_used_bytes INTEGER, memory_total_bytes INTEGER,
    temperature_c REAL, power_w REAL, unavailable_reason TEXT);
CREATE TABLE IF NOT EXISTS rank_finish (
    rank INTEGER NOT NULL, restart INTEGER NOT NULL, steps_completed INTEGER NOT NULL,
    records_dropped INTEGER NOT NULL, steps_gpu_unresolved INTEGER NOT NULL,
    end_state TEXT NOT NULL, reason TEXT, last_seq INTEGER NOT NULL,
    received_unix_us INTEGER NOT NULL, PRIMARY KEY (rank, restart)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS rank_flops (
    rank INTEGER NOT NULL, restart INTEGER NOT NULL, step INTEGER NOT NULL,
    forward_flops INTEGER NOT NULL, count_us INTEGER NOT NULL, dtype TEXT, device_name TEXT,
    peak_tflops REAL, PRIMARY KEY (rank, restart)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS sender_counts (
    rank INTEGER NOT NULL, restart INTEGER NOT NULL, seq INTEGER NOT NULL,
    records_produced INTEGER NOT NULL, records_dropped INTEGER NOT NULL,
    steps_produced INTEGER NOT NULL, steps_dropped INTEGER NOT NULL,
    PRIMARY KEY (rank, restart)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS node_exits (
    node_rank INTEGER PRIMARY KEY, hostname TEXT, exit_code INTEGER NOT NULL,
    restart_count INTEGER NOT NULL, received_unix_us INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS rank_ends (
    rank INTEGER PRIMARY KEY, local_rank INTEGER, node_rank INTEGER NOT NULL,
    end_state TEXT NOT NULL, exit_code INTEGER, signal INTEGER, reason TEXT);
"""


_PROCESS_FIELDS = ("cpu_percent", "rss_bytes", "gpu_allocated_bytes", "gpu_reserved_bytes")
_SYSTEM_FIELDS = ("cpu_percent", "ram_used_bytes", "ram_total_bytes")
_GPU_FIELDS = ("util_percent", "memory_used_bytes", "memory_total_bytes", "temperature_c", "power_w")


#: ``meta`` key of the run's aggregator restarts: a JSON list, one entry per replacement
#: aggregator (see :func:`traceml_aggregator.server.record_restart`).
RESTARTS_META_KEY = "aggregator_restarts"
#: ``meta`` key of the nodes the aggregator lost: a JSON list, one entry per loss (see
#: :class:`traceml_aggregator.sessions.NodeSessions`).
NODE_LOSSES_META_KEY = "node_losses"


def _optional(message, names: tuple[str, ...]) -> tuple:
    """Values of ``names`` in ``message``, None where the optional field is absent."""
    present = {fd.name: value for fd, value in message.ListFields()}
    return tuple(present.get(name) for name in names)


def flops_row(count) -> tuple:
    """``rank_flops`` values of a wire FlopsCount after (rank, restart): step, forward FLOPs,
    count µs, dtype, device name, peak TFLOPS (None when the rank was given none)."""
    return (
        count.step,
        count.forward_flops,
        count.count_us,
        count.dtype or None,
        count.device_name or None,
        count.peak_tflops or None,
    )


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


def _insert_steps(db: sqlite3.Connection, rank: int, restart: int, group) -> None:
    """Insert the steps of ``group`` (a StepColumns) as rows of ``rank``'s attempt ``restart``.

    The rows' values are laid out flat in C (``zip`` over the packed columns, ``chain``) and
    bound :data:`MAX_ROWS_PER_INSERT` rows a statement, then in halving statements for the
    rest (at most 5 more), so no step is decoded one by one in Python.

    Raises:
        ValueError: the group is malformed (see :func:`step_group_columns`).
    """
    names, columns = step_group_columns(group)
    if not names:  # an empty group: no row (zip over the two repeats alone would never end)
        return
    width = 2 + len(names)
    values = list(itertools.chain.from_iterable(
        zip(itertools.repeat(rank), itertools.repeat(restart), *columns)
    ))
    start, rows_left, rows = 0, len(values) // width, MAX_ROWS_PER_INSERT
    while rows_left:
        while rows > rows_left:
            rows //= 2
        span = rows * width
        end = start + rows_left // rows * span
        db.executemany(
            _step_insert(names, rows), (values[i:i + span] for i in range(start, end, span))
        )
        rows_left -= (end - start) // width
        start = end


@dataclass
class WriteResult:
    """Outcome of one batch: the sender's highest stored sequence number, whether the batch
    was already stored, and why it was refused ("" unless it was)."""

    stored_seq: int
    duplicate: bool
    rejected: str = ""
    #: The kind of refusal (see :mod:`traceml_aggregator.senders`), "" unless refused.
    kind: str = ""


class StoreVersionError(RuntimeError):
    """The database was written with another table layout (``meta.schema_version``)."""


class Store:
    """The run's SQLite database (see the module docstring for the guarantees).

    Args:
        path: database file; created with its parent directory if missing.
        read_only: open an existing file for reading only (``traceml view --serve``): no
            lock beyond SQLite's shared one, no table or row written, no checkpoint at close
            (SQLite may leave the empty ``-wal`` and ``-shm`` files of WAL mode).

    Raises:
        StoreVersionError: the file holds another schema version than :data:`SCHEMA_VERSION`.
        sqlite3.Error: the file cannot be opened or is not a TraceML database (read-only: it
            is missing, or a running aggregator holds it).
    """

    def __init__(self, path: str | Path, *, read_only: bool = False) -> None:
        self.path = Path(path)
        self.read_only = read_only
        if read_only:
            self._db = sqlite3.connect(
                f"{self.path.absolute().as_uri()}?mode=ro", uri=True, check_same_thread=False
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
        row = has_meta and self._db.execute(
            "SELECT value FROM meta WHERE key = 'schema_version'"
        ).fetchone()
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
        """
        steps: list[tuple] = []  # (rank, restart, StepColumns) of the batches to store
        process: list[tuple] = []
        system: list[tuple] = []
        gpus: list[tuple] = []
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
                results.append(WriteResult(batch.seq, False))
                restart = batch.restart_count
                if batch.HasField("identity"):
                    self._write_identity(batch.identity)
                rank = batch.rank
                steps += [(rank, restart, group) for group in batch.step_groups]
                for s in batch.process_samples:
                    # A node sampler reports for its local workers; a rank for itself.
                    owner = (s.rank, s.restart_count) if sender == "node_rank" else (rank, restart)
                    process.append(owner + (s.unix_us,) + _optional(s, _PROCESS_FIELDS))
                for s in batch.system_samples:
                    system.append(
                        (s.node_rank, s.unix_us, s.hostname)
                        + _optional(s, _SYSTEM_FIELDS)
                        + (s.gpu_unavailable_reason or None,)
                    )
                    for g in s.gpus:
                        gpus.append(
                            (s.node_rank, s.unix_us, g.nvml_index, g.uuid)
                            + _optional(g, _GPU_FIELDS)
                            + (g.unavailable_reason or None,)
                        )
                for count in batch.flops_counts:
                    db.execute(
                        "INSERT OR REPLACE INTO rank_flops VALUES (?,?,?,?,?,?,?,?)",
                        (rank, restart) + flops_row(count),
                    )
                if batch.HasField("finish"):
                    self._write_finish(rank, restart, batch.finish, received_unix_us)
                if sender == "rank" and batch.HasField("counts"):
                    c = batch.counts
                    counts[rank, restart] = (rank, restart, batch.seq, c.records_produced,
                                             c.records_dropped, c.steps_produced, c.steps_dropped)
            for rank, restart, group in steps:
                _insert_steps(db, rank, restart, group)
            if process:
                db.executemany("INSERT INTO process_samples VALUES (?,?,?,?,?,?,?)", process)
            if system:
                db.executemany("INSERT INTO system_samples VALUES (?,?,?,?,?,?,?)", system)
            if gpus:
                db.executemany("INSERT INTO gpu_samples VALUES (?,?,?,?,?,?,?,?,?,?)", gpus)
            if counts:  # a stream's batches are stored in order: the last one is the latest
                db.executemany(
                    "INSERT OR REPLACE INTO sender_counts VALUES (?,?,?,?,?,?,?)", counts.values()
                )
            if touched:
                db.executemany(
                    "INSERT OR REPLACE INTO streams VALUES (?,?,?,?)",
                    [k + (v,) for k, v in touched.items()],
                )
            db.execute("COMMIT")
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

    def _write_identity(self, ident) -> None:
        self._db.execute(
            "INSERT OR REPLACE INTO ranks VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
            (
                ident.rank,
                ident.restart_count,
                ident.node_rank,
                ident.local_rank,
                ident.world_size,
                ident.local_world_size,
                ident.hostname,
                ident.pid,
                ident.start_unix_us,
                ident.torch_version,
                ident.cuda_version,
                ident.backend,
                ident.parallelism,
                ident.device,
                ident.gpu_uuid,
            ),
        )

    def _write_finish(self, rank: int, restart: int, finish, received_unix_us: int) -> None:
        self._db.execute(
            "INSERT OR REPLACE INTO rank_finish VALUES (?,?,?,?,?,?,?,?,?)",
            (
                rank,
                restart,
                finish.steps_completed,
                finish.records_dropped,
                finish.steps_gpu_unresolved,
                wire.end_state_name(finish.end_state),
                finish.reason or None,
                finish.last_seq,
                received_unix_us,
            ),
        )

    def write_node_exit(self, report, received_unix_us: int) -> None:
        """Store a node's torchrun exit and its ranks' end states (a later report replaces)."""
        rank_ends = [  # built first: an unknown end state raises before the transaction
            (
                r.rank,
                r.local_rank,
                report.node_rank,
                wire.end_state_name(r.end_state),
                r.exit_code if r.HasField("exit_code") else None,
                r.signal if r.HasField("signal") else None,
                r.reason or None,
            )
            for r in report.ranks
        ]
        db = self._db
        db.execute("BEGIN")
        try:
            db.execute(
                "INSERT OR REPLACE INTO node_exits VALUES (?,?,?,?,?)",
                (
                    report.node_rank,
                    report.hostname,
                    report.exit_code,
                    report.restart_count,
                    received_unix_us,
                ),
            )
            db.executemany("INSERT OR REPLACE INTO rank_ends VALUES (?,?,?,?,?,?,?)", rank_ends)
            db.execute("COMMIT")
        except BaseException:
            self._rollback()
            raise

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
