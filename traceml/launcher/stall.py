"""Node 0's console line for a hang: the aggregator's stall record, said once per stall."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from traceml.analysis.hang import describe


class StallNotice:
    """Watches ``aggregator/stall.json`` (written by the aggregator's hang watch).

    Args:
        path: the run directory's stall file.
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._said: float | None = None  # detected_unix_s of the stall already told

    def poll(self, say: Callable[[str], None]) -> None:
        """Say one line when a stall appears, and one when it is over (progress again)."""
        try:
            record = json.loads(self.path.read_text(encoding="utf-8"))
            detected = record["detected_unix_s"]
        except FileNotFoundError:
            if self._said is not None:
                self._said = None
                say("the stalled ranks make progress again")
            return
        except (OSError, ValueError, KeyError, TypeError):
            return  # being replaced, or not a record
        if detected != self._said:
            self._said = detected
            say(describe(record))
