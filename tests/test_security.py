"""Only the run's own processes can write to, read or steer a run (issue 11).

* During a real 2-rank ``traceml run``, a client without the run token (and one with a wrong
  token) calls every RPC of the service with plausible messages for the run: forged steps for
  rank 0, a node claim with a refusal, a node exit, Finalize, Summarize. Every call is refused
  ``UNAUTHENTICATED``; the run ends with exit 0, exact step counts and end states, and the
  summary holds none of the forged data but the count of what was refused. The same client
  with the right token but an invalid sender (rank = world size, and more) is refused too,
  and counted.
* TLS: a run end to end over TLS (a self-signed certificate made with openssl here), and a
  rank whose CA is not the aggregator's: refused by the handshake, training exits 0.
* The token file: mode 0600, written atomically, refused when other users can read it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import grpc
import psutil
import pytest
from conftest import (
    SCRIPTS,
    free_port,
    load_summary,
    make_cert,
    query,
    start_traceml,
    traceml_env,
)
from helpers.aggregator import aggregator_cmd
from helpers.batches import rank_batch
from live_aggregator import LiveAggregator

from traceml import wire
from traceml.core import transport
from traceml.core.transport import Credentials, open_channel
from traceml.launcher.aggregator import wait_serving
from traceml.wire.records import add_steps

SCRIPT = str(SCRIPTS / "faulty_ddp.py")
STEPS = 30
RUN = "guarded"


def forged_calls(run_name: str, world_size: int) -> list[tuple[str, object]]:
    """Every RPC of the service with a plausible message of run ``run_name``."""
    steps = rank_batch(
        10_000,
        range(10_000, 10_050),
        run_name=run_name,
        row=lambda i: {"step": i, "end_us": 10**9 + i - 10_000, "step_us": 777_000},
        identity=wire.RankIdentity(
            run_name=run_name, rank=0, world_size=world_size, pid=4242, hostname="forger"
        ),
    )
    return [
        ("Push", steps),
        (
            "NodeSession",
            wire.NodeUp(
                claim=wire.NodeClaim(
                    run_name=run_name,
                    node_rank=0,
                    nnodes=1,
                    hostname="forger",
                    launcher_pid=1,
                    refusal="forged: stop the run",
                )
            ),
        ),
        (
            "ReportNodeExit",
            wire.NodeExit(
                run_name=run_name,
                node_rank=0,
                hostname="forger",
                exit_code=9,
                ranks=[
                    wire.RankEnd(
                        rank=r,
                        local_rank=r,
                        end_state=wire.EndState.END_STATE_FAILED,
                        exit_code=9,
                        reason="forged",
                    )
                    for r in range(world_size)
                ],
            ),
        ),
        ("Finalize", wire.FinalizeRequest(run_name=run_name, timeout_s=1.0)),
        ("Summarize", wire.SummarizeRequest(run_name=run_name)),
    ]


#: The deadline of an accepted Summarize call, s: its answer waits for the live analysis
#: process, which runs at nice 19 and, on a saturated machine, starts late.
SUMMARIZE_DEADLINE_S = 180.0


def call(target: str, credentials: Credentials, method: str, request):
    """One call of ``method`` (NodeSession: a stream of ``request`` alone); its reply (a
    stream's: the list of its messages), or the grpc.RpcError it raised. A refusal comes at
    once; an accepted call has 10 s, Summarize :data:`SUMMARIZE_DEADLINE_S`."""
    timeout = SUMMARIZE_DEADLINE_S if method == "Summarize" else 10
    with open_channel(target, credentials=credentials) as channel:
        stub = wire.AggregatorStub(channel)
        try:
            if method == "NodeSession":
                return list(stub.NodeSession(iter([request]), timeout=timeout))
            return getattr(stub, method)(request, timeout=timeout)
        except grpc.RpcError as exc:
            return exc


def invalid_senders(run_name: str, world_size: int) -> list[tuple[str, wire.Batch]]:
    """Batches with the right token that no sender of this run can send: (kind, batch)."""

    def batch(**fields) -> wire.Batch:
        b = wire.Batch(run_name=run_name, seq=10_000, **fields)  # "sender" set by the caller
        add_steps(b, [{"step": 10_000, "end_us": 10**9, "step_us": 777_000}])
        return b

    wrong_world = batch(rank=1)
    wrong_world.identity.CopyFrom(
        wire.RankIdentity(run_name=run_name, rank=1, world_size=world_size + 1)
    )
    other_node = wire.Batch(run_name=run_name, seq=10_000, node_rank=1)  # the run has one node
    other_node.system_samples.add(node_rank=1, unix_us=1, hostname="forger")
    return [
        ("rank_out_of_range", batch(rank=world_size)),
        ("world_size_mismatch", wrong_world),
        ("node_rank_out_of_range", other_node),
        ("not_a_rank", batch(node_rank=0)),  # a node sampler sending steps
    ]


@pytest.mark.torchrun
@pytest.mark.slow
def test_calls_without_the_run_token_are_refused_during_a_real_run(tmp_path):
    logs = tmp_path / "logs"
    run_dir = logs / RUN
    port = free_port()
    proc = start_traceml(
        [
            "run",
            SCRIPT,
            "--nproc-per-node=2",
            f"--run-name={RUN}",
            f"--logs-dir={logs}",
            f"--aggregator-port={port}",
            "--steps",
            str(STEPS),
            "--step-sleep",
            "0.3",
        ],
        tmp_path,
        tmp_path / "launcher",
        env={"TRACEML_FLUSH_INTERVAL_SEC": "0.2"},
    )
    try:
        target = f"127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while "faulty_ddp: training" not in (tmp_path / "launcher.out").read_text():
            assert proc.poll() is None and time.monotonic() < deadline, (
                tmp_path / "launcher.err"
            ).read_text()
            time.sleep(0.1)
        wait_serving(target, 30)
        token = transport.read_token_file(run_dir / "run_token")
        assert len(token) == 43
        # On no command line of any process (ps shows those to every user).
        assert not [
            p.info["pid"]
            for p in psutil.process_iter(["pid", "cmdline"])
            if token in " ".join(p.info["cmdline"] or [])
        ]

        outsiders = [Credentials(), Credentials(token="x" * 43), Credentials(token=token[:-1])]
        for credentials in outsiders:
            for method, request in forged_calls(RUN, 2):
                reply = call(target, credentials, method, request)
                assert isinstance(reply, grpc.RpcError), (method, reply)
                assert reply.code() == grpc.StatusCode.UNAUTHENTICATED, (method, reply)
                assert "run token" in reply.details()

        insider = Credentials(token=token)
        for kind, batch in invalid_senders(RUN, 2):
            ack = call(target, insider, "Push", batch)
            assert ack.rejected and ack.stored_seq == 0, (kind, ack)
        # Training was still going on while all of that was refused.
        assert proc.poll() is None
        assert proc.wait(180) == 0, (tmp_path / "launcher.err").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

    summary = load_summary(run_dir)
    ranks = {r["rank"]: r for r in summary["ranks"]}
    assert summary["run"]["complete"] is True and summary["run"]["world_size"] == 2
    assert summary["run"]["nodes"] == [0]
    assert {r: v["steps_completed"] for r, v in ranks.items()} == {0: STEPS, 1: STEPS}
    assert {r: v["records_received"] for r, v in ranks.items()} == {0: STEPS, 1: STEPS}
    assert {r: v["end"]["state"] for r, v in ranks.items()} == {0: "completed", 1: "completed"}
    assert {r: v["hostname"] for r, v in ranks.items()} != {0: "forger"}
    assert [n["exit_code"] for n in summary["nodes"]] == [0]
    assert summary["run"]["rejected"] == {
        "unauthenticated": 3 * 5,
        "rank_out_of_range": 1,
        "world_size_mismatch": 1,
        "node_rank_out_of_range": 1,
        "not_a_rank": 1,
    }
    assert "forger" not in json.dumps(summary) and "forged" not in json.dumps(summary)
    assert query(run_dir, "SELECT MAX(step) FROM steps") == [(STEPS - 1,)]
    assert query(run_dir, "SELECT DISTINCT hostname FROM node_exits") != [("forger",)]
    assert query(run_dir, "SELECT COUNT(*) FROM ranks WHERE pid = 4242") == [(0,)]
    aggregator_log = (run_dir / "aggregator" / "process.stderr.log").read_text()
    assert (
        "refused calls: node_rank_out_of_range 1, not_a_rank 1, rank_out_of_range 1, "
        "unauthenticated 15, world_size_mismatch 1;"
    ) in aggregator_log
    # The token is in no manifest and on no command line.
    for manifest in run_dir.rglob("manifest.json"):
        assert token not in manifest.read_text()
    assert token not in (tmp_path / "launcher.err").read_text()


# --- the token file ---------------------------------------------------------------------------
def test_the_token_file_is_private_and_refused_when_others_can_read_it(tmp_path):
    path = tmp_path / "run_token"
    assert transport.read_token_file(path) is None
    transport.write_token_file(path, "secret")
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    assert transport.read_token_file(path) == "secret"
    assert [p.name for p in tmp_path.iterdir()] == ["run_token"]  # no temporary file left
    path.chmod(0o640)
    with pytest.raises(transport.TokenFileError, match=r"accessible to other users .*chmod 600"):
        transport.read_token_file(path)
    # Rewriting replaces the file and its mode, whatever the old one was.
    transport.write_token_file(path, "second")
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    assert transport.read_token_file(path) == "second"


@pytest.mark.slow
@pytest.mark.torchrun
@pytest.mark.aggregator
def test_a_node_refuses_a_token_file_that_others_can_read(tmp_path):
    """Node 1 finds a token file node 0 did not write (mode 0644): it refuses to use it and
    starts nothing."""
    logs = tmp_path / "logs"
    (logs / RUN).mkdir(parents=True)
    (logs / RUN / "run_token").write_text("guessable")
    (logs / RUN / "run_token").chmod(0o644)
    port = free_port()
    with LiveAggregator(tmp_path / "agg", RUN, extra_args=("--nnodes", "2")) as agg:
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "traceml",
                "run",
                SCRIPT,
                "--nnodes=2",
                "--node-rank=1",
                f"--run-name={RUN}",
                f"--logs-dir={logs}",
                "--master-addr=127.0.0.1",
                f"--master-port={port}",
                f"--aggregator-port={agg.port}",
            ],
            cwd=tmp_path,
            env=traceml_env(launcher=True),
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert result.returncode == 1, result.stderr
    assert "is accessible to other users (mode -rw-r--r--); refusing it" in result.stderr
    manifest = json.loads((logs / RUN / "nodes" / "node_1" / "manifest.json").read_text())
    assert manifest["status"] == "no_run_token"


# --- TLS ------------------------------------------------------------------------------------------
@pytest.mark.torchrun
@pytest.mark.slow
def test_a_run_over_tls_end_to_end(tmp_path):
    cert, key = make_cert(tmp_path, "aggregator")
    logs = tmp_path / "logs"
    proc = start_traceml(
        [
            "run",
            SCRIPT,
            "--nproc-per-node=2",
            "--run-name=tls",
            f"--logs-dir={logs}",
            f"--aggregator-port={free_port()}",
            "--steps",
            "6",
            f"--tls-cert={cert}",
            f"--tls-key={key}",
        ],
        tmp_path,
        tmp_path / "launcher",
    )
    assert proc.wait(240) == 0, (tmp_path / "launcher.err").read_text()
    summary = load_summary(logs / "tls")
    assert {r["rank"]: r["steps_completed"] for r in summary["ranks"]} == {0: 6, 1: 6}
    assert {r["rank"]: r["records_received"] for r in summary["ranks"]} == {0: 6, 1: 6}
    assert [n["exit_code"] for n in summary["nodes"]] == [0]
    assert "(TLS)" in (logs / "tls" / "aggregator" / "process.stderr.log").read_text()
    manifest = json.loads((logs / "tls" / "manifest.json").read_text())
    assert manifest["launch"]["tls_ca"] == str(cert)  # node 0: its own certificate


@pytest.mark.aggregator
def test_a_rank_with_the_wrong_ca_is_refused_and_trains_on(tmp_path, monkeypatch):
    cert, key = make_cert(tmp_path, "aggregator")
    other_ca, _ = make_cert(tmp_path, "impostor")
    monkeypatch.setenv("TRACEML_TLS_CA", str(cert))  # the test's own calls: the right CA
    tls = ("--tls-cert", str(cert), "--tls-key", str(key))
    with LiveAggregator(tmp_path / "run", "tls-ca", world_size=1, extra_args=tls) as agg:
        # A plain-text client does not get through either.
        reply = call(
            agg.target,
            Credentials(token=os.environ["TRACEML_RUN_TOKEN"]),
            "Summarize",
            wire.SummarizeRequest(run_name="tls-ca"),
        )
        assert isinstance(reply, grpc.RpcError)
        assert reply.code() == grpc.StatusCode.UNAVAILABLE
        env = {
            "TRACEML_AGGREGATOR": agg.target,
            "TRACEML_RUN_NAME": "tls-ca",
            "TRACEML_TLS_CA": str(other_ca),
            "TRACEML_FLUSH_INTERVAL_SEC": "0.1",
        }
        result = subprocess.run(
            [
                sys.executable,
                str(SCRIPTS / "fail_open_train.py"),
                "--steps",
                "20",
                "--step-sleep",
                "0.02",
            ],
            env=traceml_env(env),
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 0, result.stderr
        assert "trained 20 steps" in result.stdout
        assert "unreachable (UNAVAILABLE)" in result.stderr
        assert agg.stop() == 0
    assert agg.query("SELECT COUNT(*) FROM steps") == [(0,)]
    assert agg.query("SELECT COUNT(*) FROM ranks") == [(0,)]


# --- the sender checks, one by one ----------------------------------------------------------
def _batch(**fields) -> wire.Batch:
    return wire.Batch(run_name=RUN, seq=1, **fields)


def _with(batch: wire.Batch, **parts) -> wire.Batch:
    for name, value in parts.items():
        field = getattr(batch, name)
        if hasattr(field, "CopyFrom"):
            field.CopyFrom(value)
        else:
            field.add().CopyFrom(value)
    return batch


@pytest.mark.parametrize(
    "batch, kind",
    [
        (_batch(rank=1), None),
        (
            _with(_batch(rank=1), identity=wire.RankIdentity(rank=1, world_size=2, node_rank=1)),
            None,
        ),
        (_with(_batch(node_rank=1), system_samples=wire.SystemSample(node_rank=1)), None),
        (_batch(rank=2), "rank_out_of_range"),
        (
            _with(_batch(rank=1), identity=wire.RankIdentity(rank=1, world_size=3)),
            "world_size_mismatch",
        ),
        (
            _with(_batch(rank=1), identity=wire.RankIdentity(rank=0, world_size=2)),
            "identity_mismatch",
        ),
        (
            _with(_batch(rank=1), identity=wire.RankIdentity(rank=1, world_size=2, node_rank=2)),
            "node_rank_out_of_range",
        ),
        (_batch(node_rank=2), "node_rank_out_of_range"),
        (_with(_batch(node_rank=0), finish=wire.RankFinish(steps_completed=3)), "not_a_rank"),
        (
            _with(_batch(node_rank=0), flops_counts=wire.FlopsCount(step=1, forward_flops=8)),
            "not_a_rank",
        ),
        (
            _with(_batch(node_rank=0), identity=wire.RankIdentity(rank=0, world_size=2)),
            "not_a_rank",
        ),
        (
            _with(_batch(node_rank=0), process_samples=wire.ProcessSample(rank=2)),
            "rank_out_of_range",
        ),
        (
            _with(_batch(node_rank=1), system_samples=wire.SystemSample(node_rank=2)),
            "node_rank_out_of_range",
        ),
    ],
)
def test_a_batch_no_sender_of_the_run_can_send_is_refused(batch, kind):
    """World size 2 on 2 nodes."""
    from traceml_aggregator.senders import check_batch

    refusal = check_batch(batch, world_size=2, nnodes=2)
    assert (refusal[0] if refusal else None) == kind, refusal


@pytest.mark.aggregator
def test_a_standalone_aggregator_without_a_token_makes_one_and_says_where(tmp_path):
    port = free_port()
    run_dir = tmp_path / "run"
    env = traceml_env(launcher=True)  # no TRACEML_RUN_TOKEN
    with open(tmp_path / "agg.log", "wb") as log:
        proc = subprocess.Popen(
            aggregator_cmd(run_dir, "alone", "--port", str(port)),
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
        )
    try:
        wait_serving(f"127.0.0.1:{port}", 60, proc)
        token_file = run_dir / "run_token"
        assert oct(token_file.stat().st_mode & 0o777) == "0o600"
        token = transport.read_token_file(token_file)
        request = wire.SummarizeRequest(run_name="alone")
        refused = call(f"127.0.0.1:{port}", Credentials(), "Summarize", request)
        assert refused.code() == grpc.StatusCode.UNAUTHENTICATED
        reply = call(f"127.0.0.1:{port}", Credentials(token=token), "Summarize", request)
        assert isinstance(reply, wire.SummarizeReply), reply
    finally:
        proc.terminate()
        assert proc.wait(30) == 0
    log = (tmp_path / "agg.log").read_text()
    assert (
        f"traceml-aggregator: run token written to {token_file} (mode 0600); give it to the "
        f"ranks: export TRACEML_RUN_TOKEN=$(cat {token_file})"
    ) in log
    assert token not in log
    assert "refused calls: unauthenticated 1;" in log


def test_one_tls_validator_for_the_launcher_and_the_aggregator(tmp_path, monkeypatch):
    """traceml/core/transport.TlsFiles.resolve: flags, else the variables; absolute paths; a
    certificate without its key and a missing file are one-line refusals, the same for both
    commands (the aggregator never reads the CA)."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert.write_text("c")
    key.write_text("k")
    for name in ("TRACEML_TLS_CERT", "TRACEML_TLS_KEY", "TRACEML_TLS_CA"):
        monkeypatch.delenv(name, raising=False)
    assert transport.TlsFiles.resolve(serves=True, reads_ca=True) == transport.TlsFiles()
    node0 = transport.TlsFiles.resolve(cert, key, serves=True, reads_ca=True)
    assert node0 == transport.TlsFiles(cert, key, cert)  # self-signed: the CA is the cert
    monkeypatch.setenv("TRACEML_TLS_CA", str(cert))
    monkeypatch.chdir(tmp_path)
    other = transport.TlsFiles.resolve("cert.pem", "key.pem", serves=False, reads_ca=True)
    assert other == transport.TlsFiles(cert, key, cert)
    assert transport.TlsFiles.resolve(cert, key, serves=True, reads_ca=False).ca is None
    with pytest.raises(transport.TlsFilesError, match="^--tls-cert and --tls-key go together$"):
        transport.TlsFiles.resolve(cert, serves=True, reads_ca=False)
    with pytest.raises(transport.TlsFilesError) as info:
        transport.TlsFiles.resolve(cert, tmp_path / "none.pem", serves=True, reads_ca=False)
    assert str(info.value) == f"--tls-key {tmp_path / 'none.pem'} not found"
