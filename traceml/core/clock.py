"""The wall clock TraceML stamps on the wire, and each node's offset from node 0's clock.

Every timestamp a rank or a launcher sends as "µs since the Unix epoch" (a rank's
``start_unix_us``, which its step ends and collective arrivals are offsets from; a sampler's
``unix_us``) comes from :func:`unix_ns`: the host's ``time.time_ns()``, plus
``TRACEML_TEST_CLOCK_OFFSET_MS`` (0 outside tests), so a test can play a node whose clock is
off.

Node clocks disagree (NTP keeps them within milliseconds when it runs, and a node without it
can be seconds off), so node 0 cannot compare two ranks' arrival times from two nodes as sent.
Each node's launcher measures its clock's offset from node 0's aggregator over its session
stream, NTP-style (:class:`OffsetEstimator`): a heartbeat carries its send time ``t0``; the
aggregator answers at once with the time it read it (``t1``) and the time it answered (``t2``);
the launcher reads the answer at ``t3``. Whatever the two one-way delays, the offset (node 0's
clock minus this node's) lies in ``[t2 - t3, t1 - t0]``, so the estimate is that interval's
middle and its error bound is half its width, ``((t3 - t0) - (t2 - t1)) / 2``: a bound, not a
statistic, that holds as long as neither clock jumps during the exchange. Of the latest
:data:`SAMPLES_KEPT` exchanges the estimator keeps the one with the smallest bound (the least
queueing), and the launcher sends that estimate to node 0 as soon as it changes.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass

from traceml import settings

#: ``TRACEML_TEST_CLOCK_OFFSET_MS`` in ns (read once at import).
TEST_OFFSET_NS: int = settings.read(settings.TEST_CLOCK_OFFSET_MS) * 1_000_000
#: Exchanges the estimator chooses its estimate from (the latest ones; one per heartbeat, so
#: about NODE_HEARTBEAT_INTERVAL_S x this of history).
SAMPLES_KEPT = 16


def unix_ns() -> int:
    """This host's wall clock as TraceML sends it: ns since the Unix epoch (see the module
    docstring for the test offset)."""
    return time.time_ns() + TEST_OFFSET_NS


@dataclass(frozen=True)
class Offset:
    """One estimate of a node's clock offset.

    Attributes:
        offset_us: node 0's clock minus this node's, µs (add it to this node's times to read
            them on node 0's clock).
        error_us: the bound: the true offset lies within ``offset_us ± error_us`` (µs).
    """

    offset_us: int
    error_us: int


def exchange(t0: int, t1: int, t2: int, t3: int) -> Offset:
    """The offset of one exchange (ns timestamps: ``t0`` sent and ``t3`` answer read on this
    node's clock, ``t1`` read and ``t2`` answered on node 0's).

    Raises:
        ValueError: the times are not an exchange: an answer read before it was sent
            (``t3 < t0``), answered before it was read (``t2 < t1``), or held by node 0 longer
            than the round trip took (``t2 - t1 > t3 - t0``: a clock stepped during it, or the
            answer is not the aggregator's).
    """
    low, high = t2 - t3, t1 - t0
    if t3 < t0 or t2 < t1 or high < low:
        raise ValueError(f"not an exchange: t0={t0} t1={t1} t2={t2} t3={t3}")
    return Offset(offset_us=(low + high) // 2000, error_us=-(-(high - low) // 2000))


class OffsetEstimator:
    """The best of the latest :data:`SAMPLES_KEPT` exchanges (the smallest error bound).

    Thread-safe: the launcher's session stamps and sends heartbeats on gRPC's request thread
    and reads the answers on its own."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._samples: deque[Offset] = deque(maxlen=SAMPLES_KEPT)
        #: t0 of the heartbeats sent and not answered yet (the latest SAMPLES_KEPT).
        self._sent: deque[int] = deque(maxlen=SAMPLES_KEPT)

    def sent(self) -> int:
        """Stamp a heartbeat's t0 (:func:`unix_ns`) as it is sent; returns it."""
        t0 = unix_ns()
        with self._lock:
            self._sent.append(t0)
        return t0

    def add(self, t0: int, t1: int, t2: int, t3: int) -> bool:
        """Take one exchange (see :func:`exchange`); True when it changed :meth:`best`. An
        answer to no heartbeat this estimator sent (or one answered already) and a malformed
        one are ignored."""
        with self._lock:
            if t0 not in self._sent:
                return False
            self._sent.remove(t0)
            try:
                offset = exchange(t0, t1, t2, t3)
            except ValueError:
                return False
            before = self._best()
            self._samples.append(offset)
            return self._best() != before

    def best(self) -> Offset | None:
        """The estimate with the smallest bound of the latest exchanges; None before one."""
        with self._lock:
            return self._best()

    def _best(self) -> Offset | None:
        return min(self._samples, key=lambda o: o.error_us, default=None)
