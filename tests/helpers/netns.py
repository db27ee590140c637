"""Two "hosts" on one machine: network namespaces joined by two veth pairs.

One pair carries training (torch's rendezvous and gloo), the other the telemetry, so a test
can cut the telemetry link alone (``ip link set ... down``) while training goes on
(tests/test_telemetry_loss.py, tests/test_node_session.py), or serve telemetry on another
address of host 0 than the rendezvous (tests/test_netns.py). Needs root and ``ip`` (iproute2):
skipped otherwise. Names carry the test process's pid, so parallel workers never collide.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest


def ip(*args: str) -> None:
    """Run ``ip ARGS``; raises CalledProcessError (with its stderr) when it fails."""
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def node_args(
    node: int, script: str, name: str, *more: str, nproc: int, master_addr: str, logs_dir: Path
) -> list[str]:
    """The arguments of ``traceml run`` (for :func:`helpers.jobs.start_traceml`) of node
    ``node`` of a run of 2 nodes: ``script`` on ``nproc`` ranks, the rendezvous at node 0's
    ``master_addr``, run ``name``, its run directory under ``logs_dir`` (the host's own); then
    ``more``: more launcher flags, and the script's own arguments."""
    return [
        "run",
        script,
        "--nnodes=2",
        f"--nproc-per-node={nproc}",
        f"--node-rank={node}",
        f"--master-addr={master_addr}",
        f"--run-name={name}",
        f"--logs-dir={logs_dir}",
        *more,
    ]


@dataclass(frozen=True)
class TwoHosts:
    """Namespaces ``netns[0]``/``netns[1]``; ``links["train"]`` and ``links["tel"]`` are each
    link's interface names in namespace 0 and 1."""

    netns: tuple[str, str]
    links: dict[str, tuple[str, str]]

    def prefix(self, node: int) -> list[str]:
        """The command words that run a command on host ``node`` (``ip netns exec NS``)."""
        return ["ip", "netns", "exec", self.netns[node]]

    def set_link(self, link: str, node: int, state: str) -> None:
        """``ip link set`` one end of ``link`` (``train``/``tel``) ``up`` or ``down``."""
        ip("-n", self.netns[node], "link", "set", self.links[link][node], state)


@contextlib.contextmanager
def two_hosts(
    prefix: str, train: tuple[str, str], telemetry: tuple[str, str]
) -> Iterator[TwoHosts]:
    """Create the two namespaces (``<prefix><pid>-0/1``) and both links with the given IPv4
    addresses (/24) of node 0 and node 1; remove them after, SIGKILLing anything still
    running in them. Skips the test without root or ``ip``."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and `ip` (iproute2) to create network namespaces")
    tag = f"{prefix}{os.getpid()}"
    hosts = TwoHosts(
        netns=(f"{tag}-0", f"{tag}-1"),
        links={"train": (f"{tag}t0", f"{tag}t1"), "tel": (f"{tag}m0", f"{tag}m1")},
    )
    created = []
    try:
        for ns in hosts.netns:
            try:
                ip("netns", "add", ns)
            except subprocess.CalledProcessError as exc:
                pytest.skip(f"cannot create a network namespace: {exc.stderr.strip()}")
            created.append(ns)
            ip("-n", ns, "link", "set", "lo", "up")
        for link, addrs in (("train", train), ("tel", telemetry)):
            ends = hosts.links[link]
            ip("link", "add", ends[0], "type", "veth", "peer", "name", ends[1])
            for ns, ifname, addr in zip(hosts.netns, ends, addrs, strict=True):
                ip("link", "set", ifname, "netns", ns)
                ip("-n", ns, "addr", "add", f"{addr}/24", "dev", ifname)
                ip("-n", ns, "link", "set", ifname, "up")
        yield hosts
    finally:
        for ns in created:
            pids = subprocess.run(
                ["ip", "netns", "pids", ns], capture_output=True, text=True
            ).stdout.split()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
