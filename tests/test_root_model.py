"""Zero-code finds the root model in the calling frames, without scanning live objects.

In-process, with the SDK's real hooks on a real ``StepTracer``: a plain loop over a DDP wrapper
(a one-process gloo group), a Trainer-like class holding its model and optimizer as
attributes, and the Hugging Face ``Trainer`` itself each get their root model timed as forward
from step 0 on, while :func:`traceml.sdk.auto.root_models` (the scan of the garbage collector's
objects, tenths of a second) is never called. A model the frames cannot see is still found, by
the scan, once.
"""

from __future__ import annotations

import gc
import time

import pytest
import torch
import torch.distributed as dist
from conftest import free_port
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

from traceml.sdk import auto, instrumentation
from traceml.sdk.step import StepTracer


@pytest.fixture
def tracer():
    """A step tracer with the SDK's hooks routed to it and zero-code steps on; the models
    whose forward is timed are in ``tracer.timed``."""
    steps = []
    tracer = StepTracer(steps.append, time.perf_counter_ns())
    tracer.steps, tracer.timed = steps, []
    instrumentation.install(tracer)
    tracer.auto = auto.AutoSteps(tracer, on_model=tracer.timed.append)
    try:
        yield tracer
    finally:
        if tracer.auto is not None:
            tracer.auto.stop()
        instrumentation._tracer = None  # the hooks pass through from now on


@pytest.fixture
def scans(monkeypatch):
    """The calls of the scan of live objects (each with its argument); it still runs."""
    calls = []
    real = auto.root_models

    def counted(optimizers=None):
        calls.append(optimizers)
        return real(optimizers)

    monkeypatch.setattr(auto, "root_models", counted)
    return calls


def _loader(n: int = 4) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    return DataLoader(
        TensorDataset(torch.randn(4 * n, 8, generator=g), torch.randn(4 * n, 1, generator=g)),
        batch_size=4,
    )


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))


def test_a_plain_ddp_loop_times_the_wrapper_without_a_scan(tracer, scans):
    """The loop's locals hold the DDP wrapper and its optimizer: the wrapper (which contains
    the net, also a local) is the root, timed from step 0's forward on; no scan."""
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    try:
        net = _net()
        model = DDP(net)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        for x, y in _loader():
            optimizer.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
    finally:
        dist.destroy_process_group()
    assert scans == []
    assert tracer.timed == [model]
    assert [m.step for m in tracer.steps] == [0, 1, 2, 3]
    assert all(m.forward_ns > 0 for m in tracer.steps)


class _Trainer:
    """Holds its model and optimizer as attributes; the loop's frames have neither as a
    local (only ``self``)."""

    def __init__(self) -> None:
        self.model = _net()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3)

    def train(self, loader) -> None:
        for batch in loader:
            self.training_step(batch)

    def training_step(self, batch) -> None:
        x, y = batch
        self.optimizer.zero_grad()
        nn.functional.mse_loss(self.model(x), y).backward()
        self.optimizer.step()


def test_a_trainer_class_is_searched_through_self(tracer, scans):
    trainer = _Trainer()
    trainer.train(_loader(3))
    assert scans == []
    assert tracer.timed == [trainer.model]
    assert [m.step for m in tracer.steps] == [0, 1, 2]
    assert all(m.forward_ns > 0 for m in tracer.steps)


def _hidden_step(state: dict) -> None:
    """A step whose model and optimizer are no frame's local or ``self`` attribute."""
    state["optimizer"].zero_grad()
    state["model"](torch.ones(2, 8)).sum().backward()
    state["optimizer"].step()


def test_a_model_no_frame_holds_is_found_by_one_scan(tracer, scans):
    """Model and optimizer only in a dict: the first step opens at backward with no optimizer
    in the frames, so the scan runs once, for every live optimizer, and finds the root."""
    gc.collect()  # no optimizer of an earlier test left for the scan to find
    state = {"model": _net()}
    state["optimizer"] = torch.optim.SGD(state["model"].parameters(), lr=0.01)
    for _ in range(3):
        _hidden_step(state)
    assert scans == [None]
    assert tracer.timed == [state["model"]]
    assert [m.step for m in tracer.steps] == [0, 1, 2]


def test_an_optimizer_seen_late_is_rooted_from_its_frames(tracer, scans):
    """A second optimizer (a GAN's) made after the first step opened is rooted at its first
    step from the frame that steps it, again without a scan."""
    generator, critic = _net(), _net()
    g_opt = torch.optim.SGD(generator.parameters(), lr=0.01)
    for i, (x, _) in enumerate(_loader(3)):
        if i == 1:
            c_opt = torch.optim.SGD(critic.parameters(), lr=0.01)
        generator(x).sum().backward()
        g_opt.step()
        if i >= 1:
            critic(x).sum().backward()
            c_opt.step()
    assert scans == []
    assert tracer.timed == [generator, critic]


@pytest.mark.slow
def test_the_hf_trainer_times_its_model_without_a_scan(tracer, scans, tmp_path):
    """The Hugging Face ``Trainer`` on CPU (a 1-layer GPT-2 from a config, no download):
    the model is found through the Trainer's attributes, no scan; exactly max_steps steps."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        n_layer=1,
        n_head=2,
        n_embd=16,
        vocab_size=64,
        n_positions=16,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 64, (16, 8), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": row, "labels": row} for row in ids]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=3,
        per_device_train_batch_size=4,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
    )
    transformers.Trainer(model=model, args=args, train_dataset=data).train()
    assert scans == []
    assert tracer.timed == [model]
    assert [m.step for m in tracer.steps] == [0, 1, 2]
    assert all(m.forward_ns > 0 for m in tracer.steps)
