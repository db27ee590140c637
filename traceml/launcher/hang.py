"""Node 0's console line for a hang: the aggregator's hang record (stored as "stall"), said once
per hang."""

from __future__ import annotations

import json
from collections.abc import Callable

from traceml.analysis.hang import describe
from traceml.core.records import HangRecord


class HangNotice:
    """Says the stall records node 0's session brings (:attr:`NodeSession.hang_record
    <traceml.launcher.session.NodeSession.hang_record>`, pushed by the aggregator's hang watch):
    one line as a stall begins, one as it is over."""

    def __init__(self) -> None:
        self._said: float | None = None  # detected_unix_s of the stall already told

    def hear(self, record_json: str | None, say: Callable[[str], None]) -> None:
        """Take the latest record heard (JSON; "": the stall is over; None: none heard yet)
        and say one line when a stall appears, and one when it is over (progress again). The
        same stall heard again (a resumed session, a frozen or joined record) is not said."""
        if record_json is None:
            return
        if not record_json:
            if self._said is not None:
                self._said = None
                say("the stalled ranks make progress again")
            return
        try:
            record = HangRecord.from_json(json.loads(record_json))
        except (ValueError, KeyError, TypeError):
            return  # not a record
        if record.detected_unix_s != self._said:
            self._said = record.detected_unix_s
            say(describe(record))
