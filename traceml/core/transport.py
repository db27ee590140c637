"""How every TraceML process reaches an aggregator: the run token, TLS, and the wire's limits.

One function, :func:`open_channel`, opens every client channel (ranks, node samplers,
launchers, live views), so every call carries the same credentials:

* the **run token** (``TRACEML_RUN_TOKEN``), sent as the ``traceml-run-token`` metadata of
  every call; the aggregator answers ``UNAUTHENTICATED`` to a call without it or with another
  one (the health service excepted, see ``traceml_aggregator/auth.py``);
* **TLS** when ``TRACEML_TLS_CA`` names the CA certificate (PEM) that signed the aggregator's
  certificate; a plain-text channel otherwise.

Both come from the environment, never from a command line (``ps`` shows every process's argv
to every user of the host): ``traceml run`` exports them to its ranks and to its aggregator.

The run token file: node 0's launcher writes ``<run dir>/run_token`` (mode 0600, atomically)
so that the other nodes, which share the run directory, read it there
(:func:`write_token_file`, :func:`read_token_file`; the name is
:data:`traceml.core.rundir.TOKEN_FILE_NAME`). grpc is imported by the functions that
need it, never by this module.
"""

from __future__ import annotations

import hmac
import os
import secrets
import stat
import time
from collections.abc import Callable, Iterator, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from traceml import settings
from traceml.core.rundir import write_atomic

if TYPE_CHECKING:
    import grpc

#: Metadata key of the run token on every call (gRPC metadata keys are lower case).
TOKEN_METADATA_KEY = "traceml-run-token"
#: How the node relay's own answers to a local stream's failure begin (the reason follows):
#: any other failure of a stream to the relay is the relay's socket itself, gone with its
#: launcher (traceml/launcher/relay.py, traceml/sdk/client.py).
RELAY_STATUS_PREFIX = "through the node relay: "
#: The status (``grpc.StatusCode``'s name) the node relay ends its local streams with once
#: node 0's aggregator is gone for good: its senders stop sending (traceml/launcher/relay.py,
#: traceml/sdk/client.py). Node 0's aggregator never answers with it.
RELAY_GONE_CODE = "ABORTED"
#: Largest message either side sends or receives, bytes (both sides set it: 4 MiB, gRPC's
#: usual receive bound, about 80 times a full batch of 512 steps).
MAX_MESSAGE_BYTES = 4 * 1024 * 1024
#: Trailing metadata of a ``RESOURCE_EXHAUSTED`` answer: how long the client waits before it
#: sends the same batch again, ms.
RETRY_AFTER_METADATA_KEY = "traceml-retry-after-ms"
#: Version of the wire this tree speaks (the ``traceml.wire.v1`` package). Every client call
#: carries it as :data:`VERSION_METADATA_KEY`; an aggregator of another version refuses the
#: call with :func:`version_mismatch` (``FAILED_PRECONDITION``) before routing it, so a client
#: and an aggregator of two versions fail with one line that names both, never with a decode
#: error or a hang. That check is the one part of the wire no version may change.
WIRE_VERSION = 1
VERSION_METADATA_KEY = "traceml-wire-version"

#: gRPC core's switch for its own ``pthread_atfork`` handlers, which grpcio builds turn on by
#: default (grpcio's Python layer reads the same variable, default off). They hang fork()
#: itself: the prepare handler blocks new gRPC work and then waits for gRPC's timer threads to
#: stop, while a timer thread that was running an expired timer (a reconnect backoff, a connect
#: or call deadline: many while an aggregator is unreachable) waits for that fork to complete,
#: both forever (grpcio 1.85, ``tests/scripts/fork_outage.py``'s 200 forks during an outage,
#: two runs at a time on the 2-core test machine: 12 of 115 runs hung, the parent inside
#: fork(); with the handlers off, 0 of 100, no fork over 0.08 s). TraceML never uses gRPC in a
#: forked child (:mod:`traceml.sdk.client`), so it needs none of them:
#: :func:`disable_grpc_fork_handlers` sets the variable to ``false`` unless the user set it.
#: gRPC reads it once, at ``import grpc``: setting it later changes nothing.
GRPC_FORK_SUPPORT_ENV = "GRPC_ENABLE_FORK_SUPPORT"


def disable_grpc_fork_handlers(env: MutableMapping[str, str]) -> None:
    """Set :data:`GRPC_FORK_SUPPORT_ENV` to ``false`` in ``env`` (``os.environ``, or the
    environment of a process to start) unless it is set already (the user's choice stands)."""
    env.setdefault(GRPC_FORK_SUPPORT_ENV, "false")


