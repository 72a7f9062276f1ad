"""A census of every collective a rank issues, read off the dispatcher (for tests).

:func:`census` opens a ``TorchDispatchMode`` that sees every ``torch.distributed`` operation at
the dispatcher, whichever Python API issued it: ``dist.all_reduce``, FSDP2's gathers, each
``isend``/``irecv`` inside ``batch_isend_irecv`` (one ``c10d.send``/``c10d.recv_`` each),
DTensor's and anyone's functional collectives (``_c10d_functional``). Each call becomes one
:class:`Call`: its kind, the global ranks of its group, its bytes, dtype and (p2p) peer.

Adding a collective kind (context parallelism's ring p2p or all-to-all, MoE's all-to-all, ...):

1. the dispatcher ops that issue it: one row in :data:`OPS` each, ``op name -> Op(kind,
   tensor)``; ``tensor`` names the argument whose bytes count (the unsharded one: a gather's
   output, a reduce-scatter's input, otherwise the buffer). An op of the c10d namespaces that
   is in neither :data:`OPS` nor :data:`NOT_COMMUNICATION` is recorded as ``unknown:<op>``, so
   a test that compares against the cost model fails on it rather than missing it;
2. the cost model's kind for it: one entry in :data:`PRICED_AS` (``Collective.kind`` ->
   census kind; e.g. ``zero_gather`` is an ``all_gather`` on the wire);
3. the planner lists it (``planner/cost/census.py``'s ``rank_collectives``, what the time
   model prices), and tests/test_collective_count.py compares the two.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode


@dataclass(frozen=True)
class Op:
    """How to read one dispatcher op: its census ``kind`` and the argument whose bytes count."""

    kind: str
    tensor: str


OPS: dict[str, Op] = {
    # torch.distributed's process-group API (c10d)
    "c10d::allreduce_": Op("all_reduce", "tensors"),
    "c10d::allreduce_coalesced_": Op("all_reduce", "tensors"),
    "c10d::_allgather_base_": Op("all_gather", "output_tensor"),
    "c10d::allgather_": Op("all_gather", "output_tensors"),
    "c10d::allgather_coalesced_": Op("all_gather", "output_lists"),
    "c10d::allgather_into_tensor_coalesced_": Op("all_gather", "outputs"),
    "c10d::_reduce_scatter_base_": Op("reduce_scatter", "input_tensor"),
    "c10d::reduce_scatter_": Op("reduce_scatter", "input_tensors"),
    "c10d::reduce_scatter_tensor_coalesced_": Op("reduce_scatter", "inputs"),
    "c10d::broadcast_": Op("broadcast", "tensors"),
    "c10d::reduce_": Op("reduce", "tensors"),
    "c10d::gather_": Op("gather", "input_tensors"),
    "c10d::scatter_": Op("scatter", "output_tensors"),
    "c10d::alltoall_": Op("all_to_all", "input_tensors"),
    "c10d::alltoall_base_": Op("all_to_all", "input"),
    "c10d::send": Op("send", "tensors"),
    "c10d::recv_": Op("recv", "tensors"),
    "c10d::recv_any_source_": Op("recv", "tensors"),
    "c10d::barrier": Op("barrier", "tensor"),
    "c10d::monitored_barrier_": Op("barrier", "tensor"),
    # functional collectives (DTensor, torch.compile'd code)
    "_c10d_functional::all_reduce": Op("all_reduce", "input"),
    "_c10d_functional::all_reduce_": Op("all_reduce", "input"),
    "_c10d_functional::all_reduce_coalesced": Op("all_reduce", "inputs"),
    "_c10d_functional::all_reduce_coalesced_": Op("all_reduce", "inputs"),
    "_c10d_functional::all_gather_into_tensor": Op("all_gather", "input*group_size"),
    "_c10d_functional::all_gather_into_tensor_out": Op("all_gather", "out"),
    "_c10d_functional::all_gather_into_tensor_coalesced": Op("all_gather", "inputs*group_size"),
    "_c10d_functional::reduce_scatter_tensor": Op("reduce_scatter", "input"),
    "_c10d_functional::reduce_scatter_tensor_out": Op("reduce_scatter", "input"),
    "_c10d_functional::reduce_scatter_tensor_coalesced": Op("reduce_scatter", "inputs"),
    "_c10d_functional::broadcast": Op("broadcast", "input"),
    "_c10d_functional::broadcast_": Op("broadcast", "input"),
    "_c10d_functional::all_to_all_single": Op("all_to_all", "input"),
    "_c10d_functional::isend": Op("send", "tensor"),
    "_c10d_functional::irecv": Op("recv", "tensor"),
    "_c10d_functional::batch_p2p_ops": Op("p2p_batch", "tensors"),
}
# Dispatcher ops of those namespaces that move no data.
NOT_COMMUNICATION = frozenset({"c10d::check_for_nan", "_c10d_functional::wait_tensor",
                               "_c10d_functional::_wrap_tensor_autograd"})
NAMESPACES = ("c10d", "_c10d_functional", "_c10d_functional_autograd")

# The cost model's ``Collective.kind`` -> the census kind it is on the wire.
PRICED_AS: dict[str, str] = {
    "all_gather": "all_gather", "zero_gather": "all_gather",
    "reduce_scatter": "reduce_scatter", "zero_scatter": "reduce_scatter",
    "all_reduce": "all_reduce", "send": "send", "recv": "recv", "all_to_all": "all_to_all",
}


@dataclass(frozen=True)
class Call:
    """One collective as issued: ``ranks`` of its group (global, sorted as the group lists
    them), ``nbytes`` of its counted tensor(s), ``peer`` the other end's global rank (p2p)."""

    kind: str
    ranks: tuple[int, ...]
    nbytes: int
    dtype: str
    peer: int | None = None
    op: str = ""

    @property
    def group_size(self) -> int:
        return len(self.ranks)

    @property
    def consecutive(self) -> bool:
        """Whether the group is a block of adjacent ranks (how the cost model places it)."""
        return sorted(self.ranks) == list(range(min(self.ranks),
                                                min(self.ranks) + len(self.ranks)))


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _group_ranks(group: Any) -> tuple[int, ...]:
    if isinstance(group, str):  # functional collectives name their group
        group = dist.distributed_c10d._resolve_process_group(group)
    elif not isinstance(group, dist.ProcessGroup):  # the dispatcher's boxed ScriptObject
        group = dist.ProcessGroup.unbox(group)
    return tuple(dist.get_process_group_ranks(group))


