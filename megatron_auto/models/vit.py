"""Image classifiers under any plan: the shared :class:`VisionStage`, and the ViT backbone.

A vision stage follows the conventions of :class:`~megatron_auto.models.gpt.GPTStage`: each rank
builds only its pipeline stage's layers (``self.layers``, keyed by the global layer index),
parameter FQNs and global shapes never depend on the plan, every parameter is the TP shard of a
full tensor drawn from ``(seed, fqn)``, and ``relayout`` moves the batch chunks whenever the
layout changes between layers.

Non-layer parts take the plan's ``vocab`` entry (its TP degree decides their layout and DP group;
its dp_mode their data parallelism): the patch embedding (``embedding``, first stage) and the
classification head (``head``: final norm and a linear layer, last stage). Both are small and
replicated over the vocab TP group, as in Megatron-LM's ViT, so any vocab TP degree is valid.

ViT (:class:`ViTStage`): the image is cut into ``p x p`` patches, each flattened in
``(channel, row, column)`` order (the layout of a ``Conv2d(C, h, p, stride=p)`` weight) and
projected to ``h``; a learned class token is prepended and learned position embeddings
``(patches + 1, h)`` are added; then ``num_layers`` bidirectional pre-norm
:class:`~megatron_auto.models.transformer.TransformerLayer` s (TP splits heads and FFN exactly as
for GPT); the head reads the normalised class token.

Loss: the last stage returns ``(sum of per-image cross entropy x loss_mask, sum of loss_mask)``
over its batch chunk; the schedule divides by the global count. ``last_losses`` carries
``correct`` (top-1 hits) and ``num_samples`` for the accuracy log.
"""

from __future__ import annotations

import abc

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..layout import StageLayout, received_layout
from ..parallel.context import LayerGroups, ParallelContext
from ..plan import Plan
from ..parallel.random import RNGTracker, replicated_dropout
from ..parallel.redistribute import batch_chunk, relayout
from ..families.vision.config import VisionConfig
from .init import collect_shard_specs, init_parameters
from .stage import PipelineStage, refuse_interleaving_and_sequence_parallel
from .transformer import TransformerLayer


def layer_model_config(config: VisionConfig, hidden: int, heads: int, ffn: int,
                       seq: int) -> ModelConfig:
    """The :class:`ModelConfig` of one encoder layer shape (what the transformer layer reads).

    ``num_layers`` is the whole model's, so the scaled init of residual output projections
    (std / sqrt(2L)) is the same for every layer whatever the stage.
    """
    return ModelConfig(num_layers=config.num_layers, hidden_size=hidden,
                       num_attention_heads=heads, ffn_hidden_size=ffn, seq_length=seq,
                       vocab_size=1, make_vocab_size_divisible_by=1,
                       hidden_dropout=config.hidden_dropout,
                       attention_dropout=config.attention_dropout,
                       layernorm_epsilon=config.layernorm_epsilon,
                       init_method_std=config.init_method_std, model_type="bert")


