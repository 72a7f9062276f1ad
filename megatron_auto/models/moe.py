"""The mixture-of-experts block that replaces the MLP of an MoE layer (``--num-experts``).

``MoELayer(x) = sum_{e in topk(x)} w_e(x) * Expert_e(x)`` (plus ``SharedExperts(x)`` when
``--moe-shared-expert-intermediate-size`` is set), with the routing rules of
:class:`~megatron_auto.families.gpt.config.MoEConfig`: a linear router without bias, softmax
top-k (Mixtral's order, or Switch's with ``router_pre_softmax``) or sigmoid scores normalised
over the chosen experts (DeepSeek-V3), dropless dispatch or a per-sequence capacity.

Parameters (plan-independent names and global shapes, ``E`` experts, width ``f``):
``router.weight`` (E, h); ``experts.linear_fc1.weight`` (E, 2f, h) for SwiGLU (rows
interleaved ``gate_0, up_0, gate_1, ...`` as the dense MLP's) or (E, f, h) for GELU;
``experts.linear_fc2.weight`` (E, h, f); the shared experts are a dense MLP of width
``shared_expert_intermediate_size`` under ``shared_experts.`` (TP-split like the MLP). An
expert has no biases. The router is replicated on the layer's TP ranks (each computes the same
thing from the same replicated tokens), so its gradient needs no TP reduction, as the norms'
does not. The routed experts are too with ``expert_tp = 1``; with ``expert_tp > 1`` each
expert is split over ``expert_tp`` members of the TP group (fc1's output rows, fc2's input
columns: :class:`GroupedExperts`), and the ``tp / expert_tp`` such groups are replicas.

Routing runs in fp32 (outside autocast): ties and near-ties in the top-k must not depend on the
compute dtype. The experts run as grouped matmuls over the tokens sorted by expert
(:func:`grouped_linear`).

The auxiliary losses (load balancing, z-loss) are defined per sequence and averaged over the
global batch's sequences, so a plan that splits the batch differently sums the same terms
(docs/design.md §4). They never appear in the language-model loss value: their gradient is
injected in backward (:class:`_AttachAuxLoss`) scaled by the layer's ``aux_loss_scale``, which
the trainer sets to ``loss_scale / global_batch_size`` each step
(:func:`set_aux_loss_scale`); the data-parallel sum of gradients then gives the gradient of
``mean over sequences`` exactly as the language-model loss's. The layer also accumulates
detached statistics (:attr:`MoELayer.stats`: assignments per expert, the sums of the two losses
over this rank's sequences) for logging and for the tests that compare plans.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..parallel.context import ExpertGroups, LayerGroups
from ..parallel.expert_parallel import ExpertParallelDispatch
from ..parallel.mappings import copy_to_tensor_parallel, reduce_from_tensor_parallel
from .transformer import MLP

# Dispatch of the sorted tokens to the experts and back: ``(x_sorted, counts) -> y_sorted``
# for the tokens sorted by global expert with ``counts[e]`` rows for expert ``e``. One process
# (and ep = 1) runs the local experts on them directly; expert parallelism
# (parallel/expert_parallel.py) moves them to the ranks holding their experts and back.
Dispatch = Callable[[torch.Tensor, torch.Tensor, "GroupedExperts"], torch.Tensor]


class ExpertWeight(nn.Module):
    """One stacked weight of the routed experts, ``(E_local, out, in)``."""

    def __init__(self, num_experts: int, out_features: int, in_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, out_features, in_features))


def _grouped_mm_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` takes these operands: it exists (torch >= 2.8), the
    dtype is one its kernel has for the device (CUDA: bf16, sm90+; CPU: fp32 is accepted), and
    every row stride is a multiple of 16 bytes (its kernel's alignment rule)."""
    fn = getattr(torch, "_grouped_mm", None)
    if fn is None:
        return False
    if not ((x.device.type == "cpu" and x.dtype == torch.float32)
            or (x.device.type == "cuda" and x.dtype == torch.bfloat16)):
        return False
    size = x.element_size()
    return (x.shape[-1] * size) % 16 == 0 and (weight.shape[1] * size) % 16 == 0


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient: ``torch._grouped_mm``'s backward
    refuses expanded (stride-0) gradients, which e.g. ``y.sum()`` produces."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``y[rows of e] = x[rows of e] @ weight[e]^T`` for rows sorted by expert, ``counts[e]``
    rows for expert ``e``; ``x`` (N, in), ``weight`` (E, out, in) -> (N, out).

    One grouped GEMM (``torch._grouped_mm``) where the operands fit it, else one matmul per
    expert over its contiguous rows: torch has no public grouped GEMM, and the private one
    needs 16-byte-aligned rows and, on CUDA, bf16. A padded ``bmm`` would avoid the loop but
    costs ``E * max(counts)`` rows of memory and compute, which an unbalanced router makes
    many times the real work; the loop does only the real work, ``E`` kernel launches.
    """
    if x.shape[0] and _grouped_mm_fits(x, weight):
        offsets = torch.cumsum(counts, 0).to(torch.int32)
        return _ContiguousGrad.apply(torch._grouped_mm(x, weight.transpose(1, 2), offs=offsets))
    parts = torch.split(x, counts.tolist())
    return torch.cat([F.linear(part, weight[e]) for e, part in enumerate(parts)]
                     + [x.new_zeros(0, weight.shape[1])])


class GroupedExperts(nn.Module):
    """``E_local`` routed experts (SwiGLU or GELU MLPs without biases) run as grouped matmuls."""

    def __init__(self, config: ModelConfig, num_local_experts: int, ffn: int,
                 expert_tp_group: Any = None) -> None:
        super().__init__()
        h = config.hidden_size
        self.swiglu = config.activation == "swiglu"
        self.gelu_approximate = "tanh" if config.openai_gelu else "none"
        self.num_local_experts = num_local_experts
        # expert TP (``ffn`` is then this rank's share of the width): fc1's output rows and
        # fc2's input columns are split, the input copied into and fc2's output summed out of
        # the expert-TP group, a column- and a row-parallel linear as the dense MLP's
        self.expert_tp_group = expert_tp_group
        self.linear_fc1 = ExpertWeight(num_local_experts, 2 * ffn if self.swiglu else ffn, h)
        self.linear_fc2 = ExpertWeight(num_local_experts, h, ffn)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``x`` (N, h) sorted by local expert, ``counts`` (E_local,) rows each -> (N, h)."""
        group = self.expert_tp_group
        if group is not None:
            x = copy_to_tensor_parallel(x, group)
        w1, w2 = self.linear_fc1.weight, self.linear_fc2.weight
        if x.dtype != w1.dtype and torch.is_autocast_enabled(x.device.type):
            # autocast does not cover the private grouped GEMM: cast the weights as it would
            w1, w2 = w1.to(x.dtype), w2.to(x.dtype)
        y = grouped_linear(x, w1, counts)
        if self.swiglu:
            y = y.unflatten(-1, (-1, 2))  # (N, f, 2): rows interleave (gate, up)
            y = F.silu(y[..., 0]) * y[..., 1]
        else:
            y = F.gelu(y, approximate=self.gelu_approximate)
        y = grouped_linear(y, w2, counts)
        return y if group is None else reduce_from_tensor_parallel(y, group)


