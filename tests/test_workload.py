"""Throughput and MFU, part by part: batch shapes read by the DataLoader hook, the FLOPs of a
known model counted once through the real forward timer, the peak table, the analysis's
figures from stored steps, and ``--peak-tflops`` refused on bad input."""

from __future__ import annotations

import time

import pytest
import torch
from conftest import SCRIPTS, assert_rejected
from rundata_factory import rank, run_of, step
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from traceml import settings
from traceml.analysis import throughput
from traceml.analysis.summary import build_summary
from traceml.core import peaks
from traceml.core.records import Flops
from traceml.sdk import instrumentation, workload
from traceml.sdk.instrumentation import ForwardTimer
from traceml.sdk.step import StepTracer

B, IN, HIDDEN, OUT = 6, 8, 16, 4


@pytest.mark.parametrize(
    "batch, expected",
    [
        (torch.zeros(4, 7, dtype=torch.long), (4, 28)),  # token ids: batch x sequence
        (torch.zeros(4, 7), (4, None)),  # float features: no tokens
        ((torch.zeros(5, 3), torch.zeros(5)), (5, None)),  # (inputs, labels)
        ([torch.zeros(3, 9, dtype=torch.int32)], (3, 27)),
        ({"labels": torch.zeros(2), "input_ids": torch.zeros(2, 5, dtype=torch.long)}, (2, 10)),
        ({"pixel_values": torch.zeros(8, 3, 4, 4), "labels": torch.zeros(8)}, (8, None)),
        (((torch.zeros(2, 4, dtype=torch.long), torch.zeros(2)), torch.zeros(2)), (2, 8)),
        (torch.zeros(4, 2, dtype=torch.bool), (4, None)),  # a mask is not token ids
        (torch.tensor(3), (None, None)),  # a 0-d tensor has no batch dimension
        (["text", "more"], (None, None)),
        (None, (None, None)),
        (object(), (None, None)),
    ],
)
def test_batch_counts_come_from_the_lead_tensor(batch, expected):
    assert workload.batch_counts(batch) == expected


@pytest.fixture
def tracer(monkeypatch):
    steps, sent = [], []
    tracer = StepTracer(steps.append, time.perf_counter_ns())
    tracer.flops_counter = workload.FlopsCounter(sent.append, None)
    monkeypatch.setattr(instrumentation, "_tracer", instrumentation._tracer)  # restored after
    instrumentation.install(tracer)
    yield tracer, steps, sent


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, OUT))


#: FLOPs of one forward of mlp() on B samples: 2 x B x in x out per Linear.
FORWARD_FLOPS = 2 * B * IN * HIDDEN + 2 * B * HIDDEN * OUT


def train(tracer, model, loader, steps: int, *, accumulate: int = 1, evaluate: bool = False):
    """``steps`` traced steps of ``accumulate`` micro-batches each, fetched inside the step."""
    timer = ForwardTimer(model)
    batches = iter(loader)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    outputs = []
    for _ in range(steps):
        tracer.begin()
        timer.install()
        for _ in range(accumulate):
            (x,) = next(batches)
            out = model(x)
            outputs.append(out.detach().clone())
            out.sum().backward()
        if evaluate:
            with torch.no_grad():
                model(x)  # an evaluation forward: no model FLOPs
        optimizer.step()
        optimizer.zero_grad()
        timer.remove()
        tracer.end()
    return outputs


def test_the_flops_of_a_linear_stack_are_counted_once_exactly(tracer):
    tracer, steps, sent = tracer
    loader = DataLoader(TensorDataset(torch.randn(4 * B, IN)), batch_size=B)
    train(tracer, mlp(), loader, 4, evaluate=True)
    assert len(sent) == 1  # counted once, at COUNT_STEP's first training forward
    count = sent[0]
    assert (count.step, count.forward_flops) == (workload.COUNT_STEP, FORWARD_FLOPS)
    assert (count.dtype, count.device_name, count.peak_tflops) == ("fp32", "cpu", 0.0)
    assert count.count_us > 0
    # model FLOPs of a step: 3 x the forward's (forward + backward), from the counted step on
    assert [s.flops for s in steps] == [None] + [3 * FORWARD_FLOPS] * 3
    assert [(s.samples, s.tokens) for s in steps] == [(B, None)] * 4