def patchify(images: torch.Tensor, patch: int) -> torch.Tensor:
    """(b, C, H, W) -> (b, H/p * W/p, C*p*p): patches row-major, each in (C, p, p) order."""
    b, c, h, w = images.shape
    x = images.reshape(b, c, h // patch, patch, w // patch, patch)
    return x.permute(0, 2, 4, 1, 3, 5).reshape(b, (h // patch) * (w // patch), c * patch * patch)


def _refuse_unsupported(plan: Plan) -> None:
    """Vision stages run neither sequence parallelism nor the interleaved schedule yet."""
    refuse_interleaving_and_sequence_parallel(plan, "the vision models run only",
                                              "the vision models do not run")


class PatchEmbedding(nn.Module):
    """Patch projection (+ class token and learned positions for ViT, + norm for Swin)."""

    def __init__(self, config: VisionConfig, rng: RNGTracker | None) -> None:
        super().__init__()
        h = config.embedding_hidden_size
        self.patch_dim = config.patch_dim
        self.proj = nn.Linear(config.patch_size_flat, h)
        if config.class_token:
            self.cls_token = nn.Parameter(torch.empty(1, 1, h))
            self.position_embeddings = nn.Parameter(torch.empty(config.seq_length, h))
            self.norm = None
        else:
            self.cls_token = self.position_embeddings = None
            self.norm = nn.LayerNorm(h, eps=config.layernorm_epsilon)
        self.dropout = config.hidden_dropout
        self.rng = rng

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """images (b, C, H, W) -> tokens (b, s, h), replicated over the vocab TP group."""
        x = self.proj(patchify(images.to(self.proj.weight.dtype), self.patch_dim))
        if self.cls_token is not None:
            x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
            x = x + self.position_embeddings
        if self.norm is not None:
            x = self.norm(x)
        return replicated_dropout(x, self.dropout, self.rng, self.training)


class ClassificationHead(nn.Module):
    """Final norm, pooling (ViT: the class token; Swin: the mean token) and a linear layer."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        h = config.final_hidden_size
        self.final_norm = nn.LayerNorm(h, eps=config.layernorm_epsilon)
        self.output_layer = nn.Linear(h, config.num_classes)
        self.pool_cls = config.class_token

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (b, s, h) -> logits (b, num_classes)."""
        x = self.final_norm(hidden)
        x = x[:, 0] if self.pool_cls else x.mean(dim=1)
        return self.output_layer(x)


class VisionStage(PipelineStage, abc.ABC):
    """One pipeline stage of an image classifier; subclasses build the layers."""

    def __init__(self, config: VisionConfig, ctx: ParallelContext, *, seed: int = 1234) -> None:
        super().__init__(config, ctx, seed)
        plan = ctx.plan
        _refuse_unsupported(plan)
        self.layer_ids = list(plan.stage_layer_range(ctx.stage))
        self._layer_groups = {i: ctx.layer_groups(i) for i in self.layer_ids}
        if self.is_first_stage:
            self.embedding = PatchEmbedding(config, self.rng)
        self.layers = nn.ModuleDict({
            str(i): self.build_layer(i, self._layer_groups[i], plan.layers[i].recompute)
            for i in self.layer_ids})
        if self.is_last_stage:
            self.head = ClassificationHead(config)
        self.input_layout: StageLayout | None = received_layout(plan, ctx.stage)
        self.output_layout: StageLayout | None = (
            None if self.is_last_stage else self._layer_groups[self.layer_ids[-1]].layout)
        self.last_losses: dict[str, torch.Tensor] = {}
        self.shard_specs = collect_shard_specs(self)
        seq, hidden, heads, ffn = config.layer_shape(0)
        init_parameters(self, layer_model_config(config, hidden, heads, ffn, seq), seed,
                        self.shard_specs)
        self.to(ctx.device)

    @abc.abstractmethod
    def build_layer(self, index: int, groups: LayerGroups, recompute: bool) -> nn.Module:
        """Layer ``index`` of the backbone on ``groups`` (its layout); ViT and Swin differ here."""

    # ------------------------------------------------------------------ shapes
    def _chunk_shape(self, microbatch_size: int, layout: StageLayout,
                     layer: int) -> tuple[int, ...]:
        dp = self.ctx.stage_size // layout.tp
        return (microbatch_size // dp,) + self.config.layer_output_shape(layer)

    def input_shape(self, microbatch_size: int) -> tuple[int, ...]:
        """First stage: images (b_m, C, H, W); else the previous layer's output chunk."""
        cfg = self.config
        if self.input_layout is None:
            return (microbatch_size, cfg.num_channels, cfg.img_h, cfg.img_w)
        return self._chunk_shape(microbatch_size, self.input_layout, self.layer_ids[0] - 1)

    def output_shape(self, microbatch_size: int) -> tuple[int, ...]:
        """This stage's last layer's output chunk; () on the last stage."""
        if self.output_layout is None:
            return ()
        return self._chunk_shape(microbatch_size, self.output_layout, self.layer_ids[-1])

    def parallel_units(self) -> list[tuple[str, nn.Module, int | None]]:
        """Modules by layout in forward order (read by ``parallel.data_parallel``): the patch
        embedding (vocab entry), ``("layers.<i>", block, i)`` per layer (a Swin block with its
        patch merging), then the classification head (vocab entry)."""
        units: list[tuple[str, nn.Module, int | None]] = []
        if self.is_first_stage:
            units.append(("embedding", self.embedding, None))
        units += [(f"layers.{i}", self.layers[str(i)], i) for i in self.layer_ids]
        if self.is_last_stage:
            units.append(("head", self.head, None))
        return units

    def groups_for_parameter(self, fqn: str) -> LayerGroups:
        """Groups a parameter lives on (from :meth:`parallel_units`): its layer's layout, else
        the vocab layout (embedding, head)."""
        for name, _, layer in self.parallel_units():
            if fqn.startswith(name + "."):
                return self._layer_groups[layer] if layer is not None else self.vocab_groups
        raise KeyError(f"{fqn}: not a parameter of stage {self.ctx.stage}")

    # ---------------------------------------------------------------- forward
    def forward(self, x: torch.Tensor, *, labels: torch.Tensor | None = None,
                loss_mask: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """First stage: ``x`` = images (b_m, C, H, W) of the whole micro-batch; else the hidden
        chunk in ``input_layout``. ``labels`` (b_m,) class ids and ``loss_mask`` (b_m,) cover the
        whole micro-batch. Returns the hidden chunk, or on the last stage
        ``(loss_sum, num_samples)`` over this rank's vocab-layout chunk (fp32).
        """
        if self.is_first_stage:
            hidden = self.embedding(batch_chunk(x, self.vocab_groups))
            current = self.vocab_groups
        else:
            hidden, current = x, self.ctx.layout_groups(self.input_layout)
        for i in self.layer_ids:
            groups = self._layer_groups[i]
            hidden = relayout(hidden, current, groups, self.ctx)
            current = groups
            hidden = self.layers[str(i)](hidden)
        if not self.is_last_stage:
            return hidden
        if labels is None:
            raise ValueError("the last pipeline stage needs labels (b_m,) to compute the loss")
        vocab = self.vocab_groups
        logits = self.head(relayout(hidden, current, vocab, self.ctx)).float()  # (b/dp, classes)
        target = batch_chunk(labels, vocab).reshape(-1).long()
        losses = F.cross_entropy(logits, target, reduction="none")
        mask = (torch.ones_like(losses) if loss_mask is None
                else batch_chunk(loss_mask, vocab).reshape(-1).to(losses.dtype))
        correct = ((logits.argmax(dim=-1) == target).to(losses.dtype) * mask).sum()
        self.last_losses = {"correct": correct.detach(), "num_samples": mask.sum().detach()}
        return (losses * mask).sum(), mask.sum()


class ViTStage(VisionStage):
    """One pipeline stage of a Vision Transformer (see the module docstring)."""

    def __init__(self, config: VisionConfig, ctx: ParallelContext, *, seed: int = 1234) -> None:
        if config.model_type != "vit":
            raise ValueError(f"ViTStage needs model_type='vit', got {config.model_type!r}; "
                             f"use SwinStage for Swin backbones")
        self._layer_config = layer_model_config(config, config.hidden_size,
                                                config.num_attention_heads,
                                                config.ffn_hidden_size, config.seq_length)
        super().__init__(config, ctx, seed=seed)

    def build_layer(self, index: int, groups: LayerGroups, recompute: bool) -> nn.Module:
        return TransformerLayer(self._layer_config, groups, rng=self.rng, causal=False,
                                recompute=recompute)
