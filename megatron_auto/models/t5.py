"""T5Stage: the part of a T5 encoder-decoder that one pipeline stage holds, under any plan.

Conventions of :class:`~megatron_auto.models.gpt.GPTStage`: a stage builds only its own layers
(``self.layers``, keyed by the global index; ``0..E-1`` encoder, ``E..E+D-1`` decoder),
parameter FQNs and global shapes never depend on the plan, every parameter is the TP shard of a
full tensor drawn from ``(seed, fqn)``, and activations are re-laid out between layouts.

Layers (pre-LN, as Megatron-LM's T5): encoder ``x + Attn(LN(x))`` then ``+ MLP(LN(x))``, the
last encoder layer ending with the encoder's final norm (``layers.<E-1>.final_layernorm``); decoder
``x + CausalAttn(LN(x))``, ``+ CrossAttn(LN(x), encoder output)``, ``+ MLP(LN(x))``. Attention
is scaled by ``1/sqrt(kv_channels)``; projections are column-parallel by heads (rows
``(heads, 3 | 2 | 1, kv_channels)``), output projections and fc2 row-parallel, as GPT's.

Positions: ``relative`` (T5's): one table ``(buckets, heads)`` per stack,
``encoder_relative_bias.weight`` (bidirectional buckets) and ``decoder_relative_bias.weight``
(causal buckets), added to the self-attention scores of every layer of the stack (cross-
attention has none). Every stage holding layers of a stack keeps a full replica on every rank;
each rank's layers add the rows of their own heads, and the gradient is summed over every rank
of those stages (:meth:`T5Stage.shared_replicas`, read by ``parallel.data_parallel``): the
ranks' contributions are disjoint (heads by TP rank, samples by DP replica), so the sum is the
one-process gradient. The tables take no plan entry (``buckets x heads`` elements). ``learned``:
one position table on the embedding, used by both stacks (Megatron-LM's legacy T5).

Embedding and head: the first stage embeds the encoder and the decoder tokens with the one
word embedding (vocab layout); the last stage applies the decoder's final norm and the tied LM
head (word embeddings plus a vocab-split ``lm_head.bias``, Megatron's T5 head), with its own
tied copy of the word embedding when ``pp > 1`` (kept in sync as GPT's).

The pipeline carry: every stage boundary sends ``(b/dp, s_e + s_d, h)``, the encoder part then
the decoder part, in the sending stage's last layer layout. Before the encoder ends they are the
encoder's hidden state and the decoder's embedded input (carried to the first decoder layer);
from the last encoder layer on, the encoder output and the decoder's hidden state (Megatron
carries the encoder output to the decoder stages the same way; the decoder input is embedded on
the first stage here, so no stage but the first and the last holds an embedding). Inside a
stage both parts are re-laid out together, one collective per layout change, so a boundary may
fall anywhere, including between the encoder and the decoder; the planner prices these bytes
(``LayerType.carried_seq_length``).

Batch: ``tokens`` (b, s_e) encoder ids, ``decoder_tokens`` (b, s_d), ``encoder_mask`` (b, s_e)
1 = real encoder token (keys masked in the encoder's self-attention and in cross-attention),
``labels`` and ``loss_mask`` (b, s_d). Sequence parallelism and interleaving are refused.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..layout import StageLayout, received_layout, relayout_step
from ..parallel.context import LayerGroups, ParallelContext
from ..parallel.random import TENSOR_PARALLEL, RNGTracker, checkpoint, fork, replicated_dropout
from ..parallel.redistribute import batch_chunk, relayout
from ..parallel.tensor_parallel import (ColumnParallelLinear, RowParallelLinear,
                                        vocab_parallel_cross_entropy)
from ..plan import Plan
from ..families.t5.config import T5Config
from .gpt import LanguageModelEmbedding
from .stage import PipelineStage, refuse_interleaving_and_sequence_parallel
from .init import collect_shard_specs, init_parameters
from .transformer import MLP, make_norm
from .recompute import whole_layer_only


def relative_position_buckets(query_length: int, key_length: int, *, bidirectional: bool,
                              num_buckets: int, max_distance: int,
                              device: torch.device | None = None) -> torch.Tensor:
    """T5's bucket of every (query, key) offset: a (query_length, key_length) int64 tensor.

    With ``d = key - query``: bidirectional buckets give half the buckets to ``d > 0`` (offset
    by ``num_buckets / 2``) and measure ``|d|``; causal ones measure ``max(-d, 0)`` (later keys
    share bucket 0). Of the ``n`` buckets of a direction, distances below ``n/2`` have one each;
    larger ones share the rest logarithmically up to ``max_distance``, beyond which all fall in
    the last bucket.
    """
    query = torch.arange(query_length, dtype=torch.long, device=device)[:, None]
    key = torch.arange(key_length, dtype=torch.long, device=device)[None, :]
    offset = key - query
    buckets = torch.zeros_like(offset)
    n = num_buckets
    if bidirectional:
        n //= 2
        buckets = buckets + (offset > 0).long() * n
        distance = offset.abs()
    else:
        distance = (-offset).clamp(min=0)
    exact = n // 2
    # log-spaced buckets for distances in [exact, max_distance); clamp(min=1) keeps log finite
    # where the exact branch is taken anyway
    scaled = (torch.log(distance.clamp(min=1).float() / exact)
              / math.log(max_distance / exact) * (n - exact))
    far = (exact + scaled.long()).clamp(max=n - 1)
    return buckets + torch.where(distance < exact, distance, far)


class RelativePositionBias(nn.Module):
    """One stack's table ``weight`` (buckets, heads): ``forward(s_q, s_k)`` -> (1, heads, s_q, s_k)."""

    def __init__(self, config: T5Config, *, bidirectional: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(config.relative_attention_num_buckets,
                                               config.num_attention_heads))
        self.bidirectional = bidirectional
        self.num_buckets = config.relative_attention_num_buckets
        self.max_distance = config.relative_attention_max_distance

    def forward(self, query_length: int, key_length: int) -> torch.Tensor:
        buckets = relative_position_buckets(query_length, key_length,
                                            bidirectional=self.bidirectional,
                                            num_buckets=self.num_buckets,
                                            max_distance=self.max_distance,
                                            device=self.weight.device)
        return self.weight[buckets].permute(2, 0, 1).unsqueeze(0)  # (1, heads, s_q, s_k)


