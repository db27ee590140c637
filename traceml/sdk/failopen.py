"""How the SDK reports its own trouble: one ``traceml:`` warning line (the ``traceml.sdk``
logger, see :mod:`traceml.core.log`), never an exception into training unless
``TRACEML_STRICT=1`` asks for it.

Every SDK module that can fail imports this one, and this one imports none of them.
"""

from __future__ import annotations

from traceml import settings
from traceml.core import log

_log = log.get("sdk")


def warn(message: str) -> None:
    """One ``traceml:``-prefixed warning line on stderr (the ``traceml.sdk`` logger)."""
    _log.warning(message)


_said: set[str] = set()


def warn_once(key: str, message: str) -> None:
    """:func:`warn` ``message`` the first time ``key`` is given in this process; later calls
    with the same ``key`` say nothing (a failure that repeats every step is said once)."""
    if key not in _said:
        _said.add(key)
        warn(message)


def fail_open(what: str, exc: BaseException) -> None:
    """Report an SDK error as one warning, or raise it under ``TRACEML_STRICT=1``."""
    if settings.read(settings.STRICT):
        raise exc
    warn(f"{what} failed ({type(exc).__name__}: {exc}); training continues")
