"""GPTStage: the part of a GPT model that one pipeline stage holds, under any plan.

A stage builds only its own layers (``self.layers``, keyed by the global layer index), plus the
embedding on the first stage and final norm + LM head on the last. Parameter FQNs and global
shapes never depend on the plan; each rank holds its TP shard, initialised as the shard of a full
tensor drawn from ``(seed, fqn)`` (see :mod:`megatron_auto.models.init`).

Activation layouts inside a stage (docs/design.md §4): the embedding and head run on the vocab layout
(vocab tp, consecutive), layer ``i`` on its own layout; ``relayout`` moves the batch chunks
between consecutive layouts, and between the embedding / head and the neighbouring layer.

Interleaved pipelines (``pipeline.virtual_size`` v > 1): a stage holds v model chunks
(``plan.stage_chunks``), all in ``self.layers``; ``forward(x, chunk=c)`` runs model chunk ``c``
only: the embedding before chunk 0, the head after the last chunk, and the received hidden chunk
(in the layout of chunk ``c-1``'s last layer) otherwise. Without ``chunk`` the stage is one chunk.

Tied embeddings: with one stage the LM head multiplies by ``embedding.word_embeddings.weight``.
With several stages the last stage holds its own ``embedding.word_embeddings`` (same FQN, same
init, no position table) used only as the head; the data-parallel runtime all-reduces its
gradient with the first stage's copy over ``ctx.embedding_group``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..layout import StageLayout, received_layout
from ..parallel.context import LayerGroups, ParallelContext
from ..parallel.mappings import copy_to_tensor_parallel, gather_from_sequence, scatter_to_sequence
from ..parallel.context_parallel import sequence_chunks, sequence_positions
from ..parallel.random import RNGTracker, replicated_dropout
from ..parallel.redistribute import batch_chunk, relayout, sample_chunk
from ..parallel.tensor_parallel import (ColumnParallelLinear, VocabParallelEmbedding,
                                        vocab_parallel_cross_entropy)
from .init import collect_shard_specs, init_parameters
from .stage import PipelineStage
from .te_layers import make_transformer_layer
from .transformer import RotaryEmbedding, make_norm


class LanguageModelEmbedding(nn.Module):
    """Word (+ learned position, + token type) embeddings on the vocab layout.

    ``embed`` and ``logits`` are the two entry points (FSDP2 may register both as forward
    methods). ``logits`` is the tied LM head: hidden (b, s, h) -> vocab-split logits (b, s, V/tp).
    """

    def __init__(self, config: ModelConfig, groups: LayerGroups, rng: RNGTracker | None, *,
                 with_positions: bool, num_tokentypes: int = 0) -> None:
        super().__init__()
        self.word_embeddings = VocabParallelEmbedding(config.padded_vocab_size,
                                                      config.hidden_size, groups)
        if with_positions and config.position_embedding_type == "learned":
            self.position_embeddings = nn.Embedding(config.max_position_embeddings,
                                                    config.hidden_size)
        else:
            self.position_embeddings = None
        self.tokentype_embeddings = (nn.Embedding(num_tokentypes, config.hidden_size)
                                     if num_tokentypes > 0 else None)
        self.tp_group, self.tp_size = groups.tp_group, groups.tp_size
        self.dropout = config.hidden_dropout
        self.rng = rng

    def embed(self, tokens: torch.Tensor, position_ids: torch.Tensor | None = None,
              tokentype_ids: torch.Tensor | None = None) -> torch.Tensor:
        """tokens (b, s) -> hidden (b, s, h), replicated over the vocab TP group."""
        x = self.word_embeddings(tokens)
        if self.position_embeddings is not None:
            if position_ids is None:
                position_ids = torch.arange(tokens.shape[1], device=tokens.device)
            x = x + self.position_embeddings(position_ids)
        if self.tokentype_embeddings is not None and tokentype_ids is not None:
            x = x + self.tokentype_embeddings(tokentype_ids)
        return replicated_dropout(x, self.dropout, self.rng, self.training)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (b, s, h) -> logits (b, s, V/tp) with the tied word-embedding matrix."""
        if self.tp_size > 1:
            hidden = copy_to_tensor_parallel(hidden, self.tp_group)
        return F.linear(hidden, self.word_embeddings.weight)

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor | None = None,
                tokentype_ids: torch.Tensor | None = None) -> torch.Tensor:
        return self.embed(tokens, position_ids, tokentype_ids)