class T5Attention(nn.Module):
    """Self- (``cross=False``: fused QKV) or cross-attention (``linear_q`` on the decoder state,
    fused ``linear_kv`` on the encoder output) over this rank's ``heads/tp`` heads."""

    def __init__(self, config: T5Config, groups: LayerGroups, rng: RNGTracker | None, *,
                 cross: bool) -> None:
        super().__init__()
        h, p, bias = config.hidden_size, config.projection_size, config.add_bias_linear
        self.cross = cross
        if cross:
            self.linear_q = ColumnParallelLinear(h, p, groups, bias=bias)
            self.linear_kv = ColumnParallelLinear(h, 2 * p, groups, bias=bias)
        else:
            self.linear_qkv = ColumnParallelLinear(h, 3 * p, groups, bias=bias)
        self.linear_proj = RowParallelLinear(p, h, groups, bias=bias, input_is_parallel=True)
        self.num_local_heads = config.num_attention_heads // groups.tp_size
        self.head_offset = groups.tp_rank * self.num_local_heads
        self.head_dim = config.head_dim
        self.attention_dropout = config.attention_dropout
        self.rng = rng

    def _heads(self, y: torch.Tensor, parts: int) -> tuple[torch.Tensor, ...]:
        b, s = y.shape[:2]
        y = y.view(b, s, self.num_local_heads, parts, self.head_dim)
        return tuple(y.permute(3, 0, 2, 1, 4).unbind(0))  # each (b, heads, s, d)

    def forward(self, x: torch.Tensor, memory: torch.Tensor | None = None, *,
                bias: torch.Tensor | None = None, key_keep: torch.Tensor | None = None,
                causal: bool = False) -> torch.Tensor:
        """``x`` (b, s_q, h); ``memory`` (b, s_k, h) the encoder output (cross-attention);
        ``bias`` (1, heads, s_q, s_k) of all heads or None; ``key_keep`` (b, s_k) bool."""
        if self.cross:
            (q,) = self._heads(self.linear_q(x), 1)
            k, v = self._heads(self.linear_kv(memory), 2)
        else:
            q, k, v = self._heads(self.linear_qkv(x), 3)
        s_q, s_k = q.shape[2], k.shape[2]
        mask = None
        if bias is not None or key_keep is not None:
            allowed = torch.ones(1, 1, s_q, s_k, dtype=torch.bool, device=q.device)
            if key_keep is not None:
                allowed = allowed & key_keep[:, None, None, :]
            if causal:
                allowed = allowed & torch.ones(s_q, s_k, dtype=torch.bool, device=q.device).tril()
            if bias is None:
                mask = allowed
            else:
                local = bias[:, self.head_offset:self.head_offset + self.num_local_heads]
                mask = local.to(q.dtype).masked_fill(~allowed, torch.finfo(q.dtype).min)
        p = self.attention_dropout if self.training else 0.0
        with fork(self.rng, TENSOR_PARALLEL, draws=p > 0.0):  # this rank's heads: own stream
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p,
                                                 is_causal=causal and mask is None)
        b = out.shape[0]
        out = out.transpose(1, 2).reshape(b, s_q, self.num_local_heads * self.head_dim)
        return self.linear_proj(out)  # (b, s_q, h) summed over the TP group


