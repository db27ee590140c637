"""The aggregator's gate: the run token on every call, and TLS when node 0 has a certificate.

:class:`TokenInterceptor` is a ``grpc.aio`` server interceptor. It reads the
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

import hmac
from pathlib import Path

import grpc

from traceml.core.transport import TOKEN_METADATA_KEY
from traceml_aggregator.senders import Rejections

#: Method prefix of the health service, which needs no token (see the module docstring).
HEALTH_PREFIX = "/grpc.health.v1.Health/"


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses (``UNAUTHENTICATED``) every call but health's that lacks the run token.

    Args:
        token: the run's token (non-empty).
        rejections: where refusals are counted.
    """

    def __init__(self, token: str, rejections: Rejections) -> None:
        if not token:
            raise ValueError("the run token must not be empty")
        self._token = token.encode("utf-8")
        self._rejections = rejections
        self._deny = grpc.unary_unary_rpc_method_handler(self._refuse)

    async def intercept_service(self, continuation, handler_call_details):
        """The call's handler, or the refusing one when the token is missing or wrong."""
        method = handler_call_details.method
        if method.startswith(HEALTH_PREFIX):
            return await continuation(handler_call_details)
        for key, value in handler_call_details.invocation_metadata or ():
            if key == TOKEN_METADATA_KEY:
                given = value if isinstance(value, bytes) else value.encode("utf-8", "replace")
                if hmac.compare_digest(given, self._token):
                    return await continuation(handler_call_details)
                break
        self._rejections.refuse(
            "unauthenticated", f"a call of {method} without this run's token"
        )
        return self._deny

    @staticmethod
    async def _refuse(_request: bytes, context) -> None:
        await context.abort(
            grpc.StatusCode.UNAUTHENTICATED,
            "missing or wrong run token (TRACEML_RUN_TOKEN, or the run directory's run_token)",
        )


def server_credentials(cert: Path, key: Path):
    """TLS credentials of the aggregator from PEM files ``cert`` and ``key``.

    Raises:
        OSError: a file cannot be read.
    """
    return grpc.ssl_server_credentials([(Path(key).read_bytes(), Path(cert).read_bytes())])