def padding_attention_mask(keep: torch.Tensor, causal: bool) -> torch.Tensor:
    """Bool SDPA mask (b, 1, s, s), True = attend, from a (b, s) keep mask (1 = real token)."""
    mask = keep.bool()[:, None, None, :]
    if causal:
        s = keep.shape[1]
        mask = mask & torch.ones(s, s, dtype=torch.bool, device=keep.device).tril()
    return mask


class TransformerStage(PipelineStage):
    """What GPT and BERT stages share: layers, layouts, relayouts, rotary tables, init."""

    causal = True

    def __init__(self, config: ModelConfig, ctx: ParallelContext, *, seed: int = 1234) -> None:
        super().__init__(config, ctx, seed)
        plan = ctx.plan
        self.layer_ids = plan.stage_layers(ctx.stage)  # every chunk's layers, in model order
        self.chunk_ids = plan.stage_chunks(ctx.stage)
        self._layer_groups = {i: ctx.layer_groups(i) for i in self.layer_ids}
        # MoE layers, and those with expert fields in the plan (their experts' own groups)
        self._moe_layers = set(getattr(config, "moe_layers", ()))
        self._expert_groups = {i: ctx.expert_groups(i) for i in self.layer_ids
                               if i in self._moe_layers
                               and (plan.layers[i].ep > 1 or plan.layers[i].expert_tp > 1
                                    or plan.layers[i].expert_dp_mode)}
        self.layers = nn.ModuleDict({
            str(i): make_transformer_layer(config, self._layer_groups[i], rng=self.rng,
                                           causal=self.causal,
                                           recompute=plan.layers[i].recompute,
                                           sequence_parallel=plan.layers[i].sequence_parallel,
                                           device=ctx.device,
                                           moe=i in self._moe_layers,
                                           expert_groups=self._expert_groups.get(i),
                                           cp_mode=plan.layers[i].cp_mode,
                                           offload=plan.layers[i].offload)
            for i in self.layer_ids})
        self.rotary = (RotaryEmbedding(config.head_dim, config.max_position_embeddings,
                                       config.rotary_base)
                       if config.position_embedding_type == "rope" else None)
        # Per model chunk: the layout it receives (None: chunk 0 embeds) and sends (None: the
        # last chunk computes the loss).
        self._chunk_input: dict[int, StageLayout | None] = {}
        self._chunk_output: dict[int, StageLayout | None] = {}
        for c in self.chunk_ids:
            self._chunk_input[c] = received_layout(plan, c)
            self._chunk_output[c] = (None if c == plan.num_chunks - 1
                                     else self._layer_groups[plan.chunk_layer_range(c)[-1]].layout)
        self.input_layout = self._chunk_input[self.chunk_ids[0]]
        self.output_layout = self._chunk_output[self.chunk_ids[-1]]

    def _finish_init(self) -> None:
        """Record shard specs, draw the plan-independent init, move to the context's device."""
        self.shard_specs = collect_shard_specs(self)
        init_parameters(self, self.config, self.seed, self.shard_specs)
        self.to(self.ctx.device)

    # ------------------------------------------------------------------ shapes
    def _chunk_shape(self, microbatch_size: int, layout: StageLayout) -> tuple[int, ...]:
        slices = self.ctx.stage_size // (layout.tp * layout.cp)
        return (microbatch_size // slices, self.config.seq_length // layout.cp,
                self.config.hidden_size)

    def embed_inputs(self, x: torch.Tensor, position_ids: torch.Tensor | None
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This rank's token ids and position ids of the whole micro-batch's ``x`` (b_m, s) on
        the vocab layout: its batch slice and, under context parallelism, its two sequence
        chunks, whose positions are then given explicitly (learned position embeddings)."""
        vocab = self.vocab_groups
        tokens = sample_chunk(x, vocab)
        if position_ids is not None:
            return tokens, sample_chunk(position_ids, vocab)
        if vocab.cp_size > 1:
            return tokens, sequence_positions(vocab.cp_rank, vocab.cp_size, x.shape[1], x.device)
        return tokens, None

    def _rotary_tables(self, seq: int, position_ids: torch.Tensor | None,
                       groups: LayerGroups) -> tuple[torch.Tensor, torch.Tensor] | None:
        """RoPE (cos, sin) of this rank's positions: (s, d), or (b_m, 1, s, d) for explicit
        ``position_ids`` (b_m, s_full); under CP those of its two sequence chunks."""
        if self.rotary is None:
            return None
        cp = groups.cp_size
        if cp == 1:
            return self.rotary.tables(seq, position_ids)
        if position_ids is None:
            pos = sequence_positions(groups.cp_rank, cp, seq * cp, self.rotary.cos.device)
            return self.rotary.cos[pos], self.rotary.sin[pos]
        return self.rotary.tables(seq, sequence_chunks(position_ids, groups.cp_rank, cp, dim=1))

    def _chunk(self, chunk: int | None) -> int:
        if chunk is None:
            if len(self.chunk_ids) > 1:
                raise ValueError(f"stage {self.ctx.stage} holds model chunks {self.chunk_ids}; "
                                 f"say which one to run (chunk=...)")
            return self.chunk_ids[0]
        if chunk not in self._chunk_input:
            raise ValueError(f"model chunk {chunk} is not on stage {self.ctx.stage} "
                             f"(its chunks: {self.chunk_ids})")
        return chunk

    def is_first_chunk(self, chunk: int | None = None) -> bool:
        """Whether ``chunk`` (default: the stage's only chunk) starts the model (embeds)."""
        return self._chunk_input[self._chunk(chunk)] is None

    def is_last_chunk(self, chunk: int | None = None) -> bool:
        """Whether ``chunk`` ends the model (computes the loss)."""
        return self._chunk_output[self._chunk(chunk)] is None

    def input_shape(self, microbatch_size: int, chunk: int | None = None) -> tuple[int, ...]:
        """What a chunk receives: tokens (b_m, s) for the first, else its hidden chunk."""
        layout = self._chunk_input[self._chunk(chunk)]
        if layout is None:
            return (microbatch_size, self.config.seq_length)
        return self._chunk_shape(microbatch_size, layout)

    def output_shape(self, microbatch_size: int, chunk: int | None = None) -> tuple[int, ...]:
        """What a chunk sends to the next: its hidden chunk; () for the last chunk."""
        layout = self._chunk_output[self._chunk(chunk)]
        if layout is None:
            return ()
        return self._chunk_shape(microbatch_size, layout)

    # ---------------------------------------------------------------- forward
    def run_layers(self, hidden: torch.Tensor, current: LayerGroups,
                   position_ids: torch.Tensor | None, keep_mask: torch.Tensor | None,
                   chunk: int | None = None) -> tuple[torch.Tensor, LayerGroups]:
        """Run ``chunk``'s layers (default: the stage's only chunk), re-laying out ``hidden``
        whenever the layout changes.

        ``position_ids`` / ``keep_mask`` cover the whole micro-batch (b_m, s); each layer gets
        the rows of its own batch chunk.

        Under autocast the hidden state is in the compute dtype wherever it leaves a layer's
        inside: at the first stage's embedding output, before every layer and on the way out
        (later stages receive it so over the p2p hop, FSDP2 casts a sharded layer's inputs to it
        anyway, while a TP layer's fp32 row-parallel bias would promote its output to fp32). The
        residual stream's dtype, and what relayouts move, thus never depend on the plan.

        Sequence parallelism: consecutive SP layers of one layout pass their sequence chunks
        (b/dp, s/tp, h) straight on; entering an SP layer from anything else keeps this rank's
        positions of the replicated activation (no communication), leaving one all-gathers the
        sequence over the layer's TP group, so relayouts, the head and the stage boundary always
        see whole-sequence activations.
        """
        device_type = hidden.device.type
        dtype = (torch.get_autocast_dtype(device_type)
                 if torch.is_autocast_enabled(device_type) else None)
        seq = hidden.shape[1]  # this rank's positions: s, or s/cp under context parallelism
        rotary_full = self._rotary_tables(seq, position_ids, current)
        cp = current.cp_size
        mask_full = None
        if keep_mask is not None:  # under CP the attention takes the key keep mask (b, s)
            mask_full = keep_mask.bool() if cp > 1 else padding_attention_mask(keep_mask,
                                                                               self.causal)
        split: LayerGroups | None = None  # the SP layout ``hidden`` is split along, if any
        plan = self.ctx.plan
        for i in plan.chunk_layer_range(self._chunk(chunk)):
            groups = self._layer_groups[i]
            sp = plan.layers[i].sequence_parallel
            if dtype is not None:
                # a no-op when it already is; before a leaving SP run's gather, so that it moves
                # the compute dtype (an SP layer's output is fp32 under autocast: fp32 biases)
                hidden = hidden.to(dtype)
            if split is not None and not (sp and split.layout == groups.layout):
                hidden, split = gather_from_sequence(hidden, split.tp_group, reduce_grad=False), None
            if split is None:
                hidden = relayout(hidden, current, groups, self.ctx)
                if sp:
                    hidden, split = scatter_to_sequence(hidden, groups.tp_group), groups
            current = groups
            rotary = rotary_full
            if rotary_full is not None and position_ids is not None:
                rotary = (batch_chunk(rotary_full[0], groups), batch_chunk(rotary_full[1], groups))
            mask = None if mask_full is None else batch_chunk(mask_full, groups)
            hidden = self.layers[str(i)](hidden, mask, rotary)
        if dtype is not None:
            hidden = hidden.to(dtype)
        if split is not None:
            hidden = gather_from_sequence(hidden, split.tp_group, reduce_grad=False)
        return hidden, current

    # Vocab-layout modules after the layers, in the order the last stage runs them.
    head_modules: tuple[str, ...] = ("final_norm", "output_layer")

    def parallel_units(self) -> list[tuple[str, nn.Module, int | None]]:
        """This stage's modules by layout, in forward order: the mapping the data-parallel
        runtime reads (``parallel.data_parallel``).

        ``("layers.<i>", layer, i)`` for each transformer layer (layer ``i``'s layout and plan
        entry); ``(name, module, None)`` for each vocab-layout module: the embedding first on
        the first stage, then after the layers the heads (:attr:`head_modules`) and, on a last
        stage that is not the first, the tied embedding copy used as LM head. Every parameter
        of the stage is in exactly one entry; the names are the modules' FQNs, the same under
        every plan. An MoE layer with expert fields in the plan lists its experts first
        (``layers.<i>.mlp.experts``, carrying ``expert_groups``: their own DP group and mode).
        """
        has_embedding = hasattr(self, "embedding")
        units: list[tuple[str, nn.Module, int | None]] = []
        if has_embedding and self.is_first_stage:
            units.append(("embedding", self.embedding, None))
        for i in self.layer_ids:
            if i in self._expert_groups:  # its experts first: their own data-parallel group
                units.append((f"layers.{i}.mlp.experts", self.layers[str(i)].mlp.experts, i))
            units.append((f"layers.{i}", self.layers[str(i)], i))
        units += [(name, getattr(self, name), None) for name in self.head_modules
                  if getattr(self, name, None) is not None]
        if has_embedding and not self.is_first_stage:
            units.append(("embedding", self.embedding, None))
        return units

    def groups_for_parameter(self, fqn: str) -> LayerGroups:
        """Groups a parameter lives on (from :meth:`parallel_units`): its layer's layout for a
        layer's parameter, else the vocab layout. Its gradient is summed over that ``dp_group``."""
        for name, _, layer in self.parallel_units():
            if fqn.startswith(name + "."):
                return self._layer_groups[layer] if layer is not None else self.vocab_groups
        raise KeyError(f"{fqn}: not a parameter of stage {self.ctx.stage}")

    def input_groups(self, chunk: int | None = None) -> LayerGroups:
        layout = self._chunk_input[self._chunk(chunk)]
        assert layout is not None
        return self.ctx.layout_groups(layout)


class GPTStage(TransformerStage):
    """One pipeline stage of a GPT decoder (see module docstring and docs/design.md §4)."""

    causal = True

    def __init__(self, config: ModelConfig, ctx: ParallelContext, *, seed: int = 1234) -> None:
        super().__init__(config, ctx, seed=seed)
        tied = not config.untie_embeddings_and_output_weights
        if self.is_first_stage or (self.is_last_stage and tied):
            self.embedding = LanguageModelEmbedding(config, self.vocab_groups, self.rng,
                                                    with_positions=self.is_first_stage)
        if self.is_last_stage:
            self.final_norm = make_norm(config)
            if not tied:
                self.output_layer = ColumnParallelLinear(config.hidden_size,
                                                         config.padded_vocab_size,
                                                         self.vocab_groups, bias=False)
        self._finish_init()

    def forward(self, x: torch.Tensor, *, labels: torch.Tensor | None = None,
                loss_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, chunk: int | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """First stage: ``x`` = token ids (b_m, s) of the whole micro-batch; else the hidden chunk
        (b_m/dp, s, h) in ``input_layout``. ``position_ids``, ``attention_mask`` (a (b_m, s) keep
        mask, combined with causality), ``labels`` and ``loss_mask`` cover the whole micro-batch.

        Returns the hidden chunk in ``output_layout``, or on the last stage
        ``(loss_sum, num_tokens)``: fp32 sums over this rank's vocab-layout batch chunk of
        per-token cross entropy times ``loss_mask``, and of ``loss_mask``. ``chunk``: the model
        chunk to run when the stage holds several (interleaved pipeline).
        """
        if self.is_first_chunk(chunk):
            tokens, pos = self.embed_inputs(x, position_ids)
            hidden, current = self.embedding.embed(tokens, pos), self.vocab_groups
        else:
            hidden, current = x, self.input_groups(chunk)
        hidden, current = self.run_layers(hidden, current, position_ids, attention_mask, chunk)
        if not self.is_last_chunk(chunk):
            return hidden
        if labels is None:
            raise ValueError("the last pipeline stage needs labels (b_m, s) to compute the loss")
        # norm on the vocab layout so every non-layer parameter reduces over the vocab DP group
        hidden = self.final_norm(relayout(hidden, current, self.vocab_groups, self.ctx))
        if hasattr(self, "output_layer"):
            logits = self.output_layer(hidden)
        else:
            logits = self.embedding.logits(hidden)
        # (b/dp, s) fp32; under CP this rank's two chunks: summed over the CP group with every
        # other rank's by the trainer, as the batch slices are
        losses = vocab_parallel_cross_entropy(logits, sample_chunk(labels, self.vocab_groups),
                                              self.vocab_groups)
        if loss_mask is None:
            return losses.sum(), torch.tensor(float(losses.numel()), device=losses.device)
        mask = sample_chunk(loss_mask, self.vocab_groups).to(losses.dtype)
        return (losses * mask).sum(), mask.sum()
