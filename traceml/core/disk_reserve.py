"""Room held on node 0's disk for the end of a run.

A run's disk can fill while it trains (a shared filesystem, a quota). The store then cannot
commit (:attr:`~traceml_aggregator.writer.Writer.store_failure`), and the end of the run would
have nowhere to go: the node exits (the ranks' end states), the stream ledger, the final
summary. So the aggregator holds :data:`RESERVE_BYTES` in a file of the run directory
(:attr:`~traceml.core.rundir.RunDir.disk_reserve`), allocated when it starts serving
(``posix_fallocate``: the blocks are taken, as a sparse file's would not be, and count against
a quota), and gives them back just before it writes a summary, and when it stops. Node 0's
launcher gives back the bytes of an aggregator that died, before it starts a replacement or
writes the summary from the store.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from traceml.core import log

#: Bytes held for the end of a run: the store's last commits and the report files.
RESERVE_BYTES = 32 * 1024 * 1024

_log = log.get("aggregator")  # the aggregator holds; the launcher only releases


def hold(path: Path, size: int = RESERVE_BYTES) -> None:
    """Take ``size`` bytes of the disk in the file ``path`` (one an earlier aggregator of the
    run left is taken as it is, and grown to ``size``). A disk without room for them already
    is said in one warning, and nothing is held."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            os.posix_fallocate(fd, 0, size)
        finally:
            os.close(fd)
    except OSError as exc:
        path.unlink(missing_ok=True)
        _log.warning(
            f"warning: cannot hold {size} bytes for the end of the run in {path} "
            f"({exc.strerror}); if the disk fills, the summary may find no room"
        )


def release(path: Path) -> None:
    """Give the bytes held in ``path`` back (nothing when none are, or the directory cannot be
    written any more: what follows fails on its own, and says so)."""
    with contextlib.suppress(OSError):
        path.unlink(missing_ok=True)
