"""What autograd keeps for backward, in bytes, split into TP-sharded and replicated parts.

:class:`SavedTensorMeter` wraps a forward pass in ``torch.autograd.graph.saved_tensors_hooks``
and adds up the distinct storages that autograd saves (rounded to the CUDA allocator's 512-byte
block, like ``parallel.memory``), leaving out storages that existed before (parameters, the
layer's input). Counting saved storages instead of watching an allocator makes the number the
same on CPU and GPU and independent of other tensors alive at the time.

Each saved storage is attributed by a *classifier* to the part that tensor parallelism splits
(``split``: divided by ``tp``) or the part every TP rank holds (``replicated``).
:func:`transformer_classifier` encodes the Megatron layout of our TransformerLayer, decided by
the innermost module running when the tensor is saved:

- a row-parallel linear saves its input: the attention context / MLP intermediate, split;
- the attention and MLP bodies (SDPA, its dropout, the activation function): per-head or
  per-FFN-column tensors, split;
- a column-parallel linear saves its (replicated) input; norms, residual adds and the hidden
  dropout masks work on the full ``(b, s, h)``: replicated.

Tensors that ``torch.utils.checkpoint`` keeps are held by its frame, not saved through these
hooks (its own hooks take precedence), so a recomputing layer shows only what it adds beyond
its input; callers add the layer's output themselves (:meth:`add_output`).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
from torch import nn

from ..models.transformer import MLP, SelfAttention
from ..parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from ..parallel.memory import ALLOCATOR_BLOCK_BYTES

Classifier = Callable[[torch.Tensor, "nn.Module | None"], bool]  # True = TP-split


def _rounded(nbytes: int) -> int:
    return -(-nbytes // ALLOCATOR_BLOCK_BYTES) * ALLOCATOR_BLOCK_BYTES if nbytes else 0


def _key(t: torch.Tensor) -> int:
    storage = t.untyped_storage()
    return storage.data_ptr() if storage.nbytes() else id(storage)


def transformer_classifier(t: torch.Tensor, module: nn.Module | None) -> bool:
    """TP-split iff saved by a row-parallel linear or inside the attention / MLP body."""
    if isinstance(module, RowParallelLinear):
        return True
    if isinstance(module, ColumnParallelLinear):
        return False
    return isinstance(module, (SelfAttention, MLP))


def vocab_classifier(vocab_size: int) -> Classifier:
    """Head/loss tensors over the vocabulary (logits, softmax) are split by vocab TP."""
    return lambda t, module: t.dim() > 0 and t.shape[-1] == vocab_size


class SavedTensorMeter:
    """Bytes autograd saves during the ``with`` block, by part. Not re-entrant.

    ::

        meter = SavedTensorMeter(layer, exclude=[x], classifier=transformer_classifier)
        with meter:
            y = layer(x)
        meter.add_output(y)
        meter.split_bytes, meter.replicated_bytes
    """

    def __init__(self, root: nn.Module, *, exclude: Iterable[torch.Tensor] = (),
                 classifier: Classifier = transformer_classifier) -> None:
        self.root = root
        self.classifier = classifier
        self._excluded = {_key(p) for p in root.parameters()} | {_key(t) for t in exclude}
        self._seen: dict[int, tuple[int, bool]] = {}
        self._stack: list[nn.Module] = []
        self._handles: list[Any] = []
        self._hooks: Any = None

    # ---------------------------------------------------------------- results
    @property
    def split_bytes(self) -> int:
        return sum(n for n, split in self._seen.values() if split)

    @property
    def replicated_bytes(self) -> int:
        return sum(n for n, split in self._seen.values() if not split)

    @property
    def total_bytes(self) -> int:
        return self.split_bytes + self.replicated_bytes

    def add_output(self, output: torch.Tensor, split: bool = False) -> None:
        """Count the forward's output (the next layer's input) unless it was saved already."""
        key = _key(output)
        if key not in self._excluded and key not in self._seen:
            self._seen[key] = (_rounded(output.untyped_storage().nbytes()), split)

    # ---------------------------------------------------------------- hooks
    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        key = _key(t)
        if key not in self._excluded and key not in self._seen:
            module = self._stack[-1] if self._stack else None
            self._seen[key] = (_rounded(t.untyped_storage().nbytes()),
                               bool(self.classifier(t, module)))
        return t

    def __enter__(self) -> "SavedTensorMeter":
        def enter(module: nn.Module, args: Any) -> None:
            self._stack.append(module)

        def leave(module: nn.Module, args: Any, output: Any) -> None:  # None: keep the output
            self._stack.pop()

        for module in self.root.modules():
            self._handles.append(module.register_forward_pre_hook(enter))
            self._handles.append(module.register_forward_hook(leave))
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._stack = []