def test_a_counted_forward_computes_what_an_uncounted_one_does(tracer):
    tracer, _, sent = tracer
    loader = DataLoader(TensorDataset(torch.randn(2 * B, IN)), batch_size=B)
    counted = train(tracer, mlp(), loader, 2)
    plain = []
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for (x,) in loader:
        out = model(x)
        plain.append(out.detach().clone())
        out.sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    assert len(sent) == 1
    assert all(torch.equal(a, b) for a, b in zip(counted, plain, strict=True))


def test_gradient_accumulation_counts_every_micro_batch(tracer):
    tracer, steps, _ = tracer
    tokens = torch.randint(0, 50, (6 * 3, 5))
    loader = DataLoader(TensorDataset(tokens), batch_size=3)
    model = nn.Sequential(nn.Embedding(50, IN), nn.Linear(IN, OUT))
    train(tracer, model, loader, 3, accumulate=2)
    # 2 micro-batches of 3 x 5 token ids per step; the Linear on (3, 5, IN) is 2*15*IN*OUT
    assert [(s.samples, s.tokens) for s in steps] == [(6, 30)] * 3
    assert [s.flops for s in steps] == [None] + [2 * 3 * (2 * 15 * IN * OUT)] * 2


def test_an_evaluation_loader_between_steps_is_not_the_steps_input(tracer):
    tracer, steps, _ = tracer
    train_loader = DataLoader(TensorDataset(torch.randn(4 * B, IN)), batch_size=B)
    eval_loader = DataLoader(TensorDataset(torch.randn(10, IN)), batch_size=5)
    model, it = mlp(), iter(train_loader)
    for i in range(3):
        (x,) = next(it)  # fetched between steps: this step's input
        if i == 1:
            for _ in eval_loader:  # then an evaluation: another iterator, not the input...
                pass
            (x,) = next(it)  # ...and the training loader again: only this counts
        tracer.begin()
        model(x).sum().backward()
        tracer.end()
    assert [s.samples for s in steps] == [B, B, B]


