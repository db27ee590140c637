"""How each sender's stream ended: the aggregator's liveness evidence for ranks and samplers.

Every sender (a rank's SDK, a node's sampler) holds one ``Stream`` call at a time (it reopens
one after a fork, an outage or an aggregator restart). :class:`StreamLedger` keeps, per sender
and attempt, how its latest stream ended:

* ``open``: the stream is still open (a live summary; or the aggregator stopped first);
* ``closed``: the sender half-closed it (a clean end: the SDK's ``close()``, or a fork);
* ``lost``: it ended without the sender's close: the sender cancelled it, its connection was
  reset (the process died: its kernel resets it at once), or the server's keepalive got no
  answer (a host down or partitioned: within ``SERVER_KEEPALIVE_MS + KEEPALIVE_TIMEOUT_MS`` of
  :mod:`traceml.core.transport`, 40 s). gRPC does not tell the server which of the three it was.

With ``finished`` (the sender's finish marker was stored), a rank that exited cleanly
(``closed``, finished) is told apart from one that vanished (``lost``, not finished). The
ledger is written to the store's :data:`STREAMS_META_KEY` entry while the aggregator runs (at
most ``RUN_RECORDS_PERSIST_S`` after a change, :mod:`traceml_aggregator.server`: a replacement
of a SIGKILLed aggregator restores it) and with the reports, and read back by the summary as
``run.telemetry_health.sender_streams``. Only senders whose batch passed the checks enter it.
"""

from __future__ import annotations

import json
import time

#: ``meta`` key of the ledger: a JSON list of :meth:`StreamLedger.entries`.
STREAMS_META_KEY = "sender_streams"
OPEN, CLOSED, LOST = "open", "closed", "lost"
STATES = (OPEN, CLOSED, LOST)


class StreamLedger:
    """Per (sender kind, id, attempt): the latest stream's state, since when, how many streams
    the sender opened, and whether its finish marker was stored. Used on the event loop only."""

    def __init__(self) -> None:
        self._senders: dict[tuple[str, int, int], dict] = {}
        #: Changes made since the start (the aggregator persists the ledger when it grew).
        self.changes = 0

    @staticmethod
    def key(batch) -> tuple[str, int, int]:
        """``("rank", rank, restart)`` or ``("node", node_rank, restart)`` of a Batch."""
        kind = batch.WhichOneof("sender")
        value = batch.rank if kind == "rank" else batch.node_rank
        return ("rank" if kind == "rank" else "node", value, batch.restart_count)

    def restore(self, text: str | None) -> None:
        """Take back the entries an earlier aggregator of this run stored (JSON, or None)."""
        for entry in json.loads(text or "[]"):
            self._senders[(entry["sender"], entry["id"], entry["restart"])] = entry

    def opened(self, key: tuple[str, int, int]) -> None:
        """A stream of ``key`` carried its first batch."""
        entry = self._senders.get(key)
        if entry is None:
            kind, ident, restart = key
            entry = self._senders[key] = {
                "sender": kind,
                "id": ident,
                "restart": restart,
                "finished": False,
                "streams": 0,
            }
        entry.update(state=OPEN, since_unix_s=round(time.time(), 3))
        entry["streams"] += 1
        self.changes += 1

    def finished(self, key: tuple[str, int, int]) -> None:
        """The finish marker of ``key`` is stored."""
        self._senders[key]["finished"] = True
        self.changes += 1

    def ended(self, key: tuple[str, int, int], state: str) -> None:
        """The stream of ``key`` ended: :data:`CLOSED` or :data:`LOST`."""
        self._senders[key].update(state=state, since_unix_s=round(time.time(), 3))
        self.changes += 1

    def entries(self) -> list[dict]:
        """Every sender's entry, ranks first, by id and attempt: ``{"sender": "rank"|"node",
        "id": int, "restart": int, "finished": bool, "streams": int (opened),
        "state": "open"|"closed"|"lost", "since_unix_s": float (Unix s of the last change)}``."""
        # Copies, each made in one step under the GIL: the reports call this on the writer
        # thread while the event loop may update the ledger.
        keys = sorted(list(self._senders), key=lambda k: (k[0] != "rank", k))
        return [dict(self._senders[k]) for k in keys]

    def to_json(self) -> str:
        """:meth:`entries` as the JSON text stored under :data:`STREAMS_META_KEY`."""
        return json.dumps(self.entries(), sort_keys=True)


class SenderStream:
    """One open stream of one sender as the ledger sees it: a ``Stream`` call, or one channel
    of a node relay's ``Relay`` call. It enters :class:`StreamLedger` with its first batch the
    checks let in, and leaves it, closed or lost, at :meth:`end`. Used on the event loop only.
    """

    def __init__(self, ledger: StreamLedger) -> None:
        self.ledger = ledger
        self.key: tuple[str, int, int] | None = None
        self.state = LOST  # until the sender's closing message says otherwise

    def closing(self) -> None:
        """The sender's ``closing`` message: the stream is ending on purpose."""
        self.state = CLOSED

    def answered(self, batch, ack) -> None:
        """``batch`` was answered ``ack``: the sender enters the ledger with its first batch
        taken (stored, or stored before), and is ``finished`` once its finish marker is."""
        taken = not ack.rejected and not ack.retry_after_ms
        if self.key is None and taken and batch.WhichOneof("sender") is not None:
            self.key = StreamLedger.key(batch)
            self.ledger.opened(self.key)
        if self.key is not None and batch.HasField("finish") and ack.stored_seq >= batch.seq:
            self.ledger.finished(self.key)

    def end(self) -> None:
        """The stream ended (also when cancelled: by the sender, a reset, a keepalive
        timeout, or its relay's call ending)."""
        if self.key is not None:
            self.ledger.ended(self.key, self.state)