class T5Layer(nn.Module):
    """One encoder (``decoder=False``) or decoder layer on one layout; input and output
    (b/dp, s, h) replicated over its TP group. ``final_norm``: the encoder's last layer also
    applies the encoder's final norm, so its output is the encoder output."""

    def __init__(self, config: T5Config, groups: LayerGroups, *, rng: RNGTracker | None,
                 decoder: bool, final_norm: bool = False, recompute: bool = False) -> None:
        super().__init__()
        config.check_tensor_parallel(groups.tp_size, what="layer tp")
        self.decoder = decoder
        self.input_layernorm = make_norm(config)
        self.self_attention = T5Attention(config, groups, rng, cross=False)
        if decoder:
            self.pre_cross_attn_layernorm = make_norm(config)
            self.cross_attention = T5Attention(config, groups, rng, cross=True)
        self.pre_mlp_layernorm = make_norm(config)
        self.mlp = MLP(config, groups)
        self.final_layernorm = make_norm(config) if final_norm else None
        self.hidden_dropout = config.hidden_dropout
        self.recompute = whole_layer_only(recompute, "T5")
        self.rng = rng

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        return replicated_dropout(x, self.hidden_dropout, self.rng, self.training)

    def _forward(self, x: torch.Tensor, memory: torch.Tensor | None, bias: torch.Tensor | None,
                 key_keep: torch.Tensor | None) -> torch.Tensor:
        if self.decoder:
            x = x + self._dropout(self.self_attention(self.input_layernorm(x), bias=bias,
                                                      causal=True))
            x = x + self._dropout(self.cross_attention(self.pre_cross_attn_layernorm(x), memory,
                                                       key_keep=key_keep))
        else:
            x = x + self._dropout(self.self_attention(self.input_layernorm(x), bias=bias,
                                                      key_keep=key_keep))
        x = x + self._dropout(self.mlp(self.pre_mlp_layernorm(x)))
        return x if self.final_layernorm is None else self.final_layernorm(x)

    def forward(self, x: torch.Tensor, memory: torch.Tensor | None = None,
                bias: torch.Tensor | None = None,
                key_keep: torch.Tensor | None = None) -> torch.Tensor:
        """``x`` (b/dp, s, h) this stack's state; ``memory`` (b/dp, s_e, h) the encoder output
        (decoder only); ``bias`` (1, heads, s, s) the stack's relative bias (all heads) or
        None; ``key_keep`` (b/dp, s_e) bool, the real encoder tokens or None."""
        if self.recompute and torch.is_grad_enabled():
            return checkpoint(self._forward, self.rng, x, memory, bias, key_keep)
        return self._forward(x, memory, bias, key_keep)