class _Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[Call] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        kwargs = kwargs or {}
        if func.namespace in NAMESPACES:
            self._record(func, args, kwargs)
        return func(*args, **kwargs)

    def _record(self, func: Any, args: Any, kwargs: Any) -> None:
        name = func._schema.name
        if name in NOT_COMMUNICATION:
            return
        bound = dict(zip((a.name for a in func._schema.arguments), args))
        bound.update(kwargs)
        group = bound.get("process_group", bound.get("group_name"))
        ranks = _group_ranks(group) if group is not None else ()
        op = OPS.get(name)
        if op is None:
            self.calls.append(Call(f"unknown:{name}", ranks, 0, "", op=name))
            return
        if op.kind == "p2p_batch":  # functional batch: one send or recv per entry
            for what, peer, tensor in zip(bound["op_list"], bound["peer_list"],
                                          bound["tensors"]):
                self.calls.append(Call("send" if "send" in what else "recv", ranks,
                                       tensor.numel() * tensor.element_size(),
                                       str(tensor.dtype), ranks[peer], name))
            return
        arg, _, times = op.tensor.partition("*")
        tensors = _tensors(bound[arg])
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        if times:
            nbytes *= int(bound[times])
        peer = None
        for key in ("dst", "src"):
            if key in bound and op.kind in ("send", "recv"):
                peer = ranks[bound[key]]
        self.calls.append(Call(op.kind, ranks, nbytes,
                               str(tensors[0].dtype) if tensors else "", peer, name))


@contextlib.contextmanager
def census() -> Iterator[list[Call]]:
    """Record every collective this rank issues while open, in issue order."""
    recorder = _Recorder()
    with recorder:
        yield recorder.calls


def gpt_step_census(config: Any, plan: Any, *, bf16: bool = False, steps: int = 2,
                    **trainer_options: Any) -> list[list[Call]]:
    """The census of ``steps`` training steps of a GPT trainer built for ``plan`` (constant
    lr, seed 1234) on one fixed batch of 8 random samples: one list of calls per step."""
    from megatron_auto.models.gpt import GPTStage
    from megatron_auto.training.lr_scheduler import LRConfig
    from megatron_auto.training.precision import PrecisionConfig
    from megatron_auto.training.trainer import build_trainer, train_step

    trainer = build_trainer(config, plan, lambda cfg, ctx, seed: GPTStage(cfg, ctx, seed=seed),
                            lr_config=LRConfig(lr=1e-3, decay_style="constant"),
                            precision=PrecisionConfig(bf16=bf16), seed=1234, **trainer_options)
    gen = torch.Generator().manual_seed(7)
    s = config.seq_length
    tokens = torch.randint(0, config.vocab_size, (8, s + 1), generator=gen)
    batch = {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
             "loss_mask": torch.ones(8, s),
             "position_ids": torch.arange(s).expand(8, -1).contiguous()}
    iterations = []
    for _ in range(steps):
        with census() as calls:
            train_step(trainer, batch if trainer.reads_data else None)
        iterations.append(calls)
    return iterations
