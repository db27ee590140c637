"""Retention (traceml_aggregator/retention.py): a run longer than the raw window gives the same
summary as the same run with ``--keep-all-steps``: the same verdict, per-rank figures, onsets
and spike steps, sample figures; any difference is a failure. Real ``traceml-aggregator``
processes over real gRPC and SQLite, simulated ranks with a planted straggler (from an onset
on), spikes, process, system and GPU samples (more sample times than a series holds), and an
aggregator SIGKILL once the store was pruned (and one mid sample prune); small windows through
the ``TRACEML_STORE_*`` knobs.
"""

from __future__ import annotations

import asyncio
import json
import time

import numpy as np
import pytest
from helpers.aggregator import LiveAggregator, finish, query
from restart import build_store, finalize_only  # benchmarks/ (on the path)

from traceml import wire
from traceml.core.records import SAMPLES
from traceml.core.transport import open_channel
from traceml.wire.records import add_steps
from traceml_aggregator.aggregates import keep_mask, series_steps
from traceml_aggregator.checkpoint import read as read_checkpoint
from traceml_aggregator.dashboard.sources import StoredSource
from traceml_aggregator.retention import (
    ONSET_NEIGHBOURHOOD_STEPS,
    PRUNED_META_KEY,
    Policy,
    most_rows_kept,
    most_sample_times_kept,
    sample_meta_keys,
)
from traceml_aggregator.store import Store

pytestmark = [pytest.mark.slow, pytest.mark.aggregator]

RUN = "retain"
WORLD = 4
STEPS = 20_000
PER_BATCH = 100
#: The straggler: from ONSET on, its input wait grows by SLOW_US a step.
STRAGGLER, ONSET, SLOW_US = 2, 9_000, 12_000
#: Every SPIKE_EVERY steps, every rank's step holds SPIKE_US more outside every phase
#: (a checkpoint save inside the step: a residual spike).
SPIKE_EVERY, SPIKE_US = 50, 200_000
#: The raw window: small, so the run is 50x longer than it; evidence capped above the
#: planted spikes and onset.
FIRST, LAST, SAMPLE_EVERY, EVIDENCE = 200, 200, 64, 600
#: Sample times of each group kept from its start and at its end.
FIRST_SAMPLES, LAST_SAMPLES = 50, 50
RETENTION_ENV = {
    "TRACEML_STORE_FIRST_STEPS": str(FIRST),
    "TRACEML_STORE_LAST_STEPS": str(LAST),
    "TRACEML_STORE_SAMPLE_EVERY": str(SAMPLE_EVERY),
    "TRACEML_STORE_EVIDENCE_STEPS": str(EVIDENCE),
    "TRACEML_STORE_FIRST_SAMPLES": str(FIRST_SAMPLES),
    "TRACEML_STORE_LAST_SAMPLES": str(LAST_SAMPLES),
    "TRACEML_AGGREGATOR_CHECKPOINT_SEC": "0.2",
}
#: Sample times a batch of steps brings, of each rank (its process samples) and of node 0
#: (its system samples, each with GPUS GPU rows): STEPS / PER_BATCH x 20 = 4,000 a group,
#: far more than a series holds (SERIES_TICKS).
SAMPLES_PER_BATCH, GPUS = 20, 2
SAMPLE_TIMES = STEPS // PER_BATCH * SAMPLES_PER_BATCH
#: The first sample time (the ranks' start) and the time between two (a batch's steps last
#: PER_BATCH x 60 ms: the samples span the run, as a sampler's do).
T0_US, SAMPLE_US = 1_700_000_000_000_000, PER_BATCH * 60_000 // SAMPLES_PER_BATCH
#: The SIGKILL comes after this many steps of every rank (once the store was pruned).
KILL_AT = 12_000


