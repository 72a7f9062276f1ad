"""Recompute of single modules inside a transformer layer (plan ``layers[i].recompute``).

A layer's plan value is ``False`` (keep every activation), ``True`` (the whole layer re-runs in
backward: :func:`~megatron_auto.parallel.random.checkpoint` around the layer), or a set of its
modules that re-run on their own:

- ``core_attn``: scores, softmax and attention dropout (``F.scaled_dot_product_attention``); the
  checkpoint keeps q, k, v and drops what the attention kernel saves for backward (the
  ``(b, heads, s, s)`` probabilities and dropout mask on the math kernel). This is Megatron's
  ``--recompute-granularity selective`` (plan value ``"selective"``).
- ``mlp``: fc1, activation and fc2; keeps the MLP input, drops the ``(b, s, f)`` intermediates.
- ``norm``: the two norms; keeps their inputs, drops their outputs (what the next projection
  saves is then the recomputed output).

Each recomputed module goes through the same ``checkpoint`` as full recompute, so the TP-aware
dropout streams replay and recomputed dropout masks equal the forward's (the default generator
is preserved by ``torch.utils.checkpoint`` itself). Forward-only passes (no grad) never
checkpoint.

Activation offload (plan ``layers[i].offload``, plan_offload.py) is the other per-module lever:
:class:`LayerLevers` runs a named module either recomputed or under
:class:`~megatron_auto.parallel.offload.ActivationOffload` (its saved activations on the host
until backward); the plan never asks for both on one module.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..parallel.offload import ActivationOffload
from ..parallel.random import RNGTracker, checkpoint
from ..plan_recompute import RecomputeValue, normalize_recompute, recompute_parts
from ..plan_offload import normalize_offload, offload_parts


def split_recompute(value: RecomputeValue | Any, what: str = "recompute"
                    ) -> tuple[bool, frozenset[str]]:
    """``(whole layer, modules)`` of any accepted plan value (``ValueError`` naming ``what``)."""
    return recompute_parts(normalize_recompute(value, what))


def whole_layer_only(value: RecomputeValue | Any, model: str) -> bool:
    """The whole-layer flag for layers that cannot recompute single modules (T5, Swin, TE):
    a module choice is refused with one line rather than silently run as full or none."""
    full, modules = split_recompute(value)
    if modules:
        raise ValueError(f"plan field recompute={sorted(modules)}: the {model} layer recomputes "
                         f"whole layers only; use true or false")
    return full


def run_module(modules: frozenset[str], name: str, rng: RNGTracker | None,
               fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, checkpointed (recomputed in backward) when ``name`` is in ``modules``."""
    if name in modules and torch.is_grad_enabled():
        return checkpoint(fn, rng, *args)
    return fn(*args)


def split_offload(value: Any, what: str = "offload") -> tuple[bool, frozenset[str]]:
    """``(whole layer, modules)`` of any accepted offload value (``ValueError`` naming ``what``)."""
    return offload_parts(normalize_offload(value, what))


class LayerLevers:
    """One layer's per-module memory choices: the modules that re-run in backward
    (``recompute``) and those whose saved activations wait on the host (``offload``)."""

    def __init__(self, recompute: frozenset[str] = frozenset(),
                 offload: frozenset[str] = frozenset(), rng: RNGTracker | None = None) -> None:
        both = sorted(recompute & offload)
        if both:
            raise ValueError(f"plan field offload={sorted(offload)}: module(s) {both} are "
                             f"recomputed too; name each module in one of the two lists")
        self.recompute, self.offload, self.rng = recompute, offload, rng
        self._offloaders: dict[torch.device, ActivationOffload] = {}

    def offloader(self, device: torch.device) -> ActivationOffload:
        """The saved-tensor hooks that move activations to the host, one per device (its side
        stream made once)."""
        if device not in self._offloaders:
            self._offloaders[device] = ActivationOffload(device)
        return self._offloaders[device]

    @property
    def offloaded_bytes(self) -> int:
        """Bytes moved to the host so far (all devices, all calls)."""
        return sum(o.offloaded_bytes for o in self._offloaders.values())

    def run(self, name: str, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` as the plan asks for module ``name``: recomputed, offloaded or plain.
        The device is the first tensor argument's."""
        if name in self.offload and torch.is_grad_enabled():
            device = next(a.device for a in args if isinstance(a, torch.Tensor))
            with self.offloader(device):
                return fn(*args)
        return run_module(self.recompute, name, self.rng, fn, *args)
