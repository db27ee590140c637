"""The aggregator's endpoint, for every side that reaches it: ``host:port``, the dashboard's
URL and one-off unary RPCs (its ports are knobs: :mod:`traceml.settings`).

Used by ``traceml run`` (launcher), ``traceml-aggregator`` and the SDK, so none of them has to
import another. gRPC and the wire code are imported by :func:`call`, the only function that
needs them (about 0.2 s of imports).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from google.protobuf.message import Message

    from traceml.core.transport import Credentials

#: Bind addresses that mean "every interface": a client on the same host reaches them locally.
ANY_ADDRESS = ("0.0.0.0", "::", "")


def dashboard_url(bind_host: str, port: int, tls: bool = False) -> str:
    """The dashboard's URL as printed, without the token: ``http[s]://HOST:PORT/``, HOST being
    this machine's name when the dashboard listens on every interface (``0.0.0.0``), https
    when it serves TLS."""
    import socket

    host = socket.gethostname() if bind_host in ANY_ADDRESS else bind_host
    return f"{'https' if tls else 'http'}://{target(host, port)}/"


def dashboard_link(url: str, token: str) -> str:
    """The dashboard's ``url`` (:func:`dashboard_url`) that opens the page: ``URL?token=TOKEN``.
    It holds the run token: written only to a file of mode 0600, never printed."""
    return f"{url}?token={token}"


def bracket(host: str) -> str:
    """``host`` as the host part of ``host:port``: an IPv6 literal (``::1``) in brackets
    (``[::1]``); names, IPv4 addresses and already bracketed literals unchanged."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def target(host: str, port: int) -> str:
    """``host:port`` (``[v6]:port`` for an IPv6 literal), as gRPC and ``TRACEML_AGGREGATOR``
    take it. Example: ``target("::1", 29765) == "[::1]:29765"``."""
    return f"{bracket(host)}:{port}"


def local_target(bind_host: str, port: int) -> str:
    """Where a client on the aggregator's own host reaches it: ``127.0.0.1:port`` when it
    listens on every interface (``0.0.0.0``, ``::``), else its bind address."""
    return target("127.0.0.1" if bind_host in ANY_ADDRESS else bind_host, port)


def call(
    target: str,
    method: str,
    request: Message,
    timeout_s: float,
    credentials: Credentials | None = None,
) -> Message:
    """One unary RPC ``method`` (e.g. ``"Finalize"``) of the aggregator at ``target``, on a
    channel of its own (with the run token and TLS of :func:`traceml.core.transport.open_channel`)
    that is closed when the call returns.

    Args:
        target: ``host:port`` (see :func:`target`).
        request: the method's request message (``traceml.wire``).
        timeout_s: deadline of the call, s.
        credentials: a :class:`traceml.core.transport.Credentials`; from the environment when
            None.

    Raises:
        grpc.RpcError: the call failed or timed out.
        OSError: ``TRACEML_TLS_CA`` cannot be read (only when ``credentials`` is None).
    """
    from traceml import wire
    from traceml.core.transport import open_channel

    with open_channel(target, credentials=credentials) as channel:
        return getattr(wire.AggregatorStub(channel), method)(request, timeout=timeout_s)