def _row(rank: int, i: int) -> dict[str, int]:
    jitter = (rank * 7 + i * 13) % 400  # µs, deterministic
    slow = SLOW_US if rank == STRAGGLER and i >= ONSET else 0
    spike = SPIKE_US if i % SPIKE_EVERY == SPIKE_EVERY - 1 else 0
    step_us = 25_000 + jitter + slow + spike
    return {
        "step": i,
        "end_us": (i + 1) * 60_000,
        "step_us": step_us,
        "input_wait_us": 1_000 + slow,
        "forward_us": 6_000 + jitter,
        "backward_us": 14_000,
        "optimizer_us": 2_000,
    }


def _sample_times(seq: int) -> range:
    """The sample times (indices) batch ``seq`` brings."""
    return range((seq - 1) * SAMPLES_PER_BATCH, seq * SAMPLES_PER_BATCH)


def _node_batch(seq: int) -> wire.Batch:
    """Node 0's sampler batch ``seq``: its system samples, each with its GPUs."""
    batch = wire.Batch(run_name=RUN, node_rank=0, seq=seq)
    for j in _sample_times(seq):
        wiggle = (j * 37) % 101  # deterministic, so a figure depends on which samples
        s = batch.system_samples.add(
            node_rank=0,
            unix_us=T0_US + j * SAMPLE_US,
            hostname="node0",
            cpu_percent=20.0 + wiggle / 10,
            ram_used_bytes=(100 << 30) + wiggle * (1 << 20),
            ram_total_bytes=1 << 40,
        )
        for g in range(GPUS):
            s.gpus.add(
                nvml_index=g,
                uuid=f"GPU-{g}",
                util_percent=80.0 + (wiggle + g) % 20,
                memory_used_bytes=(40 << 30) + wiggle * (1 << 20),
                memory_total_bytes=80 << 30,
            )
    return batch


def _push(target: str, first: int, last: int) -> None:
    """Steps ``first .. last - 1`` of every rank, PER_BATCH a batch, each acknowledged, with
    their process samples, and node 0's system and GPU samples of the same times."""
    with open_channel(target) as channel:
        stub = wire.AggregatorStub(channel)
        for start in range(first, last, PER_BATCH):
            seq = start // PER_BATCH + 1
            ack = stub.Push(_node_batch(seq), timeout=60.0)
            assert ack.stored_seq == seq and not ack.rejected, ack
            for rank in range(WORLD):
                batch = wire.Batch(run_name=RUN, rank=rank, seq=seq)
                if seq == 1:
                    batch.identity.CopyFrom(
                        wire.RankIdentity(
                            run_name=RUN,
                            rank=rank,
                            local_rank=rank,
                            world_size=WORLD,
                            hostname="node0",
                            start_unix_us=1_700_000_000_000_000,
                        )
                    )
                add_steps(batch, (_row(rank, i) for i in range(start, start + PER_BATCH)))
                for j in _sample_times(seq):
                    wiggle = (rank * 11 + j * 37) % 101
                    batch.process_samples.add(
                        unix_us=T0_US + j * SAMPLE_US + rank,
                        cpu_percent=100.0 + wiggle,
                        rss_bytes=(2 << 30) + wiggle * (1 << 20),
                        gpu_allocated_bytes=(30 << 30) + wiggle * (1 << 20),
                        gpu_reserved_bytes=32 << 30,
                    )
                if start + PER_BATCH >= STEPS:
                    batch.finish.CopyFrom(finish(STEPS))
                ack = stub.Push(batch, timeout=60.0)
                assert ack.stored_seq == seq and not ack.rejected, ack


def _summary(run_dir) -> dict:
    doc = json.loads((run_dir / "final_summary.json").read_text())
    doc.pop("generated_unix_s", None)
    return doc


