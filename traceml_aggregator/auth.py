"""The aggregator's gate: the run token on every call, and TLS when node 0 has a certificate.

:class:`TokenInterceptor` is a ``grpc.aio`` server interceptor. It first checks the wire
version a call names (``traceml-wire-version``, see :data:`traceml.core.transport.WIRE_VERSION`):
a client of another version is refused ``FAILED_PRECONDITION`` with one line naming both
versions (counted, kind ``wire_version``); a call naming none comes from a client of before
versioning, which spoke v1. Then it reads the
``traceml-run-token`` metadata of every call and compares it with the run's token in
constant time (:func:`hmac.compare_digest`); a call without it, or with another one, is
answered ``UNAUTHENTICATED`` before its message is even parsed, so nothing of it reaches a
handler, the writer or the store. Each refusal is counted (kind ``unauthenticated``).

The one exception is the standard health service (``grpc.health.v1.Health``): it carries no
run data and says only SERVING or NOT_SERVING, the launchers of other nodes poll it before
they have read the token (they wait for the aggregator, then for the token file it sits next
to), and generic probes (``grpc_health_probe``, a cluster's liveness check) have no token.
"""

from __future__ import annotations

import ssl
from pathlib import Path

import grpc

from traceml.core.transport import (
    TOKEN_METADATA_KEY,
    VERSION_METADATA_KEY,
    WIRE_VERSION,
    same_token,
    version_mismatch,
)
from traceml_aggregator.senders import Rejections

#: Method prefix of the health service, which needs no token (see the module docstring).
HEALTH_PREFIX = "/grpc.health.v1.Health/"


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses (``UNAUTHENTICATED``) every call but health's that lacks the run token.

    Args:
        token: the run's token (non-empty).
        rejections: where refusals are counted.
        wire_version: the wire version served (:data:`~traceml.core.transport.WIRE_VERSION`;
            another only to test what a client of this tree meets at an aggregator of another).
    """

    def __init__(
        self, token: str, rejections: Rejections, wire_version: int = WIRE_VERSION
    ) -> None:
        if not token:
            raise ValueError("the run token must not be empty")
        self._token = token
        self._rejections = rejections
        self._version = wire_version

    async def intercept_service(self, continuation, handler_call_details):
        """The call's handler, or the refusing one when the token is missing or wrong."""
        method = handler_call_details.method
        if method.startswith(HEALTH_PREFIX):
            return await continuation(handler_call_details)
        metadata = dict(handler_call_details.invocation_metadata or ())
        version = metadata.get(VERSION_METADATA_KEY, "")
        if (version or "1") != str(self._version):  # none: a client of before versioning (v1)
            self._rejections.refuse("wire_version", f"a call of {method} of wire v{version}")
            return refusal(
                await continuation(handler_call_details),
                grpc.StatusCode.FAILED_PRECONDITION,
                version_mismatch(version, self._version),
                ((VERSION_METADATA_KEY, str(self._version)),),
            )
        handler = await continuation(handler_call_details)
        if same_token(metadata.get(TOKEN_METADATA_KEY), self._token):
            return handler
        self._rejections.refuse("unauthenticated", f"a call of {method} without this run's token")
        return refusal(
            handler,
            grpc.StatusCode.UNAUTHENTICATED,
            "missing or wrong run token (TRACEML_RUN_TOKEN, or the run directory's run_token)",
        )


def refusal(handler, code: grpc.StatusCode, details: str, trailing_metadata=()):
    """A method handler that answers every call ``code`` with ``details`` (one line), of the
    same kind (unary or bidirectional stream) as ``handler``, the refused method's own (None:
    a method this aggregator does not have, answered as a unary call)."""

    async def unary(_request: bytes, context) -> None:
        await context.abort(code, details, trailing_metadata=trailing_metadata)

    async def stream(_requests, context):
        await context.abort(code, details, trailing_metadata=trailing_metadata)
        yield  # an async generator, as a streaming handler must be

    if handler is not None and handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(stream)
    return grpc.unary_unary_rpc_method_handler(unary)


def server_credentials(cert: Path, key: Path):
    """TLS credentials of the aggregator from PEM files ``cert`` and ``key``.

    Raises:
        OSError: a file cannot be read.
    """
    return grpc.ssl_server_credentials([(Path(key).read_bytes(), Path(cert).read_bytes())])


def bearer(header: str | None) -> str | None:
    """The token of an HTTP ``Authorization: Bearer TOKEN`` header value (the scheme's name in
    any case, as RFC 7235 has it), None without one."""
    scheme, _, token = (header or "").partition(" ")
    return token if scheme.lower() == "bearer" else None


def server_ssl_context(cert: Path, key: Path) -> ssl.SSLContext:
    """The TLS context of the aggregator's HTTP endpoints (dashboard, ``/metrics``) from the
    PEM files ``cert`` and ``key``, the gRPC port's own (:func:`server_credentials`).

    Raises:
        OSError: a file cannot be read.
        ssl.SSLError: the files are not a certificate and its key.
    """
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(str(cert), str(key))
    return context
