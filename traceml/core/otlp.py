"""Whether node 0 pushes its metrics over OTLP, and whether the packages that do it are here:
what ``traceml run`` and ``traceml-aggregator`` both decide before the export starts
(the export itself: :mod:`traceml_aggregator.otlp`).

The export is on with ``--otlp-endpoint URL`` (:data:`traceml.settings.OTLP_ENDPOINT`), or
with one of the standard :data:`ENDPOINT_VARIABLES` set: the official exporter then reads
that variable itself, as it reads the other ``OTEL_EXPORTER_OTLP_*`` ones (headers, timeout,
compression, certificates, insecure).
"""

from __future__ import annotations

import importlib.util
import os
import urllib.parse
from collections.abc import Mapping

#: The standard variables that turn the export on without the flag, the more specific first
#: (the OpenTelemetry specification's order of precedence).
ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
#: The ``[default: ...]`` of ``--otlp-endpoint``'s help.
DEFAULT_TEXT = f"${' or $'.join(ENDPOINT_VARIABLES)}, else off"
#: The modules the export needs: the ``otlp`` extra's packages (opentelemetry-sdk,
#: opentelemetry-exporter-otlp-proto-grpc).
MODULES = ("opentelemetry.sdk.metrics", "opentelemetry.exporter.otlp.proto.grpc.metric_exporter")
#: How to install them.
INSTALL = "pip install 'traceml-insight[otlp]'"


def _given(endpoint: str | None, environ: Mapping[str, str]) -> tuple[str, str] | None:
    """``(where it was given, the endpoint)``: the flag when given and not blank, else the
    first of :data:`ENDPOINT_VARIABLES` set (not blank) in ``environ``; None: no export."""
    sources = (("--otlp-endpoint", endpoint), *((n, environ.get(n)) for n in ENDPOINT_VARIABLES))
    for name, value in sources:
        if value and value.strip():
            return name, value.strip()
    return None


def requested(endpoint: str | None, environ: Mapping[str, str] = os.environ) -> str | None:
    """Where the export goes: ``endpoint`` (the flag) when given and not blank, else the
    first of :data:`ENDPOINT_VARIABLES` set (not blank) in ``environ``; None: no export."""
    given = _given(endpoint, environ)
    return given[1] if given else None


def check(endpoint: str | None, environ: Mapping[str, str] = os.environ) -> None:
    """Refuse an endpoint the export would misread: it must be ``http://HOST:PORT`` (plain
    text) or ``https://HOST:PORT`` (TLS). The OTLP/gRPC exporter takes a bare ``HOST:PORT``
    as TLS, so a plain collector given that way fails at every push, silently for training.

    Raises:
        ValueError: one line naming the flag or variable and the value given.
    """
    given = _given(endpoint, environ)
    if given is None:
        return
    name, url = given
    parts = urllib.parse.urlsplit(url)
    try:
        port = parts.port
    except ValueError:  # not a number, or out of range
        port = None
    if parts.scheme not in ("http", "https") or not parts.hostname or port is None:
        raise ValueError(
            f"{name} must be http://HOST:PORT (plain text) or https://HOST:PORT (TLS) (got {url!r})"
        )


def missing() -> str:
    """ "" when the export's :data:`MODULES` can be imported, else the one line saying that it
    is off and how to turn it on (never raises)."""
    for name in MODULES:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):  # a parent package is absent, or not a package
            found = False
        if not found:
            return (
                f"OTLP export off: {name} is not installed ({INSTALL}); training goes on without it"
            )
    return ""