def _run(run_dir, extra_args: tuple[str, ...]) -> LiveAggregator:
    """The planted run on a real aggregator: the first KILL_AT steps, a SIGKILL once a
    checkpoint committed (and, with retention, once the store was pruned), a restart on the
    same store, the rest of the steps, a clean stop (which writes the summary)."""
    run_dir.parent.mkdir(parents=True)
    agg = LiveAggregator(run_dir, RUN, world_size=WORLD, extra_args=extra_args, env=RETENTION_ENV)
    with agg:
        _push(agg.target, 0, KILL_AT)
        # pruned (logged once the deletes and the prune's mark committed), or checkpointed
        wanted = "retention: pruned" if not extra_args else "live aggregates checkpointed"
        deadline = time.monotonic() + 60
        while wanted not in agg.log():
            assert time.monotonic() < deadline, agg.log()
            time.sleep(0.05)
        assert agg.kill() == -9
        agg.start()  # from the checkpoint
        _push(agg.target, KILL_AT, STEPS)
        while agg.log().count(wanted) < 2:  # the restarted aggregator's own first one
            assert time.monotonic() < deadline + 60, agg.log()
            time.sleep(0.05)
        assert agg.stop(timeout_s=120) == 0
    assert "cannot seed" not in agg.log() and "retention: cannot" not in agg.log()
    return agg


def _sample_rows(run_dir) -> dict[str, dict[tuple, list[int]]]:
    """Each sample table's rows: group -> the ``unix_us`` of its rows, in rowid order."""
    out: dict[str, dict[tuple, list[int]]] = {}
    for record in SAMPLES:
        groups = out[record.TABLE] = {}
        sql = f"SELECT {', '.join(record.GROUP)}, unix_us FROM {record.TABLE} ORDER BY rowid"
        for *key, unix_us in query(run_dir, sql):
            groups.setdefault(tuple(key), []).append(unix_us)
    return out


def _assert_samples_kept(run_dir, every: dict, extra_per_group: int = 0) -> None:
    """The pruned store of ``run_dir`` keeps, of each sample group of ``every`` (the whole
    store's :func:`_sample_rows`), whole sample times (every GPU row of one), at most the
    policy's bound of them (plus ``extra_per_group``: the held rows of an aggregator killed,
    and the table's highest row) and at least its first and last times and every time its
    final series holds (the checkpoint's)."""
    policy = Policy(first_samples=FIRST_SAMPLES, last_samples=LAST_SAMPLES)
    store = Store(run_dir / "telemetry.sqlite", read_only=True)
    try:
        series = read_checkpoint(store).series
    finally:
        store.close()
    kept_rows = _sample_rows(run_dir)
    for record in SAMPLES:
        key_name = sample_meta_keys(record.TABLE)[0]
        mark = query(run_dir, f"SELECT value FROM meta WHERE key = '{key_name}'")
        assert int(mark[0][0]) > 0, record.TABLE
        groups = kept_rows[record.TABLE]
        assert groups.keys() == every[record.TABLE].keys(), record.TABLE
        for key, kept in groups.items():
            times = sorted(set(every[record.TABLE][key]))
            per_time = len(every[record.TABLE][key]) // len(times)
            distinct = sorted(set(kept))
            assert len(kept) == len(distinct) * per_time, (record.TABLE, key)  # whole times
            bound = most_sample_times_kept(policy, len(times)) + extra_per_group + 1
            assert len(distinct) <= bound, (record.TABLE, key, len(distinct), bound)
            held = {int(t) for t in series[record.TABLE][key].columns["unix_us"]}
            ends = set(times[:FIRST_SAMPLES]) | set(times[-LAST_SAMPLES:])
            missing = sorted((held | ends) - set(distinct))
            assert not missing, (record.TABLE, key, missing[:10])


def _findings(doc: dict) -> list[dict]:
    """The primary diagnosis and every finding, in the document's order."""
    listed = [f for kind in doc["findings"].values() for f in kind]
    return [doc["primary_diagnosis"], *listed] if doc["primary_diagnosis"] else listed


def _spike_steps(doc: dict) -> list[tuple]:
    """(ranks, spike steps) of each STEP_SPIKES finding."""
    return [
        (tuple(f["ranks"]), list(f["evidence"]["steps"]))
        for f in _findings(doc)
        if f["kind"] == "STEP_SPIKES"
    ]