#: Keepalive, one policy for both sides (they must agree, or the server answers a client's
#: pings with GOAWAY ``too_many_pings`` and the client logs it on the user's stderr). The
#: client pings at most every :data:`CLIENT_KEEPALIVE_MS`, also while no call is open, and the
#: server permits a ping every :data:`SERVER_MIN_PING_INTERVAL_MS`, which is shorter. The
#: server pings each connection every :data:`SERVER_KEEPALIVE_MS` and drops it when no answer
#: comes within :data:`KEEPALIVE_TIMEOUT_MS`: a sender that vanished (host down, partition) has
#: its stream ended within ``SERVER_KEEPALIVE_MS + KEEPALIVE_TIMEOUT_MS`` (40 s); one whose
#: process died, at once (its kernel resets the connection). The timeout is generous on purpose:
#: on a host whose CPUs training saturates, gRPC's threads may answer a ping late (at a load of
#: 13 per core, a 10 s timeout dropped connections of benchmarks/ingest.py's clients), and a
#: dropped stream costs a reconnect and resends.
#: Each is a setting (``TRACEML_GRPC_*_MS``, :mod:`traceml.settings`, which holds the defaults
#: named here), read once at import.
CLIENT_KEEPALIVE_MS = settings.read(settings.GRPC_CLIENT_KEEPALIVE_MS)
SERVER_KEEPALIVE_MS = settings.read(settings.GRPC_SERVER_KEEPALIVE_MS)
SERVER_MIN_PING_INTERVAL_MS = settings.read(settings.GRPC_SERVER_MIN_PING_INTERVAL_MS)
KEEPALIVE_TIMEOUT_MS = settings.read(settings.GRPC_KEEPALIVE_TIMEOUT_MS)

#: A node launcher's heartbeat on its session stream, s (traceml/launcher/session.py).
NODE_HEARTBEAT_INTERVAL_S = 2.0
#: The aggregator marks a node lost once it has heard nothing from the node's launcher (no
#: message on a session, no new session) for this long, s: twelve heartbeats missed (three at
#: node 0's longest pace, ``traceml_aggregator/pace.py``). Heartbeats,
#: not keepalive, show that a node is alive, so this is shorter than the server's keepalive
#: drop (``SERVER_KEEPALIVE_MS + KEEPALIVE_TIMEOUT_MS``, 40 s); a launcher that reconnects with
#: its backoff (at most :data:`SESSION_MAX_BACKOFF_S`) after a short cut comes back before it.
#: The setting ``TRACEML_NODE_LOST_AFTER_SEC`` (read once at import) holds the default.
NODE_LOST_AFTER_S = settings.read(settings.NODE_LOST_AFTER_SEC)
#: Longest wait of a node launcher between two attempts to reopen its session, s.
SESSION_MAX_BACKOFF_S = 2.0
#: How long past the finalization budget node 0's launcher waits for the aggregator's answer,
#: and lets ``--finalize-only`` run, s: the time the reports are written in once the budget
#: went to waiting for ranks (traceml_aggregator/reports.py draws the HTML report only when
#: the summary is written in the first half of it).
FINALIZE_SLACK_S = 30.0


class TlsFilesError(ValueError):
    """TLS files that cannot be used: a certificate without its key, or a file not there."""


@dataclass(frozen=True)
class TlsFiles:
    """The PEM files of ``--tls-cert``, ``--tls-key`` and ``--tls-ca`` (None: not given)."""

    cert: Path | None = None
    key: Path | None = None
    ca: Path | None = None

    @classmethod
    def resolve(
        cls,
        cert: str | Path | None = None,
        key: str | Path | None = None,
        ca: str | Path | None = None,
        *,
        serves: bool,
        reads_ca: bool,
    ) -> TlsFiles:
        """The files from their flags, else ``TRACEML_TLS_CERT``/``_KEY``/``_CA``, absolute,
        checked: the one validator of the launcher and the aggregator.

        Args:
            serves: this process's own aggregator serves with them: the certificate and its
                key go together, and the CA defaults to the certificate (self-signed).
            reads_ca: this process connects as a client and needs the CA (the aggregator does
                not: ``ca`` stays None).

        Raises:
            TlsFilesError: one line: ``--tls-cert and --tls-key go together``, or
                ``--tls-X PATH not found``.
        """

        def given(value: str | Path | None, setting: settings.Setting) -> Path | None:
            value = value or settings.env_str(setting) or None
            return None if value is None else Path(value).absolute()

        cert, key = given(cert, settings.TLS_CERT), given(key, settings.TLS_KEY)
        ca = given(ca, settings.TLS_CA) if reads_ca else None
        if serves:
            if (cert is None) != (key is None):
                raise TlsFilesError("--tls-cert and --tls-key go together")
            if reads_ca and ca is None:
                ca = cert
        for flag, path in (("--tls-cert", cert), ("--tls-key", key), ("--tls-ca", ca)):
            if path is not None and not path.is_file():
                raise TlsFilesError(f"{flag} {path} not found")
        return cls(cert, key, ca)


