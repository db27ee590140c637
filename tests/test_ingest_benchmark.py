"""The ingest benchmark's CI run (``benchmarks/ingest.py --short``): the three wires (the rank's
stream, unary ``Push``, and the node relay's ``Relay`` call: 8 ranks as one simulated node),
both pacings, each against the aggregator (every record checked in the store by the benchmark
itself) and against gRPC alone (``benchmarks/transport_floor.py``). It must finish; the targets
are for the full run (docs/scale.md), not for this one. No figure is asserted, so neither test
is ``serial``: the first is mostly waiting (55 s of wall time, 12 s of CPU, alone on the
development machine; 38 s and 9 s before the relay wire), which the parallel stage overlaps."""

from __future__ import annotations

import re

import pytest
from helpers.benchmarks import run_benchmark


@pytest.mark.aggregator
@pytest.mark.slow
def test_the_short_ingest_benchmark_runs_the_three_wires_and_the_transport_floor_side_by_side():
    result = run_benchmark("ingest.py", "--short", timeout_s=300)
    runs = re.findall(
        r"^\s+(stream|unary|relay)\s+8 ranks, a batch every ([\d.]+) s, 0 viewers"
        r"(, gRPC transport alone)?:",
        result.stdout,
        re.MULTILINE,
    )
    alone = ", gRPC transport alone"
    assert runs == [
        (wire, pace, server)
        for pace in ("0", "0.2")
        for wire in ("stream", "unary", "relay")
        for server in ("", alone)
    ]
    # 8 ranks x 3 batches x 10 records each time, every one found in the aggregator's store;
    # on the relay also its node sampler's 2 system samples at each of 4 seqs (the identity's
    # message's and the 3 batches').
    assert result.stdout.count("240 records in") == 12
    assert result.stdout.count("(and 8 system samples)") == 4
    assert result.stdout.count("1 node, one Relay call each") == 4
    assert result.stdout.count("the aggregator against gRPC alone") == 6
    assert result.stdout.count("stream against unary, 8 ranks") == 2
    assert result.stdout.count("relay against stream, 8 ranks") == 2


@pytest.mark.slow
def test_the_short_ingest_benchmark_compares_8_scrapers_with_none_side_by_side():
    result = run_benchmark(
        "ingest.py", "--short", "--wire", "stream", "--scrapers", "0", "8", timeout_s=300
    )
    runs = re.findall(
        r"^\s+stream\s+8 ranks, a batch every ([\d.]+) s, 0 viewers(, 8 scrapers[^:]*)?"
        r"(, gRPC transport alone)?:",
        result.stdout,
        re.MULTILINE,
    )
    assert [(pace, bool(scrapers), bool(alone)) for pace, scrapers, alone in runs] == [
        (pace, scrapers, alone)
        for pace in ("0", "0.2")
        for scrapers, alone in ((False, False), (True, False), (False, True))
    ]
    assert result.stdout.count("240 records in") == 6  # every record in the store, each time
    compared = re.findall(
        r"stream, 0 viewers and 8 scrapers against 0 and 0 \(medians of 1\): ack p99 "
        r"[\d.]+ against [\d.]+ ms, ingest rate x[\d.]+, ack p99 x[\d.]+; .* "
        r"\(target: ack p99 within 10 %\)$",
        result.stdout,
        re.MULTILINE,
    )
    assert len(compared) == 2, result.stdout


@pytest.mark.aggregator
@pytest.mark.slow
def test_the_ingest_benchmark_holds_each_nodes_session_with_its_heartbeats_on_either_wire():
    result = run_benchmark(
        "ingest.py",
        *("--ranks", "16", "--records", "2", "--batches", "3", "--interval-sec", "1"),
        *("--wire", "relay", "stream", "--sessions", "--no-summary"),
        timeout_s=300,
    )
    beats = re.findall(
        r"^\s+(relay|stream)\s+16 ranks, a batch every 1 s, 0 viewers.*?"
        r"(\d+) heartbeats on 2 node sessions(?:, (\d+) carried by the relays)?",
        result.stdout,
        re.MULTILINE,
    )
    # each node's claim and first heartbeat answered before the clock (the benchmark asserts
    # it); then through the relay each of a node's 3 RelayUps carried its heartbeat, answered,
    # and its session said nothing more; straight, a heartbeat at the start and one every 2 s
    # while its ranks streamed 3 batches a second apart, each answered on the session
    assert [wire for wire, _, _ in beats] == ["relay", "stream"], result.stdout
    (_, relay_session, carried), (_, stream_session, none) = beats
    assert (int(relay_session), int(carried), none) == (0, 6, "")
    assert 2 <= int(stream_session) <= 6, beats
    assert result.stdout.count("96 records in") == 2


@pytest.mark.aggregator
@pytest.mark.slow
def test_the_ingest_benchmarks_senders_flush_at_node_0s_pace_with_the_same_steps_a_second():
    """With node 0's budget at one message a second, the 2 simulated nodes' Relay calls are too
    many at a batch a second: node 0's Acks ask for a flush every 2 s in both runs (the
    benchmark fails when they ask for another pace than the one it simulates), and with
    ``--pace on`` the nodes flush so, each batch of 4 records instead of 2, half as many."""
    result = run_benchmark(
        "ingest.py",
        *("--ranks", "16", "--records", "2", "--batches", "4", "--interval-sec", "1"),
        *("--wire", "relay", "--pace", "off", "on", "--no-summary"),
        timeout_s=300,
        env={"TRACEML_AGGREGATOR_MESSAGES_PER_SEC": "1"},
    )
    runs = re.findall(
        r"^\s+relay\s+16 ranks, a batch every ([\d.]+) s, 0 viewers: .*?; (\d+) records in "
        r".*; node 0's Acks asked for (a flush every [\d.]+ s|no pace)$",
        result.stdout,
        re.MULTILINE,
    )
    assert runs == [("1", "128", "a flush every 2 s"), ("2", "128", "a flush every 2 s")]
    assert "(and 20 system samples)" in result.stdout  # 2 a batch, 5 batches a node
    assert "(and 12 system samples)" in result.stdout  # 2 a batch (a second each), 3 a node
    assert "relay, 16 ranks, at node 0's pace against a batch every 1 s:" in result.stdout