def test_a_forward_that_raises_while_counted_raises_and_is_counted_later(tracer):
    tracer, steps, sent = tracer

    class Flaky(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear, self.calls = nn.Linear(IN, OUT), 0

        def forward(self, x):
            self.calls += 1
            if self.calls == 2:
                raise RuntimeError("bad batch")
            return self.linear(x)

    model, x = Flaky(), torch.randn(B, IN)
    timer = ForwardTimer(model)
    for i in range(3):
        tracer.begin()
        timer.install()
        try:
            model(x).sum().backward()
        except RuntimeError as exc:
            assert str(exc) == "bad batch" and i == 1
        timer.remove()
        tracer.end()
    assert sent == []  # the counted call raised: no count, and none made again
    assert tracer.flops_counter is None
    assert [s.flops for s in steps] == [None, None, None]


@pytest.mark.parametrize(
    "name, dtype, peak",
    [
        ("NVIDIA H100 80GB HBM3", "bf16", 989.5),
        ("NVIDIA H100 PCIe", "bf16", 756.5),
        ("NVIDIA H100 NVL", "fp8", 1670.5),
        ("NVIDIA H200", "bf16", 989.5),
        ("NVIDIA A100-SXM4-80GB", "bf16", 312.0),
        ("NVIDIA A100-PCIE-40GB", "tf32", 156.0),
        ("NVIDIA A10", "bf16", 125.0),
        ("NVIDIA L4", "fp16", 121.0),
        ("NVIDIA L40S", "bf16", 362.05),
        ("Tesla V100-SXM2-16GB", "fp16", 125.0),
        ("Tesla T4", "fp16", 65.0),
        ("NVIDIA A10G", "bf16", None),  # not A10: no guessed peak
        ("NVIDIA L40", "bf16", None),  # not L40S or L4
        ("Tesla T4", "bf16", None),  # no bf16 on T4
        ("NVIDIA A100-SXM4-40GB MIG 3g.20gb", "bf16", None),  # a share of the GPU
        ("cpu", "fp32", None),
        (None, "fp32", None),
    ],
)
def test_the_peak_table_gives_dense_figures_or_none(name, dtype, peak):
    value, why = peaks.lookup(name, dtype)
    assert value == peak
    assert why.startswith("table: ") == (peak is not None)
    if name and peak is None:
        assert "--peak-tflops" in why


def _work_run(peak_tflops=None, device="cpu", dtype="fp32"):
    """Two ranks, 20 steps of 40 ms; 32 samples of 128 tokens and 3e9 model FLOPs a step."""
    ranks = []
    for r in (0, 1):
        rd = rank(
            r,
            [
                step(i, samples=32, tokens=32 * 128, flops=None if i < 1 else 3 * 10**9)
                for i in range(20)
            ],
        )
        rd.flops = Flops(
            rank=r,
            restart=0,
            step=1,
            forward_flops=10**9,
            count_us=2500,
            dtype=dtype,
            device_name=device,
            peak_tflops=peak_tflops,
        )
        ranks.append(rd)
    return run_of(ranks)


def test_throughput_is_samples_over_the_window_wall_time():
    s = build_summary(_work_run())
    step_s = 0.0335  # rundata_factory's step: 1 + 10 + 20 + 2 + 0.5 ms
    for r in s["ranks"]:
        t = r["throughput"]
        assert t["statistic"] == "share_of_summed_time"
        assert t["steps"] == 15  # the window: steps 5-19
        assert t["samples_per_s"] == pytest.approx(32 / step_s, abs=1e-3)
        assert t["tokens_per_s"] == pytest.approx(32 * 128 / step_s, abs=1e-3)
        assert (t["samples_per_step"], t["tokens_per_step"]) == (32, 4096)
        m = t["mfu"]
        assert (m["forward_flops"], m["flops_per_step"], m["count_ms"]) == (10**9, 3 * 10**9, 2.5)
        assert m["achieved_tflops"] == pytest.approx(3e9 / step_s / 1e12, abs=1e-6)
        # on CPU without --peak-tflops: no MFU, and why
        assert m["mfu_pct"] is None and m["peak_tflops"] is None
        assert m["unavailable_reason"] == (
            "no peak for a cpu device in the table: give --peak-tflops"
        )
    job = s["analysis"]["throughput"]
    assert job["samples_per_s"] == pytest.approx(2 * 32 / step_s, abs=1e-2)
    assert job["mfu_pct"] is None
    assert job["mfu_unavailable_reason"].startswith("rank 0: no peak for a cpu device")


def test_mfu_against_the_users_peak_and_against_the_table():
    step_s = 0.0335
    s = build_summary(_work_run(peak_tflops=0.5))
    m = s["ranks"][0]["throughput"]["mfu"]
    assert (m["peak_tflops"], m["peak_source"]) == (0.5, throughput.FLAG_SOURCE)
    assert m["mfu_pct"] == pytest.approx(100 * 3e9 / step_s / 0.5e12, abs=1e-3)
    assert s["analysis"]["throughput"]["mfu_pct"] == pytest.approx(m["mfu_pct"], abs=1e-3)
    s = build_summary(_work_run(device="NVIDIA H100 80GB HBM3", dtype="bf16"))
    m = s["ranks"][1]["throughput"]["mfu"]
    assert (m["peak_tflops"], m["peak_source"]) == (989.5, "table: H100 SXM bf16 dense")
    assert m["mfu_pct"] == pytest.approx(100 * 3e9 / step_s / 989.5e12, abs=1e-3)
    assert s["analysis"]["throughput"]["peak_tflops"] == 2 * 989.5


def test_an_mfu_above_100_percent_is_never_reported():
    # 3e9 FLOPs in 33.5 ms is 0.0896 TFLOP/s: a peak of 0.05 TFLOP/s would give 179 % MFU
    s = build_summary(_work_run(peak_tflops=0.05))
    for r in s["ranks"]:
        m = r["throughput"]["mfu"]
        assert (m["mfu_pct"], m["peak_tflops"]) == (None, 0.05)
        assert m["unavailable_reason"] == (
            "achieved 0.08955 TFLOP/s exceeds the peak 0.05 TFLOP/s (--peak-tflops, dtype fp32): "
            "the FLOPs count or the peak is wrong, so no MFU"
        )
    job = s["analysis"]["throughput"]
    assert job["mfu_pct"] is None
    assert job["mfu_unavailable_reason"].startswith("rank 0: achieved 0.08955 TFLOP/s exceeds")


def test_a_run_without_batches_or_flops_has_null_figures():
    s = build_summary(run_of([rank(r, [step(i) for i in range(20)]) for r in (0, 1)]))
    t = s["ranks"][0]["throughput"]
    assert (t["samples_per_s"], t["tokens_per_s"], t["steps"]) == (None, None, 0)
    assert t["mfu"]["forward_flops"] is None and t["mfu"]["mfu_pct"] is None
    assert t["mfu"]["unavailable_reason"].startswith("no FLOPs count")
    job = s["analysis"]["throughput"]
    assert (job["samples_per_s"], job["tokens_per_s"], job["mfu_pct"]) == (None, None, None)


@pytest.mark.torchrun
@pytest.mark.parametrize("value", ["0", "-3", "nan", "inf", "lots"])
def test_a_bad_peak_flag_is_refused_in_one_line(tmp_path, port, value):
    expected = (
        "Invalid value for '--peak-tflops'"
        if value == "lots"
        else f"--peak-tflops must be a finite number > 0 (got {float(value)!r})"
    )
    assert_rejected(
        tmp_path,
        [
            f"--peak-tflops={value}",
            "--aggregator-port",
            str(port),
            str(SCRIPTS / "planted_truth.py"),
        ],
        expected,
        marker=str(port),
    )


@pytest.mark.torchrun
def test_a_bad_peak_variable_is_refused_by_the_launcher_and_ignored_by_a_rank(
    tmp_path, monkeypatch
):
    from traceml.launcher.config import LaunchConfig, LaunchError

    script = tmp_path / "train.py"
    script.write_text("pass\n")
    monkeypatch.setenv("TRACEML_PEAK_TFLOPS", "lots")
    with pytest.raises(
        LaunchError, match=r"^TRACEML_PEAK_TFLOPS must be a finite number > 0 \(got 'lots'\)$"
    ):
        LaunchConfig(script=str(script)).resolve()
    assert settings.read(settings.PEAK_TFLOPS) is None  # a rank warns and goes on
    monkeypatch.setenv("TRACEML_PEAK_TFLOPS", "312")
    assert LaunchConfig(script=str(script)).resolve().peak_tflops == 312.0
    assert settings.read(settings.PEAK_TFLOPS) == 312.0


def test_summary_metrics_and_compare_carry_throughput_and_mfu():
    from traceml.report.compare import compare
    from traceml.report.flat import flatten
    from traceml.report.text import render_text

    a, b = build_summary(_work_run(peak_tflops=0.5)), build_summary(_work_run())
    metrics, _ = flatten(a)
    job = a["analysis"]["throughput"]
    assert {
        k: metrics[k] for k in ("samples_per_s", "tokens_per_s", "achieved_tflops", "mfu_pct")
    } == {k: job[k] for k in ("samples_per_s", "tokens_per_s", "achieved_tflops", "mfu_pct")}
    assert "mfu_pct" not in flatten(b)[0]  # null on CPU: left out, never 0
    rows = {r["name"]: r for r in compare(a, a)["metrics"]}
    assert rows["samples_per_s"]["status"] == "unchanged" and not rows["samples_per_s"]["key"]
    assert rows["mfu_pct"]["better"] == "higher"
    row = {r["name"]: r for r in compare(a, b)["metrics"]}["mfu_pct"]  # B on CPU, no peak
    assert (row["a"], row["b"], row["status"]) == (job["mfu_pct"], None, "not_comparable")
    text = render_text(a)
    assert "job: 1910.4 samples/s, 244537 tokens/s, MFU 17.9% (0.179 of 1 TFLOPS)" in text


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("autocast, dtype", [(False, "fp32"), (True, "bf16")])
def test_on_a_gpu_the_count_names_the_device_and_the_matmul_dtype(tracer, autocast, dtype):
    """On CUDA: the device's name, the autocast dtype (bf16) or the parameters' (fp32, or
    tf32 when float32 matmul precision allows it), the FLOPs as on CPU, and the table's peak."""
    tracer, steps, sent = tracer
    model = mlp().cuda()
    loader = DataLoader(TensorDataset(torch.randn(3 * B, IN)), batch_size=B)
    timer = ForwardTimer(model)
    for (x,) in loader:
        tracer.begin()
        timer.install()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            out = model(x.cuda())
        out.float().sum().backward()
        timer.remove()
        tracer.end()
    count = sent[0]
    if not autocast and torch.get_float32_matmul_precision() != "highest":
        dtype = "tf32"
    assert (count.forward_flops, count.dtype) == (FORWARD_FLOPS, dtype)
    assert count.device_name == torch.cuda.get_device_name()
    peak, why = peaks.lookup(count.device_name, count.dtype)
    assert (peak is None) == (not why.startswith("table: "))
