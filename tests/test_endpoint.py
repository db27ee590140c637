"""The aggregator's endpoint (traceml/core/endpoint.py): the one place for host:port (its
ports and their validation are knobs: tests/test_knobs.py)."""

from __future__ import annotations

import pytest

from traceml import settings
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
    assert endpoint.target(host, settings.AGGREGATOR_PORT.value) == expected


@pytest.mark.parametrize(
    "bind, expected",
    [
        ("0.0.0.0", "127.0.0.1:7"),
        ("::", "127.0.0.1:7"),
        ("", "127.0.0.1:7"),
        ("10.1.2.3", "10.1.2.3:7"),
        ("::1", "[::1]:7"),
    ],
)
def test_local_target_reaches_an_any_address_bind_locally(bind, expected):
    assert endpoint.local_target(bind, 7) == expected


def test_the_launcher_targets_come_from_the_endpoint():
    config = LaunchConfig(script="x.py", master_addr="::1", aggregator_bind_host="::")
    assert config.aggregator_port == settings.AGGREGATOR_PORT.value == 29765
    assert config.aggregator_target == "[::1]:29765"
    assert config.launcher_target == "127.0.0.1:29765"
