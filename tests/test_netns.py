"""Two real network hosts: two network namespaces joined by a veth pair, one launcher in each.

Host 0 (``10.231.0.1``, plus ``10.231.1.1`` on a second link for telemetry in the second case)
runs node 0 and its aggregator; host 1 (``10.231.0.2``) runs node 1 (tests/helpers/netns.py). Each
host has its own loopback, ports and
``--logs-dir`` (no shared filesystem), so node 1 can reach the aggregator only across the link,
and both are given the run token (``TRACEML_RUN_TOKEN``); the last case shares one
``--logs-dir`` instead, where node 1, started first, finds node 0's token file.
Needs root and ``ip`` (iproute2); skipped otherwise. Names start with ``tmlt<pid>`` so they
never collide with the Slurm lab's ``slab-*`` namespaces or with a parallel test run.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from conftest import SCRIPTS, load_summary, start_traceml, wait_all, wait_for
from helpers.netns import node_args, two_hosts

pytestmark = [pytest.mark.slow, pytest.mark.torchrun, pytest.mark.netns]

SCRIPT = str(SCRIPTS / "faulty_ddp.py")
STEPS = 6
HOST0, HOST1 = "10.231.0.1", "10.231.0.2"
HOST0_TELEMETRY, HOST1_TELEMETRY = "10.231.1.1", "10.231.1.2"


@pytest.fixture
def hosts():
    """Two namespaces joined by a training link and a telemetry link; removed (with anything
    still running in them) after."""
    with two_hosts("tmlt", (HOST0, HOST1), (HOST0_TELEMETRY, HOST1_TELEMETRY)) as two:
        yield two


def run_nodes(
    hosts,
    tmp_path,
    node_flags: dict[int, list[str]],
    nproc: int,
    shared_logs: bool = False,
    node0_late: bool = False,
    script: tuple[str, ...] = (SCRIPT, "--steps", str(STEPS)),
    node_env: dict[int, dict[str, str]] | None = None,
) -> dict[int, int]:
    """Start node 1 then node 0 (once node 1 waits for node 0's aggregator if ``node0_late``),
    each in its host with its own logs dir and the run token given to both, or with one shared
    logs dir and no token given, running ``script`` (the script and its arguments) with
    ``node_env[node]`` added to the node's environment; their exit codes."""
    procs = {}
    for node in (1, 0):
        logs = tmp_path / ("shared" if shared_logs else f"host{node}")
        args = node_args(
            node,
            script[0],
            "netns",
            *node_flags[node],
            *script[1:],
            nproc=nproc,
            master_addr=HOST0,
            logs_dir=logs,
        )
        env = {"GLOO_SOCKET_IFNAME": hosts.links["train"][node], **(node_env or {}).get(node, {})}
        if not shared_logs:
            env["TRACEML_RUN_TOKEN"] = "netns-token-given-to-both"
        if node == 0 and node0_late:
            wait_for(
                lambda: "for node 0's aggregator" in (tmp_path / "node1.err").read_text(),
                120,
                "node 1 to wait for node 0's aggregator",
            )
        procs[node] = start_traceml(
            args, tmp_path, tmp_path / f"node{node}", prefix=hosts.prefix(node), env=env
        )
    return wait_all(procs, 300)


def check_run(tmp_path, nproc: int) -> dict:
    """The common assertions; returns node 0's manifest."""
    summary = load_summary(tmp_path / "host0" / "netns")
    world = 2 * nproc
    assert summary["run"]["world_size"] == world
    assert summary["run"]["complete"] is True
    assert summary["run"]["nodes"] == [0, 1]
    ranks = {r["rank"]: r for r in summary["ranks"]}
    assert {r: v["node_rank"] for r, v in ranks.items()} == {r: r // nproc for r in range(world)}
    assert {r: v["steps_completed"] for r, v in ranks.items()} == dict.fromkeys(range(world), STEPS)
    assert {r: v["end"]["state"] for r, v in ranks.items()} == dict.fromkeys(
        range(world), "completed"
    )
    assert {n["node_rank"]: n["exit_code"] for n in summary["nodes"]} == {0: 0, 1: 0}
    # Host 1 holds only node 1's own files: no aggregator, no manifest, no summary.
    host1 = tmp_path / "host1" / "netns"
    assert sorted(p.relative_to(host1).as_posix() for p in host1.rglob("*")) == [
        "nodes",
        "nodes/node_1",
        "nodes/node_1/manifest.json",
        "nodes/node_1/rank_ends.json",  # torchrun_main's: it started its ranks
        "nodes/node_1/training.stderr.log",
        "nodes/node_1/training.stdout.log",
    ]
    out = (host1 / "nodes" / "node_1" / "training.stdout.log").read_text()
    for rank in range(nproc, world):
        assert f"faulty_ddp: rank {rank} trained {STEPS} steps" in out
    return json.loads((tmp_path / "host0" / "netns" / "manifest.json").read_text())


def test_default_ports_aggregator_bound_to_all_interfaces(hosts, tmp_path):
    """The seed's defaults (master port 29500, aggregator 29765: private to each namespace):
    node 0's aggregator binds 0.0.0.0 and node 1 reaches it through --aggregator-host. One
    rank a node, as the other tests here: the ports are the claim, and every rank is a torch
    start-up (two ranks a node across namespaces: tests/test_live_cli.py's node 0 view)."""
    flags = [f"--aggregator-host={HOST0}"]
    codes = run_nodes(hosts, tmp_path, {0: flags, 1: flags}, nproc=1)
    assert codes == {0: 0, 1: 0}, (tmp_path / "node0.err").read_text()
    manifest = check_run(tmp_path, nproc=1)
    launch = manifest["launch"]
    assert (launch["aggregator_bind_host"], launch["aggregator_port"]) == ("0.0.0.0", 29765)
    assert launch["master_port"] == 29500
    node1_err = (tmp_path / "node1.err").read_text()
    assert f"node 0's aggregator at {HOST0}:29765" in node1_err


def test_non_default_port_and_telemetry_address(hosts, tmp_path):
    """--aggregator-port other than 29765, and telemetry on another address of host 0 than
    the rendezvous: the aggregator listens only there, so node 1 must use --aggregator-host."""
    port = "31877"
    flags = [f"--aggregator-host={HOST0_TELEMETRY}", f"--aggregator-port={port}"]
    node0 = flags + [f"--aggregator-bind-host={HOST0_TELEMETRY}"]
    codes = run_nodes(hosts, tmp_path, {0: node0, 1: flags}, nproc=1)
    assert codes == {0: 0, 1: 0}, (tmp_path / "node0.err").read_text()
    manifest = check_run(tmp_path, nproc=1)
    launch = manifest["launch"]
    assert (launch["aggregator_bind_host"], launch["aggregator_port"]) == (HOST0_TELEMETRY, 31877)
    assert (
        f"node 0's aggregator at {HOST0_TELEMETRY}:{port}" in (tmp_path / "node1.err").read_text()
    )


def test_shared_logs_dir_carries_the_token_to_a_node_started_first(hosts, tmp_path):
    """No token given: node 0 makes one and writes it 0600 to the shared run directory;
    node 1, started before node 0 (which starts once node 1 waits), waits for the aggregator
    and then reads it there."""
    flags = [f"--aggregator-host={HOST0}"]
    codes = run_nodes(
        hosts, tmp_path, {0: flags, 1: flags}, nproc=1, shared_logs=True, node0_late=True
    )
    assert codes == {0: 0, 1: 0}, (tmp_path / "node1.err").read_text()
    run_dir = tmp_path / "shared" / "netns"
    summary = load_summary(run_dir)
    ranks = {r["rank"]: r for r in summary["ranks"]}
    assert summary["run"]["complete"] is True and summary["run"]["nodes"] == [0, 1]
    assert {r: v["node_rank"] for r, v in ranks.items()} == {0: 0, 1: 1}
    assert {r: v["steps_completed"] for r, v in ranks.items()} == {0: STEPS, 1: STEPS}
    assert {r: v["records_received"] for r, v in ranks.items()} == {0: STEPS, 1: STEPS}
    assert {n["node_rank"]: n["exit_code"] for n in summary["nodes"]} == {0: 0, 1: 0}
    assert summary["run"]["rejected"] == {}
    token_file = run_dir / "run_token"
    assert oct(token_file.stat().st_mode & 0o777) == "0o600"
    assert len(token_file.read_text()) == 43
    node1_err = (tmp_path / "node1.err").read_text()
    assert "waiting up to 300 s for node 0's aggregator" in node1_err
    assert "could not report" not in node1_err and "warning" not in node1_err


#: Node 1's clock reads this much ahead of node 0's (TRACEML_TEST_CLOCK_OFFSET_MS on its
#: launcher and ranks), ms; and rank 2's planted delay per forward, ms.
AHEAD_MS, LATE_MS = 5000, 50.0
PLANTED_STEPS = 30


# alone: the waits it checks are ±20 % of a 50 ms plant per rank (docs/testing.md, "Timing
# benchmarks and planted figures alone"); among the parallel tests' jobs, CI once saw rank 3's
# wait land in its backward (52 ms) with its comm 0 ms, a race in the DDP bucket's completion
# since fixed (tests/test_collectives.py).
@pytest.mark.alone
def test_a_late_rank_on_a_node_whose_clock_is_off(hosts, tmp_path):
    """Four DDP ranks on two hosts; node 1's clock is 5 s ahead and its rank 2 computes 50 ms
    more per forward (tests/scripts/planted_ddp.py). Node 1's launcher measures its offset
    over its session; node 0 reads the arrivals at the gradient all-reduce on its own clock and
    names rank 2 as arriving last by its planted delay (within ±20 %), the others' time as
    waiting, not compute. Read as sent (no offset), node 1's ranks would arrive 5 s late."""
    script = (
        str(SCRIPTS / "planted_ddp.py"),
        "--",
        "--scenario=compute_straggler",
        "--slow-rank=2",
        f"--delay-ms={LATE_MS}",
        f"--steps={PLANTED_STEPS}",
    )
    flags = [f"--aggregator-host={HOST0}"]
    codes = run_nodes(
        hosts,
        tmp_path,
        {0: flags, 1: flags},
        nproc=2,
        script=script,
        node_env={1: {"TRACEML_TEST_CLOCK_OFFSET_MS": str(AHEAD_MS)}},
    )
    assert codes == {0: 0, 1: 0}, (tmp_path / "node0.err").read_text()
    run_dir = tmp_path / "host0" / "netns"
    summary = load_summary(run_dir)
    assert summary["run"]["complete"] is True and summary["run"]["world_size"] == 4
    skew = summary["analysis"]["skew"]
    # the offset, node 0's clock minus node 1's, within its stated bound (one host's clock)
    assert abs(skew["clock_offsets_ms"]["1"] + AHEAD_MS) <= skew["clock_error_ms"] < 5.0
    assert abs(skew["clock_offsets_ms"]["0"]) <= skew["clock_error_ms"]
    assert (skew["collectives"], skew["mismatched"]) == (PLANTED_STEPS - 5, 0)
    (late,) = [f for f in summary["findings"]["step_time"] if f["kind"] == "LATE_ARRIVAL"]
    assert late["ranks"] == [2] and late["evidence"]["last_pct"] >= 90.0
    assert 0.8 * LATE_MS <= late["evidence"]["late_ms"] <= 1.2 * LATE_MS
    # the others wait for rank 2 in the all-reduce: communication, not compute
    wait, ranks = summary["analysis"]["comm"]["wait_ms"], summary["ranks"]
    for r in (0, 1, 3):
        assert 0.8 * LATE_MS <= wait[str(r)] <= 1.2 * LATE_MS
        assert (
            abs(ranks[r]["phase_median_ms"]["backward"] - ranks[2]["phase_median_ms"]["backward"])
            < LATE_MS / 2
        )
    assert summary["primary_diagnosis"]["kind"] == "COMPUTE_STRAGGLER"
    assert summary["primary_diagnosis"]["ranks"] == [2]
    # read as sent, node 1's ranks arrive 5 s late: the offset did the work
    from traceml.analysis.summary import build_summary
    from traceml_aggregator.load import load
    from traceml_aggregator.store import Store

    store = Store(run_dir / "telemetry.sqlite", read_only=True)
    try:
        run = load(store, [])
    finally:
        store.close()
    assert [c.node_rank for c in run.node_clocks] == [0, 1]
    run.node_clocks = [replace(c, offset_us=0) for c in run.node_clocks]
    as_sent = build_summary(run)["analysis"]["skew"]
    assert as_sent["late_ms"]["2"] >= AHEAD_MS - LATE_MS
