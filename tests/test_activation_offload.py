"""parallel/offload.py on CPU: the saved activations really leave the autograd graph (the
graph holds copies, the originals are released) and come back bit-identical (outputs and
gradients equal to the bit). Its memory effect needs a GPU (device and host memory differ) and
is not measured here."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

from megatron_auto.parallel.offload import ActivationOffload

pytestmark = pytest.mark.single


class _Recording(ActivationOffload):
    """Remembers a weak reference to every activation it moved."""

    def __init__(self, device: str) -> None:
        super().__init__(device)
        self.moved: list[weakref.ref] = []

    def _pack(self, tensor: torch.Tensor):
        packed = super()._pack(tensor)
        if packed is not tensor:
            self.moved.append(weakref.ref(tensor))
        return packed


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Dropout(0.1), nn.Linear(64, 16))


def _step(model: nn.Module, x: torch.Tensor, hooks=None):
    torch.manual_seed(1)  # the same dropout mask in both runs
    model.zero_grad()
    if hooks is None:
        y = model(x)
    else:
        with hooks:
            y = model(x)
    return y


def test_saved_activations_leave_the_graph_and_come_back_bit_identical():
    model, x = _model(), torch.randn(8, 16)
    y_ref = _step(model, x)
    y_ref.square().sum().backward()
    grads_ref = [p.grad.clone() for p in model.parameters()]

    hooks = _Recording("cpu")
    y = _step(model, x, hooks)
    gc.collect()
    # intermediates (linear output, GeLU output, dropout mask/output) were moved; x is ours
    moved_alive = [r for r in hooks.moved if r() is not None and r() is not x]
    assert len(hooks.moved) >= 3 and hooks.offloaded_bytes > 0
    assert moved_alive == [], "the graph still holds original activations"
    y.square().sum().backward()
    assert torch.equal(y, y_ref)
    for p, g in zip(model.parameters(), grads_ref):
        assert torch.equal(p.grad, g)


def test_without_offload_the_graph_keeps_the_originals():
    """The control: the weak-reference check above can fail."""
    model, x = _model(), torch.randn(8, 16)
    kept: list[weakref.ref] = []

    def pack(t):
        if t.grad_fn is not None:
            kept.append(weakref.ref(t))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = model(x)
    gc.collect()
    assert any(r() is not None for r in kept)
    y.sum().backward()


def test_parameters_stay_in_place():
    model, x = _model(), torch.randn(4, 16)
    hooks = _Recording("cpu")
    with hooks:
        y = model(x)
    params = list(model.parameters())
    assert not any(r() is p for r in hooks.moved for p in params)
    assert hooks.offloaded_bytes < sum(p.numel() * p.element_size() for p in params)
    y.sum().backward()