def _walk(node, key: str):
    """Every mapping under ``node`` whose ``key`` is set (a sample growth's onset is None)."""
    if isinstance(node, dict):
        if node.get(key) is not None:
            yield node
        for value in node.values():
            yield from _walk(value, key)
    elif isinstance(node, list):
        for value in node:
            yield from _walk(value, key)


def test_retention_gives_the_keep_all_steps_summary_on_a_run_longer_than_the_raw_window(
    tmp_path,
):
    kept_dir, all_dir = tmp_path / "kept" / RUN, tmp_path / "all" / RUN
    _run(kept_dir, ())
    _run(all_dir, ("--keep-all-steps",))
    kept, every = _summary(kept_dir), _summary(all_dir)

    # The planted run is found at all (so the comparison below cannot pass on two empty runs).
    assert every["primary_diagnosis"]["kind"] == "INPUT_STRAGGLER"
    assert every["primary_diagnosis"]["ranks"] == [STRAGGLER]
    assert {"STEP_SPIKES"} <= {f["kind"] for f in _findings(every)}
    onsets = [o["onset_step"] for o in _walk(every, "onset_step")]
    assert onsets and all(abs(o - ONSET) <= SAMPLE_EVERY for o in onsets), onsets
    spikes = _spike_steps(every)
    assert spikes and all(len(steps) >= 2 for _, steps in spikes), spikes

    # The same verdict, findings, onsets, spike steps and per-rank figures, then every field
    # of the document: the per-rank figures come from the same digests and series (the
    # checkpointed live aggregates), so they are equal, not only within the digest's error.
    assert kept["primary_diagnosis"] == every["primary_diagnosis"]
    assert kept["findings"] == every["findings"]
    assert [o["onset_step"] for o in _walk(kept, "onset_step")] == onsets
    assert _spike_steps(kept) == spikes
    assert kept["ranks"] == every["ranks"]
    for key in sorted(set(kept) | set(every)):
        assert kept.get(key) == every.get(key), key

    # ... while the retention store holds far fewer raw steps, and all the ones it promises.
    assert query(all_dir, "SELECT count(*) FROM steps") == [(WORLD * STEPS,)]
    rows = query(kept_dir, "SELECT rank, step FROM steps")
    # At most what the policy promises (docs/storage.md), well under the run.
    policy = Policy(FIRST, LAST, SAMPLE_EVERY, EVIDENCE)
    bound = most_rows_kept(policy, STEPS, series_steps(WORLD))
    assert bound < STEPS / 3
    pruned_upto = int(
        query(kept_dir, f"SELECT value FROM meta WHERE key = '{PRUNED_META_KEY}'")[0][0]
    )
    assert pruned_upto > 0
    for rank in range(WORLD):
        steps = {s for r, s in rows if r == rank}
        assert len(steps) == len([s for r, s in rows if r == rank])  # each once
        assert len(steps) <= bound, (rank, len(steps), bound)
        promised = set(range(FIRST)) | set(range(STEPS - LAST, STEPS))
        every_index = np.arange(STEPS, dtype=np.int64)
        promised |= set(every_index[keep_mask(every_index, SAMPLE_EVERY.bit_length() - 1)].tolist())
        promised |= {i for i in range(STEPS) if i % SPIKE_EVERY == SPIKE_EVERY - 1}  # spikes
        if rank == STRAGGLER:
            promised |= set(
                range(ONSET - ONSET_NEIGHBOURHOOD_STEPS, ONSET + ONSET_NEIGHBOURHOOD_STEPS)
            )
        missing = sorted(promised - steps)
        assert not missing, (rank, missing[:20])
        for ranks, spike_steps in spikes:  # the summary's evidence is there, raw
            if rank in ranks:
                assert set(spike_steps) <= steps, (rank, sorted(set(spike_steps) - steps))
        if rank == STRAGGLER:  # the step the summary names (a series step) is raw too
            assert set(onsets) <= steps

    # The sample tables: every row kept whole, and under retention each group's bounded set
    # (the killed aggregator's held rows, its groups' latest times then, stay for good).
    every_sample = _sample_rows(all_dir)
    assert {k: len(v) for k, v in every_sample["process_samples"].items()} == {
        (rank, 0): SAMPLE_TIMES for rank in range(WORLD)
    }
    assert {k: len(v) for k, v in every_sample["gpu_samples"].items()} == {
        (0,): SAMPLE_TIMES * GPUS
    }
    policy = Policy(first_samples=FIRST_SAMPLES, last_samples=LAST_SAMPLES)
    assert most_sample_times_kept(policy, SAMPLE_TIMES) < SAMPLE_TIMES / 2
    _assert_samples_kept(kept_dir, every_sample, extra_per_group=LAST_SAMPLES)
    # the samples are in the summaries compared
    assert all(r["process"]["samples"] > 0 for r in every["ranks"]), every["ranks"]
    assert every["nodes"][0]["system"]["samples"] > 0, every["nodes"]

    # `traceml view --serve` reads the pruned store: its summary is the file's, its charts
    # the kept rows.
    source = StoredSource(kept_dir)
    shown = asyncio.run(source.summary())
    shown.pop("generated_unix_s", None)
    assert shown == kept
    assert asyncio.run(source.snapshot(None, 0)).tables["run"]["run_name"] == RUN

    # A --finalize-only on the pruned store (from its checkpoint) writes the same summary.
    (kept_dir / "final_summary.json").unlink()
    finalize_only(kept_dir, RUN, WORLD)
    assert _summary(kept_dir) == every