class TokenFileError(RuntimeError):
    """The run token file cannot be used: unreadable, empty, or readable by other users."""


def new_token() -> str:
    """A fresh random run token: 32 bytes from :mod:`secrets`, URL-safe text (43 characters)."""
    return secrets.token_urlsafe(32)


def write_token_file(path: Path, token: str) -> None:
    """Write ``token`` (or a text that holds it, ASCII: the dashboard's link) to ``path``, mode
    0600 from its creation, through a temporary file and a rename: a reader sees no file or
    the whole token, never part of one.

    Raises:
        OSError: the directory is not writable.
    """
    write_atomic(Path(path), token.encode("ascii"), mode=0o600, sync=True)


def read_token_file(path: Path) -> str | None:
    """The token in ``path``; None when there is no such file (yet).

    Raises:
        TokenFileError: the file is readable or writable by group or others, belongs to
            another user, is empty, or cannot be read.
    """
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise TokenFileError(f"cannot read the run token file {path}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if st.st_uid != os.getuid():
            raise TokenFileError(
                f"the run token file {path} belongs to user id {st.st_uid}, not to this user"
            )
        if st.st_mode & 0o077:
            raise TokenFileError(
                f"the run token file {path} is accessible to other users (mode "
                f"{stat.filemode(st.st_mode)}); refusing it: `chmod 600 {path}`"
            )
        token = os.read(fd, 4096).decode("ascii", "replace").strip()
    finally:
        os.close(fd)
    if not token:
        raise TokenFileError(f"the run token file {path} is empty")
    return token


def wait_token_file(path: Path, deadline_monotonic: float, poll_s: float = 0.1) -> str | None:
    """Poll :func:`read_token_file` until it finds the token or the deadline passes (None).

    Raises:
        TokenFileError: see :func:`read_token_file`.
    """
    while True:
        token = read_token_file(path)
        if token is not None or time.monotonic() >= deadline_monotonic:
            return token
        time.sleep(poll_s)


@dataclass(frozen=True)
class Credentials:
    """What a client presents: the run token ("" for none) and the CA certificate (PEM bytes,
    None for a plain-text channel)."""

    token: str = ""
    tls_ca: bytes | None = None

    @classmethod
    def from_env(cls) -> Credentials:
        """``TRACEML_RUN_TOKEN`` and the file ``TRACEML_TLS_CA`` names.

        Raises:
            OSError: ``TRACEML_TLS_CA`` names a file that cannot be read.
        """
        ca_path = settings.env_str(settings.TLS_CA)
        return cls(
            token=settings.env_str(settings.RUN_TOKEN),
            tls_ca=Path(ca_path).read_bytes() if ca_path else None,
        )


def version_mismatch(client_version: str, server_version: int) -> str:
    """The one line an aggregator of wire ``server_version`` refuses a client with, which sent
    ``client_version`` ("" when it sent none: a client from before versioning)."""
    client = f"v{client_version}" if client_version else "an unversioned wire"
    return (
        f"wire version mismatch: this client speaks traceml wire {client}, the aggregator "
        f"speaks v{server_version}; use one TraceML version on every node"
    )


def channel_options() -> list[tuple[str, int]]:
    """The message size bounds and keepalive every client channel sets (the server's
    options, :func:`server_options`, agree with them), and no bandwidth-delay-product probe
    on either side: with it, a message after a quiet spell made its receiver send a PING
    (docs/wire.md, *No bandwidth probe*)."""
    return [
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.keepalive_time_ms", CLIENT_KEEPALIVE_MS),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.http2.bdp_probe", 0),
    ]


