"""``traceml run --metrics-port``: node 0's aggregator serves Prometheus ``/metrics`` of a real
two-rank torchrun job, with the run's token (401 without it or with another), on 127.0.0.1
unless ``--metrics-bind-host`` says otherwise; another node accepts the flag and says, in one
line, that node 0 serves it."""

from __future__ import annotations

import urllib.error
import urllib.request

import pytest
from conftest import SCRIPTS, free_port, load_summary, run_traceml, start_traceml, wait_for
from helpers.aggregator import listening_port
from helpers.jobs import run_args
from prometheus_client.parser import text_string_to_metric_families

pytestmark = [pytest.mark.slow, pytest.mark.torchrun]

STEPS = 12


def get(url: str, token: str | None) -> tuple[int, str]:
    """``(status, body)`` of ``url``, with ``token`` as the bearer token unless None."""
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def samples(text: str) -> dict[tuple[str, tuple], float]:
    """``{(sample name, sorted labels): value}`` of an exposition."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_traceml_run_serves_metrics_of_its_ranks_with_the_run_token(tmp_path):
    port, hold = free_port(), tmp_path / "hold"
    name = "metrics-run"
    launcher = start_traceml(
        run_args(
            tmp_path,
            SCRIPTS / "hold_train.py",
            name,
            free_port(),
            "--metrics-port",
            str(port),
            "--steps",
            str(STEPS),
            "--hold-file",
            str(hold),
        ),
        tmp_path,
        tmp_path / "launcher",
    )
    run_dir = tmp_path / "logs" / name
    url = f"http://127.0.0.1:{port}/metrics"
    try:
        token_file = run_dir / "run_token"

        def token_written() -> bool:
            assert launcher.poll() is None, (tmp_path / "launcher.err").read_text()
            return token_file.exists()

        wait_for(token_written, 120, "the run token")
        token = token_file.read_text().strip()

        def all_steps() -> dict | None:
            assert launcher.poll() is None, (tmp_path / "launcher.err").read_text()
            try:
                status, body = get(url, token)
            except OSError:  # not serving yet
                return None
            got = samples(body) if status == 200 else {}
            steps = {k: v for k, v in got.items() if k[0] == "traceml_steps_total"}
            return got if list(steps.values()) == [STEPS, STEPS] else None

        got = wait_for(all_steps, 180, f"{STEPS} steps of both ranks on /metrics", poll_s=0.5)
        assert {k for k in got if k[0] == "traceml_steps_total"} == {
            ("traceml_steps_total", (("node", "0"), ("rank", "0"))),
            ("traceml_steps_total", (("node", "0"), ("rank", "1"))),
        }
        counts = {k[1]: v for k, v in got.items() if k[0] == "traceml_step_time_seconds_count"}
        assert counts == {
            (("node", "0"), ("rank", "0")): STEPS,
            (("node", "0"), ("rank", "1")): STEPS,
        }
        assert {dict(k[1])["rank"] for k in got if k[0] == "traceml_phase_median_seconds"} == {
            "0",
            "1",
        }
        assert get(url, None)[0] == 401
        assert get(url, token + "x")[0] == 401
        assert (run_dir / "run_token").stat().st_mode & 0o777 == 0o600
    finally:
        hold.touch()
        code = launcher.wait(240)
    assert code == 0, (tmp_path / "launcher.err").read_text()
    summary = load_summary(run_dir)
    assert {r["rank"]: r["steps_completed"] for r in summary["ranks"]} == {0: STEPS, 1: STEPS}
    with pytest.raises(OSError):  # the run is over: nothing serves /metrics any more
        get(url, token)


def test_another_node_takes_the_flag_and_leaves_it_to_node_0(tmp_path):
    """Node 1 of a two-node run: the sbatch line is the same on every node, so the flag is
    accepted; the node says once that node 0's aggregator serves it (and gives up waiting for
    node 0, which never starts here: TRACEML_AGGREGATOR_WAIT_SEC=1)."""
    script = tmp_path / "train.py"
    script.write_text("pass\n")
    result = run_traceml(
        [
            "run",
            "--nnodes",
            "2",
            "--node-rank",
            "1",
            "--run-name",
            "n1",
            "--master-port",
            str(free_port()),
            "--aggregator-port",
            str(free_port()),
            "--metrics-port",
            "29766",
            "--otlp-endpoint",
            "http://127.0.0.1:4317",
            str(script),
        ],
        tmp_path,
        timeout=120,
        env={"TRACEML_AGGREGATOR_WAIT_SEC": "1"},
    )
    notes = [line for line in result.stderr.splitlines() if "--metrics-port" in line]
    assert notes == [
        "traceml: note: --metrics-port 29766 and --otlp-endpoint http://127.0.0.1:4317 act on "
        "node 0's aggregator only; node 1 leaves them to node 0"
    ], result.stderr


#: What a refused OTLP endpoint is told.
OTLP_URL = "must be http://HOST:PORT (plain text) or https://HOST:PORT (TLS)"


@pytest.mark.parametrize(
    ("flags", "env", "expected"),
    [
        (["--metrics-port", "70000"], {}, "--metrics-port must be a TCP port, 1-65535 (got 70000)"),
        (["--metrics-port", "{agg}"], {}, "--metrics-port {agg} is also the aggregator's"),
        # a bare HOST:PORT is TLS to the exporter: every push to a plain collector would fail
        (
            ["--otlp-endpoint", "127.0.0.1:4317"],
            {},
            f"--otlp-endpoint {OTLP_URL} (got '127.0.0.1:4317')",
        ),
        (["--otlp-endpoint", "http://"], {}, f"--otlp-endpoint {OTLP_URL} (got 'http://')"),
        (
            ["--otlp-endpoint", "ftp://c:4317"],
            {},
            f"--otlp-endpoint {OTLP_URL} (got 'ftp://c:4317')",
        ),
        (
            [],
            {"OTEL_EXPORTER_OTLP_ENDPOINT": "garbage"},
            f"OTEL_EXPORTER_OTLP_ENDPOINT {OTLP_URL} (got 'garbage')",
        ),
    ],
)
def test_traceml_run_refuses_a_bad_metrics_port_or_otlp_endpoint_in_one_line(
    tmp_path, flags, env, expected
):
    agg = free_port()
    script = tmp_path / "train.py"
    script.write_text("pass\n")
    flags = [f.format(agg=agg) for f in flags]
    result = run_traceml(
        ["run", "--aggregator-port", str(agg), *flags, str(script)], tmp_path, timeout=60, env=env
    )
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        line for line in result.stderr.splitlines() if line.startswith("traceml: error: ")
    ]
    assert len(result.stderr.splitlines()) == 1 and expected.format(agg=agg) in result.stderr


def _refusal(tmp_path, *flags: str) -> str:
    """The error of ``traceml run FLAGS train.py`` (a script that does nothing, a free
    aggregator port), stripped: it must refuse the flags (exit code 2) before it makes a logs
    directory."""
    script = tmp_path / "train.py"
    script.write_text("pass\n")
    result = run_traceml(
        ["run", "--aggregator-port", str(free_port()), *flags, str(script)], tmp_path, timeout=60
    )
    assert result.returncode == 2
    assert not (tmp_path / "logs").exists()
    return result.stderr.strip()


def test_traceml_run_refuses_a_metrics_port_in_use_before_starting(tmp_path):
    with listening_port() as port:
        error = _refusal(tmp_path, "--metrics-port", str(port))
    assert error == (
        f"traceml: error: /metrics port 127.0.0.1:{port} is not available (already in use); "
        "pick another with --metrics-port"
    )


def test_traceml_run_refuses_a_metrics_bind_host_that_is_no_address_here(tmp_path):
    """The address is what is wrong, not the port: the one line says which flag to check."""
    port = free_port()
    error = _refusal(tmp_path, "--metrics-port", str(port), "--metrics-bind-host", "192.0.2.1")
    assert error == (
        f"traceml: error: /metrics port 192.0.2.1:{port} is not available (Cannot assign "
        "requested address); check --metrics-bind-host"
    )
