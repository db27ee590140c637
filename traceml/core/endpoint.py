"""The aggregator's endpoint, for every side that reaches it: ``host:port``, the default port,
one-off unary RPCs, and the validation of ports and durations given on a command line.

Used by ``traceml run`` (launcher), ``traceml-aggregator`` and the SDK, so none of them has to
import another. gRPC and the wire code are imported by :func:`call`, the only function that
needs them (about 0.2 s of imports).
"""

from __future__ import annotations

import math

#: The aggregator's gRPC port on node 0 unless ``--aggregator-port``/``--port`` says otherwise.
DEFAULT_PORT = 29765

#: The dashboard's HTTP port (``--dashboard-port``; ``traceml run --mode dashboard``, ``traceml
#: view --serve``): two above the aggregator's, as 29766 is the Prometheus ``--metrics-port`` of
#: docs/prometheus.md's examples.
DASHBOARD_PORT = 29767

#: Bind addresses that mean "every interface": a client on the same host reaches them locally.
ANY_ADDRESS = ("0.0.0.0", "::", "")


def dashboard_url(bind_host: str, port: int, token: str) -> str:
    """The dashboard's URL as printed, token included: ``http://HOST:PORT/?token=TOKEN``, HOST
    being this machine's name when the dashboard listens on every interface (``0.0.0.0``)."""
    import socket

    host = socket.gethostname() if bind_host in ANY_ADDRESS else bind_host
    return f"http://{target(host, port)}/?token={token}"


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


def port_error(flag: str, port: int | None) -> str:
    """The one-line refusal of ``port`` given with ``flag``, or "" when it is a TCP port
    (1-65535) or None (not given)."""
    if port is not None and not 0 < port < 65536:
        return f"{flag} {port} is not a TCP port (1-65535)"
    return ""


def seconds_error(flag: str, value: float) -> str:
    """The one-line refusal of the duration ``value`` (s) given with ``flag``, or "" when it is
    a finite number > 0."""
    if math.isfinite(value) and value > 0:
        return ""
    return f"{flag} must be a finite number > 0 (got {value})"


def call(target: str, method: str, request, timeout_s: float, credentials=None):
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