def server_options(max_receive_bytes: int = MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    """The aggregator's message size bounds and keepalive policy (see
    :data:`CLIENT_KEEPALIVE_MS`); a server that forwards what it receives (the node relay)
    takes messages of at most ``max_receive_bytes``."""
    return [
        ("grpc.max_receive_message_length", max_receive_bytes),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.keepalive_time_ms", SERVER_KEEPALIVE_MS),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", SERVER_MIN_PING_INTERVAL_MS),
        ("grpc.http2.max_ping_strikes", 2),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.http2.bdp_probe", 0),
    ]


def open_channel(
    target: str,
    options: list[tuple[str, int | str]] | None = None,
    credentials: Credentials | None = None,
) -> grpc.Channel:
    """A synchronous gRPC channel to the aggregator at ``target`` (``host:port``) that sends
    the run token and :data:`WIRE_VERSION` with every call (unary and streaming), over TLS
    when the credentials carry a CA.

    Args:
        target: the aggregator's ``host:port``.
        options: more channel options (after :func:`channel_options`).
        credentials: defaults to :meth:`Credentials.from_env`.

    Raises:
        OSError: ``TRACEML_TLS_CA`` cannot be read (only when ``credentials`` is None).
    """
    import grpc

    creds = credentials if credentials is not None else Credentials.from_env()
    opts = channel_options() + list(options or [])
    if creds.tls_ca is not None:
        channel = grpc.secure_channel(
            target, grpc.ssl_channel_credentials(root_certificates=creds.tls_ca), options=opts
        )
    else:
        channel = grpc.insecure_channel(target, options=opts)
    return grpc.intercept_channel(channel, _metadata_interceptor(creds.token))


def open_aio_channel(
    target: str, credentials: Credentials, options: list[tuple[str, int | str]] | None = None
) -> grpc.aio.Channel:
    """A ``grpc.aio`` channel to the aggregator at ``target`` with :func:`channel_options`
    and ``options`` after them, over TLS when ``credentials`` carry a CA. Its calls pass
    :func:`call_metadata` themselves (an aio channel takes no synchronous interceptor)."""
    import grpc

    opts = channel_options() + list(options or [])
    if credentials.tls_ca is not None:
        creds = grpc.ssl_channel_credentials(root_certificates=credentials.tls_ca)
        return grpc.aio.secure_channel(target, creds, options=opts)
    return grpc.aio.insecure_channel(target, options=opts)


def same_token(given: str | bytes | None, token: str) -> bool:
    """Whether ``given`` (a call's metadata value or a bearer; None: none given) is the run's
    ``token``, compared in constant time."""
    if given is None:
        return False
    given = given if isinstance(given, bytes) else given.encode("utf-8", "replace")
    return hmac.compare_digest(given, token.encode("utf-8"))


def call_metadata(token: str) -> list[tuple[str, str]]:
    """The metadata every call to the aggregator carries: the wire version and the run token
    (when not "")."""
    entries = [(VERSION_METADATA_KEY, str(WIRE_VERSION))]
    if token:
        entries.append((TOKEN_METADATA_KEY, token))
    return entries


def _metadata_interceptor(
    token: str,
) -> grpc.UnaryUnaryClientInterceptor | grpc.StreamStreamClientInterceptor:
    """A client interceptor that adds the wire version and the run token (when not "") to
    every call's metadata, unary and streaming."""
    import grpc

    entries = call_metadata(token)

    # grpc ships no type stubs: its classes are Any to mypy, and subclassing Any is refused.
    class _Details(grpc.ClientCallDetails):  # type: ignore[misc]
        def __init__(
            self, details: grpc.ClientCallDetails, metadata: list[tuple[str, str]]
        ) -> None:
            self.method = details.method
            self.timeout = details.timeout
            self.metadata = metadata
            self.credentials = details.credentials
            self.wait_for_ready = details.wait_for_ready
            self.compression = details.compression

    class _Interceptor(  # as _Details: grpc's classes are Any
        grpc.UnaryUnaryClientInterceptor,  # type: ignore[misc]
        grpc.StreamStreamClientInterceptor,  # type: ignore[misc]
    ):
        def intercept_unary_unary(
            self,
            continuation: Callable[..., object],
            details: grpc.ClientCallDetails,
            request: object,
        ) -> object:
            return continuation(_Details(details, list(details.metadata or ()) + entries), request)

        def intercept_stream_stream(
            self,
            continuation: Callable[..., object],
            details: grpc.ClientCallDetails,
            request_iterator: Iterator[object],
        ) -> object:
            return continuation(
                _Details(details, list(details.metadata or ()) + entries), request_iterator
            )

    return _Interceptor()