class _AttachAuxLoss(torch.autograd.Function):
    """Identity on ``out`` whose backward also gives ``aux`` the gradient ``scale``: the
    auxiliary losses join the backward pass without entering the language-model loss."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        ctx.aux_shape = aux.shape
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        return grad, torch.full(ctx.aux_shape, ctx.scale, dtype=torch.float32,
                                device=grad.device), None


def _in_backward() -> bool:
    """Whether autograd is running a backward pass now (a recompute re-running the forward)."""
    return torch._C._current_graph_task_id() != -1


class Routing:
    """One micro-batch's routing: per token its ``k`` experts, their weights and whether each
    assignment survives the capacity (all True when dropless), plus the auxiliary losses."""

    def __init__(self, experts: torch.Tensor, weights: torch.Tensor, keep: torch.Tensor,
                 aux: torch.Tensor, aux_terms: torch.Tensor) -> None:
        self.experts, self.weights, self.keep = experts, weights, keep  # (b, s, k) each
        self.aux = aux  # scalar: the sum of the per-sequence auxiliary losses (coefficients in)
        self.aux_terms = aux_terms  # (2,) detached: sums of the balance and z terms


def route(logits: torch.Tensor, config: ModelConfig) -> Routing:
    """The routing rules of ``config.moe`` on fp32 ``logits`` (b, s, E)."""
    moe = config.moe
    assert moe is not None
    b, s, num_experts = logits.shape
    k = moe.router_topk
    if moe.router_score_function == "sigmoid":
        scores = torch.sigmoid(logits)
        top, experts = torch.topk(scores, k, dim=-1)
        weights = top / (top.sum(-1, keepdim=True) + 1e-20) if k > 1 else top
        balance_scores = scores / (scores.sum(-1, keepdim=True) + 1e-20)
    else:
        probs = torch.softmax(logits, dim=-1)
        if moe.router_pre_softmax:
            weights, experts = torch.topk(probs, k, dim=-1)
        else:
            top, experts = torch.topk(logits, k, dim=-1)
            weights = torch.softmax(top, dim=-1)
        balance_scores = probs
    routed = torch.zeros_like(logits, dtype=torch.bool).scatter_(-1, experts, True)
    keep = torch.ones_like(experts, dtype=torch.bool)
    if moe.expert_capacity_factor is not None:
        capacity = min(s, math.ceil(moe.expert_capacity_factor * s * k / num_experts))
        dense = torch.zeros_like(logits).scatter_(-1, experts, weights.detach())
        ranked = torch.where(routed, dense, torch.full_like(dense, -1.0))
        # per sequence and expert the `capacity` heaviest, ties to the earlier token (a
        # stable sort: top-1 softmax weights are all 1, and ties must not depend on the plan)
        chosen = torch.sort(ranked, dim=1, descending=True, stable=True).indices[:, :capacity]
        kept = torch.zeros_like(routed).scatter_(1, chosen, True) & routed
        keep = kept.gather(-1, experts)
    zero = logits.new_zeros(())
    balance = z = zero
    if moe.aux_loss_coeff > 0:
        # per sequence: E * sum_e (share of the k*s assignments to e) * (mean score of e)
        share = routed.float().sum(1) / (s * k)  # (b, E)
        balance = (num_experts * (share * balance_scores.mean(1)).sum(-1)).sum()
    if moe.z_loss_coeff is not None and moe.z_loss_coeff > 0:
        z = torch.logsumexp(logits, dim=-1).square().mean(1).sum()  # per sequence, summed
    aux = moe.aux_loss_coeff * balance + (moe.z_loss_coeff or 0.0) * z
    return Routing(experts, weights, keep, aux, torch.stack([balance, z]).detach())


def local_dispatch(x: torch.Tensor, counts: torch.Tensor, experts: "GroupedExperts"
                   ) -> torch.Tensor:
    """ep = 1: every expert is here."""
    return experts(x, counts)


class MoELayer(nn.Module):
    """The MoE block of one layer on ``groups`` (see the module docstring); input and output
    (b/dp, s, h), replicated over the layer's TP group."""

    def __init__(self, config: ModelConfig, groups: LayerGroups, *,
                 expert_groups: ExpertGroups | None = None) -> None:
        super().__init__()
        moe = config.moe
        if moe is None:
            raise ValueError("MoELayer needs an MoE model config (--num-experts)")
        self.config = config
        self.num_experts = moe.num_experts
        self.router = nn.Module()
        self.router.weight = nn.Parameter(torch.empty(moe.num_experts, config.hidden_size))
        ep = 1 if expert_groups is None else expert_groups.ep_size
        etp = 1 if expert_groups is None else expert_groups.expert_tp_size
        self.experts = GroupedExperts(
            config, moe.num_experts // ep, config.expert_ffn_hidden_size // etp,
            expert_groups.expert_tp_group if expert_groups is not None and etp > 1 else None)
        dispatch: Dispatch = local_dispatch
        if expert_groups is not None:
            # the experts' own data-parallel groups (DataParallel reads them) and, with ep > 1,
            # their EP shards: chunk ep_rank of dim 0 (init and gathering read tp_shard_dims)
            self.experts.expert_groups = expert_groups
            if ep > 1:
                dispatch = ExpertParallelDispatch(expert_groups, moe.num_experts)
                for weight in (self.experts.linear_fc1, self.experts.linear_fc2):
                    weight.tp_shard_dims = {"weight": 0}
                    weight.tp_size, weight.tp_rank = ep, expert_groups.ep_rank
                    weight.tp_group = expert_groups.ep_group
            if etp > 1:
                # expert-TP shards of each expert, inside the EP chunk: fc1's rows (dim 1; a
                # contiguous chunk of the interleaved SwiGLU rows keeps every (gate, up) pair
                # together, as the dense column-parallel split does), fc2's columns (dim 2)
                for weight, dim in ((self.experts.linear_fc1, 1), (self.experts.linear_fc2, 2)):
                    weight.inner_shard_dims = {"weight": dim}
                    weight.inner_size, weight.inner_rank = etp, expert_groups.expert_tp_rank
                    weight.inner_group = expert_groups.expert_tp_group
        self.shared_experts = (MLP(config, groups,
                                   ffn_hidden_size=moe.shared_expert_intermediate_size)
                               if moe.shared_expert_intermediate_size else None)
        self.dispatch = dispatch
        self.aux_loss_scale = 1.0  # set_aux_loss_scale: the trainer's loss_scale / batch
        self.register_buffer("tokens_per_expert", torch.zeros(moe.num_experts,
                                                              dtype=torch.float64),
                             persistent=False)
        self.register_buffer("aux_sums", torch.zeros(3, dtype=torch.float64), persistent=False)

    @property
    def stats(self) -> dict[str, torch.Tensor]:
        """Since the last :meth:`reset_stats`, over this rank's forwards (recomputes not
        counted): kept assignments per expert, and sums over sequences of the balance loss and
        of the z-loss (without coefficients) with the sequence count."""
        return {"tokens_per_expert": self.tokens_per_expert.clone(),
                "balance_sum": self.aux_sums[0].clone(), "z_sum": self.aux_sums[1].clone(),
                "sequences": self.aux_sums[2].clone()}

    def reset_stats(self) -> None:
        self.tokens_per_expert.zero_()
        self.aux_sums.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        with torch.autocast(x.device.type, enabled=False):
            logits = F.linear(x.float(), self.router.weight.float())
        routing = route(logits, self.config)
        k = routing.experts.shape[-1]
        flat_experts = routing.experts.reshape(-1)
        keep = routing.keep.reshape(-1)
        token_of = torch.arange(b * s, device=x.device).repeat_interleave(k)
        assigned = keep.nonzero().squeeze(1)  # kept assignments, token-major
        # sort the kept assignments by expert (stable: token order within an expert)
        order = assigned[torch.argsort(flat_experts[assigned], stable=True)]
        counts = torch.bincount(flat_experts[order], minlength=self.num_experts)
        if not _in_backward():
            with torch.no_grad():
                self.tokens_per_expert += counts.to(torch.float64)
                self.aux_sums += torch.cat([routing.aux_terms.to(torch.float64),
                                            torch.tensor([float(b)], dtype=torch.float64,
                                                         device=x.device)])
        tokens = x.reshape(b * s, h)
        y = self.dispatch(tokens[token_of[order]], counts, self.experts)
        weights = routing.weights.reshape(-1)[order].to(y.dtype)
        out = torch.zeros_like(tokens, dtype=y.dtype).index_add_(0, token_of[order],
                                                                  y * weights.unsqueeze(1))
        out = out.view(b, s, h)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        if routing.aux.requires_grad:
            out = _AttachAuxLoss.apply(out, routing.aux, float(self.aux_loss_scale))
        return out


def moe_layers(root: nn.Module) -> list[MoELayer]:
    """The MoE blocks under ``root`` in module order."""
    return [m for m in root.modules() if isinstance(m, MoELayer)]


def set_aux_loss_scale(root: nn.Module, scale: float) -> None:
    """The gradient every MoE block under ``root`` gives its summed auxiliary loss: the
    trainer's ``loss_scale / global_batch_size`` (one mean over the global batch's sequences)."""
    for layer in moe_layers(root):
        layer.aux_loss_scale = scale
