"""The aggregator's endpoint (traceml/core/endpoint.py): the one place for host:port, the
default port and the validation both commands use."""

from __future__ import annotations

import math

import pytest

from traceml.core import endpoint
from traceml.launcher.config import LaunchConfig


@pytest.mark.parametrize(
    "host, expected",
    [
        ("127.0.0.1", "127.0.0.1:29765"),
        ("node-0.cluster", "node-0.cluster:29765"),
        ("::1", "[::1]:29765"),
        ("fe80::1%eth0", "[fe80::1%eth0]:29765"),
        ("[::1]", "[::1]:29765"),  # already bracketed: not twice
    ],
)
def test_target_brackets_ipv6_literals_only(host, expected):
    assert endpoint.target(host, endpoint.DEFAULT_PORT) == expected


@pytest.mark.parametrize(
    "bind, expected",
    [("0.0.0.0", "127.0.0.1:7"), ("::", "127.0.0.1:7"), ("", "127.0.0.1:7"),
     ("10.1.2.3", "10.1.2.3:7"), ("::1", "[::1]:7")],
)
def test_local_target_reaches_an_any_address_bind_locally(bind, expected):
    assert endpoint.local_target(bind, 7) == expected


def test_the_launcher_targets_come_from_the_endpoint():
    config = LaunchConfig(script="x.py", master_addr="::1", aggregator_bind_host="::")
    assert config.aggregator_port == endpoint.DEFAULT_PORT == 29765
    assert config.aggregator_target == "[::1]:29765"
    assert config.launcher_target == "127.0.0.1:29765"


@pytest.mark.parametrize(
    "port, expected",
    [(None, ""), (1, ""), (65535, ""), (0, "--port 0 is not a TCP port (1-65535)"),
     (65536, "--port 65536 is not a TCP port (1-65535)"),
     (-5, "--port -5 is not a TCP port (1-65535)")],
)
def test_port_error(port, expected):
    assert endpoint.port_error("--port", port) == expected


@pytest.mark.parametrize("value", [0.0, -1.0, math.nan, math.inf])
def test_seconds_error_refuses_what_is_not_a_finite_positive_duration(value):
    assert endpoint.seconds_error("--x", value) == f"--x must be a finite number > 0 (got {value})"


def test_seconds_error_takes_a_positive_duration():
    assert endpoint.seconds_error("--x", 0.001) == ""
