"""The forward timer: the traced model's forward is timed only inside its step, and the model
is the user's own again between steps, whatever happens to it inside one (pickled, copied,
its forward reassigned, a step nested by mistake)."""

from __future__ import annotations

import copy
import io
import time

import pytest
import torch
from torch import nn

from traceml.sdk.instrumentation import ForwardTimer


class Slow(nn.Module):
    """A module whose forward takes at least 20 ms."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        time.sleep(0.02)
        return self.linear(x)


def traced_step(tracer, timer, body):
    tracer.begin()
    timer.install()
    try:
        return body()
    finally:
        timer.remove()
        tracer.end()


def test_forward_is_timed_inside_the_step_only(tracer):
    tracer, steps = tracer
    model, x = Slow(), torch.randn(2, 4)
    timer = ForwardTimer(model)
    expected = model.linear(x)
    out = traced_step(tracer, timer, lambda: model(x))
    assert torch.equal(out, expected)
    assert steps[-1].forward_ns >= 20_000_000
    assert "forward" not in model.__dict__  # the user's model again
    tracer.begin()
    model(x)  # a step without the timer installed: nothing times this forward
    tracer.end()
    assert steps[-1].forward_ns is None


def test_a_model_saved_or_copied_inside_a_step_has_its_own_forward(tracer):
    tracer, _ = tracer
    model, x = Slow(), torch.randn(2, 4)
    timer = ForwardTimer(model)

    def save_and_copy():
        buffer = io.BytesIO()
        torch.save(model, buffer)
        buffer.seek(0)
        return torch.load(buffer, weights_only=False), copy.deepcopy(model)

    loaded, copied = traced_step(tracer, timer, save_and_copy)
    for other in (loaded, copied):
        assert other.__dict__.get("forward") is not timer
        assert torch.equal(other(x), model(x))
        other.linear.weight.data.zero_()  # its own module, not the original's
        assert not torch.equal(other(x), model(x))


def test_a_forward_the_step_assigned_is_kept_and_a_nested_step_does_not_recurse(tracer):
    tracer, steps = tracer
    model, x = Slow(), torch.randn(2, 4)
    timer = ForwardTimer(model)

    def nested():
        timer.install()  # a step opened inside a step of the same model, by mistake
        return model(x)

    assert traced_step(tracer, timer, nested).shape == (2, 4)
    assert "forward" not in model.__dict__ and steps[-1].forward_ns >= 20_000_000
    own = model.linear.forward
    traced_step(tracer, timer, lambda: setattr(model, "forward", own))
    assert model.__dict__["forward"] is own


def test_only_modules_can_be_traced():
    with pytest.raises(TypeError, match=r"takes a torch.nn.Module, not function"):
        ForwardTimer(lambda x: x)