class T5LMHead(nn.Module):
    """Tied vocab-parallel logits plus a vocab-split bias (``bias``, (V/tp,))."""

    def __init__(self, config: T5Config, groups: LayerGroups) -> None:
        super().__init__()
        self.tp_size, self.tp_rank, self.tp_group = groups.tp_size, groups.tp_rank, groups.tp_group
        self.bias = nn.Parameter(torch.empty(config.padded_vocab_size // groups.tp_size))
        self.tp_shard_dims = {"bias": 0}

    def forward(self, hidden: torch.Tensor, embedding: LanguageModelEmbedding) -> torch.Tensor:
        return embedding.logits(hidden) + self.bias  # (b, s, V/tp)


def _refuse_unsupported(plan: Plan) -> None:
    refuse_interleaving_and_sequence_parallel(plan, "T5 runs only", "T5 does not run")


class T5Stage(PipelineStage):
    """One pipeline stage of a T5 (see the module docstring)."""

    head_modules = ("final_norm", "lm_head")

    def __init__(self, config: T5Config, ctx: ParallelContext, *, seed: int = 1234) -> None:
        super().__init__(config, ctx, seed)
        plan = ctx.plan
        _refuse_unsupported(plan)
        enc = config.encoder_num_layers
        self.layer_ids = list(plan.stage_layer_range(ctx.stage))
        self._layer_groups = {i: ctx.layer_groups(i) for i in self.layer_ids}
        self.layers = nn.ModuleDict({
            str(i): T5Layer(config, self._layer_groups[i], rng=self.rng, decoder=i >= enc,
                            final_norm=i == enc - 1, recompute=plan.layers[i].recompute)
            for i in self.layer_ids})
        if self.is_first_stage or self.is_last_stage:
            self.embedding = LanguageModelEmbedding(config, self.vocab_groups, self.rng,
                                                    with_positions=self.is_first_stage)
        if self.is_last_stage:
            self.final_norm = make_norm(config)
            self.lm_head = T5LMHead(config, self.vocab_groups)
        self._shared: list[tuple[str, object, bool]] = []
        relative = config.position_embedding_type == "relative"
        for name, stack, bidirectional in (
                ("encoder_relative_bias", range(enc), True),
                ("decoder_relative_bias", range(enc, config.num_layers), False)):
            if not relative:
                continue
            stages = sorted({plan.stage_of_layer(i) for i in stack})
            ranks = [r for k in stages for r in plan.stage_ranks(k)]
            group = ctx.group(ranks)  # collective: every rank creates both, in this order
            if ctx.stage in stages:
                setattr(self, name, RelativePositionBias(config, bidirectional=bidirectional))
                # counted once in the gradient norm: on the first rank holding the table
                self._shared.append((f"{name}.weight", group, ctx.rank == ranks[0]))
        self._input_layout: StageLayout | None = received_layout(plan, ctx.stage)
        self._output_layout: StageLayout | None = (
            None if self.is_last_stage else self._layer_groups[self.layer_ids[-1]].layout)
        self.shard_specs = collect_shard_specs(self)
        init_parameters(self, config, seed, self.shard_specs)
        self.to(ctx.device)

    # ------------------------------------------------------------------ shapes
    def _wire_shape(self, microbatch_size: int, layout: StageLayout) -> tuple[int, ...]:
        dp = self.ctx.stage_size // layout.tp
        return (microbatch_size // dp, self.config.boundary_seq_length, self.config.hidden_size)

    def input_shape(self, microbatch_size: int) -> tuple[int, ...]:
        """First stage: encoder ids (b_m, s_e); else the carried (b/dp, s_e + s_d, h)."""
        if self._input_layout is None:
            return (microbatch_size, self.config.seq_length)
        return self._wire_shape(microbatch_size, self._input_layout)

    def output_shape(self, microbatch_size: int) -> tuple[int, ...]:
        """The carried (b/dp, s_e + s_d, h) in the last layer's layout; () on the last stage."""
        if self._output_layout is None:
            return ()
        return self._wire_shape(microbatch_size, self._output_layout)

    # ---------------------------------------------------------------- runtime
    def parallel_units(self) -> list[tuple[str, nn.Module, int | None]]:
        """Modules by layout in forward order (read by ``parallel.data_parallel``): the
        embedding (vocab entry, first stage), ``("layers.<i>", layer, i)``, the final norm and
        LM head, and the tied embedding copy on a last stage that is not the first. The
        relative bias tables are in :meth:`shared_replicas` instead."""
        units: list[tuple[str, nn.Module, int | None]] = []
        if self.is_first_stage:
            units.append(("embedding", self.embedding, None))
        units += [(f"layers.{i}", self.layers[str(i)], i) for i in self.layer_ids]
        if self.is_last_stage:
            units += [(name, getattr(self, name), None) for name in self.head_modules]
            if not self.is_first_stage:
                units.append(("embedding", self.embedding, None))
        return units

    def shared_replicas(self) -> list[tuple[str, object, bool]]:
        """``(fqn, group, counted_here)`` of the parameters replicated on every rank of several
        stages: gradients summed over ``group`` after backward, counted once in the norm."""
        return list(self._shared)

    def groups_for_parameter(self, fqn: str) -> LayerGroups:
        """Groups a parameter lives on: its layer's layout, else the vocab layout."""
        for name, _, layer in self.parallel_units():
            if fqn.startswith(name + "."):
                return self._layer_groups[layer] if layer is not None else self.vocab_groups
        raise KeyError(f"{fqn}: not a parameter of stage {self.ctx.stage} (or a shared "
                       f"replica, see shared_replicas)")

    # ---------------------------------------------------------------- forward
    def _relayout_pair(self, a: torch.Tensor, b: torch.Tensor, src: LayerGroups,
                       dst: LayerGroups) -> tuple[torch.Tensor, torch.Tensor]:
        """Move both parts to ``dst`` with one collective (concatenated along the sequence)."""
        if src is dst or relayout_step(src.layout.layout, dst.layout.layout, self.ctx.stage_size,
                                       self.ctx.local_index).is_identity:
            return a, b
        both = relayout(torch.cat([a, b], dim=1), src, dst, self.ctx)
        return both.split([a.shape[1], b.shape[1]], dim=1)

    def forward(self, x: torch.Tensor, *, decoder_tokens: torch.Tensor | None = None,
                encoder_mask: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                loss_mask: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """First stage: ``x`` = encoder ids (b_m, s_e) of the whole micro-batch and
        ``decoder_tokens`` (b_m, s_d); else the carried tensor in the input layout.
        ``encoder_mask`` (b_m, s_e), ``labels`` and ``loss_mask`` (b_m, s_d) cover the whole
        micro-batch. Returns the carried tensor, or on the last stage ``(loss_sum, num_tokens)``
        over this rank's vocab-layout chunk (fp32)."""
        cfg = self.config
        enc_layers = cfg.encoder_num_layers
        if self.is_first_stage:
            if decoder_tokens is None:
                raise ValueError("the first T5 stage needs decoder_tokens (b_m, s_d)")
            current = self.vocab_groups
            enc = self.embedding.embed(batch_chunk(x, current))
            dec = self.embedding.embed(batch_chunk(decoder_tokens, current))
        else:
            current = self.ctx.layout_groups(self._input_layout)
            enc, dec = x.split([cfg.seq_length, cfg.decoder_seq_length], dim=1)
        device_type = enc.device.type
        dtype = (torch.get_autocast_dtype(device_type)
                 if torch.is_autocast_enabled(device_type) else None)
        enc_bias = dec_bias = None
        if hasattr(self, "encoder_relative_bias"):
            enc_bias = self.encoder_relative_bias(cfg.seq_length, cfg.seq_length)
        if hasattr(self, "decoder_relative_bias"):
            dec_bias = self.decoder_relative_bias(cfg.decoder_seq_length, cfg.decoder_seq_length)
        keep = None if encoder_mask is None else encoder_mask.bool()
        for i in self.layer_ids:
            groups = self._layer_groups[i]
            enc, dec = self._relayout_pair(enc, dec, current, groups)
            current = groups
            if dtype is not None:  # the residual streams in the compute dtype, as GPT's
                enc, dec = enc.to(dtype), dec.to(dtype)
            key_keep = None if keep is None else batch_chunk(keep, groups)
            if i < enc_layers:
                enc = self.layers[str(i)](enc, None, enc_bias, key_keep)
            else:
                dec = self.layers[str(i)](dec, enc, dec_bias, key_keep)
        if dtype is not None:
            enc, dec = enc.to(dtype), dec.to(dtype)
        if not self.is_last_stage:
            return torch.cat([enc, dec], dim=1)
        if labels is None:
            raise ValueError("the last T5 stage needs labels (b_m, s_d) to compute the loss")
        vocab = self.vocab_groups
        hidden = self.final_norm(relayout(dec, current, vocab, self.ctx))  # (b/dp, s_d, h)
        logits = self.lm_head(hidden, self.embedding)
        losses = vocab_parallel_cross_entropy(logits, batch_chunk(labels, vocab), vocab)
        mask = (torch.ones_like(losses) if loss_mask is None
                else batch_chunk(loss_mask, vocab).to(losses.dtype))
        return (losses * mask).sum(), mask.sum()