def test_a_sigkill_mid_prune_loses_nothing_the_summary_needs(tmp_path):
    ranks, per_rank = 4, 150_000
    run_dir = tmp_path / RUN
    run_dir.mkdir()
    build_store(run_dir, RUN, ranks, per_rank)
    whole = LiveAggregator(run_dir, RUN, world_size=ranks, extra_args=("--keep-all-steps",))
    whole.start(timeout_s=600)  # a full replay, then a checkpoint and a summary at its stop
    assert whole.stop(timeout_s=300) == 0
    every = _summary(run_dir)
    total = ranks * per_rank
    assert query(run_dir, "SELECT count(*) FROM steps") == [(total,)]

    every_sample = _sample_rows(run_dir)
    processes = sum(len(v) for v in every_sample["process_samples"].values())

    agg = LiveAggregator(run_dir, RUN, world_size=ranks, env=RETENTION_ENV)
    with agg:  # the first prune takes the whole backlog, a round at a time: killed after one
        deadline = time.monotonic() + 120
        while "retention: backlog pruned up to rowid" not in agg.log():
            assert time.monotonic() < deadline, agg.log()
            time.sleep(0.01)
        assert agg.kill() == -9
        mark = query(run_dir, f"SELECT value FROM meta WHERE key = '{PRUNED_META_KEY}'")
        assert 0 < int(mark[0][0]) < total - 1  # the prune had begun, and not finished
        agg.start()  # from the checkpoint, on a partly pruned store
        # the sample tables' backlog next, one table after the other: killed once the
        # process samples are pruned (their held rows lost), before or while the others are
        while "process_samples rows up to rowid" not in agg.log():
            assert time.monotonic() < deadline + 120, agg.log()
            time.sleep(0.005)
        assert agg.kill() == -9
        (left,) = query(run_dir, "SELECT count(*) FROM process_samples")[0]
        assert left < processes, (left, processes)
        agg.start()  # on a store whose sample tables are partly pruned
        assert agg.stop(timeout_s=120) == 0  # its stop's prune finishes them
    assert "cannot seed" not in agg.log() and "retention: cannot" not in agg.log()
    assert _summary(run_dir) == every
    (kept,) = query(run_dir, "SELECT count(*) FROM steps")[0]
    assert kept < total // 10, kept
    _assert_samples_kept(run_dir, every_sample, extra_per_group=LAST_SAMPLES)
    # ... and so does a --finalize-only on the pruned store.
    (run_dir / "final_summary.json").unlink()
    finalize_only(run_dir, RUN, ranks)
    assert _summary(run_dir) == every
