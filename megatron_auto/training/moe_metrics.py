"""The MoE router's statistics of an iteration, for the console line and the metrics file.

Every MoE block counts, over this rank's forwards of one ``train_step`` (recomputes left out,
:attr:`~megatron_auto.models.moe.MoELayer.stats`), the kept assignments per expert and the sums
over its sequences of the load-balancing loss and the z-loss (without their coefficients).
:func:`moe_step_metrics` sums those over the ranks that together see every sequence of the
global batch once (TP rank 0 of each MoE layer: the router is replicated over TP, so the other
TP ranks repeat the same numbers) and turns them into plan-independent values
(docs/design.md §5.3):

- ``moe_aux_loss``: the load-balancing loss, its mean over the global batch's sequences, then
  over the MoE layers (Megatron logs the same mean as ``load_balancing_loss``); only when
  ``--moe-aux-loss-coeff`` is positive.
- ``moe_z_loss``: the router z-loss, the same means; only when ``--moe-z-loss-coeff`` is set.
- ``moe_tokens_per_expert``: per MoE layer (in layer order) the kept assignments per expert.

The pretraining loop averages the two losses over the iterations of a log interval, as the
language-model loss, and sums the counts.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..config import ModelConfig
from ..models.moe import MoELayer
from ..parallel.context import ParallelContext


def _layer_index(name: str) -> int:
    """Global layer index of a module named ``...layers.<i>...`` (the stage's layer table)."""
    parts = name.split(".")
    for before, part in zip(parts, parts[1:]):
        if before == "layers" and part.isdigit():
            return int(part)
    raise ValueError(f"MoE block {name!r} is not under a 'layers.<index>' module")


def moe_step_metrics(stage: nn.Module, ctx: ParallelContext, config: ModelConfig
                     ) -> dict[str, Any]:
    """Collective over the world: the statistics of the MoE blocks since their last
    ``reset_stats`` (see the module docstring); ``{}`` for a model without MoE."""
    moe = getattr(config, "moe", None)  # the vision and T5 configs have no MoE at all
    if moe is None:
        return {}
    indices = list(config.moe_layers)
    row = {index: r for r, index in enumerate(indices)}
    # per MoE layer: tokens per expert, balance sum, z sum, sequences
    table = torch.zeros(len(indices), moe.num_experts + 3, dtype=torch.float64,
                        device=ctx.device)
    for name, module in stage.named_modules():
        if not isinstance(module, MoELayer):
            continue
        index = _layer_index(name)
        if ctx.layer_groups(index).tp_rank != 0:
            continue
        stats = module.stats
        table[row[index]] += torch.cat([
            stats["tokens_per_expert"].to(table.device),
            torch.stack([stats["balance_sum"], stats["z_sum"],
                         stats["sequences"]]).to(table.device)])
    dist.all_reduce(table)
    sequences = table[:, -1].clamp(min=1.0)
    out: dict[str, Any] = {}
    if moe.aux_loss_coeff > 0:
        out["moe_aux_loss"] = float((table[:, -3] / sequences).mean())
    if moe.z_loss_coeff is not None and moe.z_loss_coeff > 0:
        out["moe_z_loss"] = float((table[:, -2] / sequences).mean())
    out["moe_tokens_per_expert"] = [[int(round(c)) for c in counts]
                                    for counts in table[:, :-3].tolist()]
    return out


def window_moe_metrics(steps: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One log interval's record: the losses averaged over its iterations, the counts summed."""
    if not steps or not steps[0]:
        return {}
    out: dict[str, Any] = {}
    for key in ("moe_aux_loss", "moe_z_loss"):
        if key in steps[0]:
            out[key] = sum(s[key] for s in steps) / len(steps)
    counts = [s["moe_tokens_per_expert"] for s in steps]
    out["moe_tokens_per_expert"] = [[sum(step[layer][e] for step in counts)
                                     for e in range(len(counts[0][layer]))]
                                    for layer in range(len(counts[0]))]
    return out


def console_parts(metrics: Mapping[str, Any]) -> list[str]:
    """The console line's MoE fields, named as Megatron's (``load_balancing_loss: ...``); the
    expert counts summed over the MoE layers."""
    parts = []
    if "moe_aux_loss" in metrics:
        parts.append(f"load_balancing_loss: {metrics['moe_aux_loss']:.6E}")
    if "moe_z_loss" in metrics:
        parts.append(f"z_loss: {metrics['moe_z_loss']:.6E}")
    if "moe_tokens_per_expert" in metrics:
        per_layer = metrics["moe_tokens_per_expert"]
        totals = [sum(layer[e] for layer in per_layer) for e in range(len(per_layer[0]))]
        parts.append("tokens per expert: " + ",".join(str(t) for t in totals))
    return parts
