"""BertStage: one pipeline stage of a BERT encoder (MLM + sentence-order prediction), any plan.

Same conventions as :class:`~megatron_auto.models.gpt.GPTStage` (plan-independent FQNs, TP shards
of a ``(seed, fqn)`` init, relayout between layouts, tied word embeddings, the first stage takes
the whole micro-batch's token ids). Layers are bidirectional (``causal=False``) and masked by the
batch's ``padding_mask`` (b_m, s) (1 = real token), which every stage receives.

Heads (last stage, on the vocab layout, like Megatron's BERT):

- MLM: ``lm_head.dense`` (h->h) + GELU + ``lm_head.norm``, then logits with the tied word
  embeddings plus ``lm_head.bias`` (split along the vocabulary like the logits);
- SOP (when ``config.bert_binary_head``): ``pooler.dense`` + tanh on the first token, then
  ``binary_head`` (h->2) against ``is_random`` (b_m,).

Loss composition. The schedule divides ``loss_sum`` by the masked-token count of the whole global
batch (``T``) before backward. The stage returns
``loss_sum = sum(mlm_ce * loss_mask) + sop_weight * sum(sop_ce)`` and ``num_tokens =
sum(loss_mask)`` over this rank's batch chunk. With ``sop_weight = T / global_batch_size`` the
optimised loss is exactly Megatron's ``mlm_mean + sop_mean``; the trainer passes it as a keyword
(a float or 0-d tensor). Without it the stage uses its micro-batch's own ratio ``T_m / b_m``,
which equals the global one when every micro-batch has the same number of masked tokens.
The detached parts of the last call are kept in ``self.last_losses`` (``mlm_loss_sum``,
``sop_loss_sum``, ``num_tokens``, ``num_samples``) for logging ``mlm_loss`` / ``sop_loss``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..parallel.context import LayerGroups, ParallelContext
from ..parallel.redistribute import batch_chunk, relayout, sample_chunk
from ..parallel.tensor_parallel import vocab_parallel_cross_entropy
from .gpt import LanguageModelEmbedding, TransformerStage
from .transformer import make_norm


class BertLMHead(nn.Module):
    """dense + GELU + norm, then tied vocab-parallel logits plus a vocab-split output bias."""

    def __init__(self, config: ModelConfig, groups: LayerGroups) -> None:
        super().__init__()
        h = config.hidden_size
        self.dense = nn.Linear(h, h)
        self.norm = make_norm(config)
        self.tp_size, self.tp_rank, self.tp_group = groups.tp_size, groups.tp_rank, groups.tp_group
        self.bias = nn.Parameter(torch.empty(config.padded_vocab_size // groups.tp_size))
        self.tp_shard_dims = {"bias": 0}
        self.gelu_approximate = "tanh" if config.openai_gelu else "none"  # as Megatron's head

    def forward(self, hidden: torch.Tensor, embedding: LanguageModelEmbedding) -> torch.Tensor:
        x = self.norm(F.gelu(self.dense(hidden), approximate=self.gelu_approximate))
        return embedding.logits(x) + self.bias  # (b, s, V/tp)


class BertStage(TransformerStage):
    """One pipeline stage of a BERT encoder (see module docstring)."""

    causal = False
    head_modules = ("final_norm", "lm_head", "pooler", "binary_head")

    def __init__(self, config: ModelConfig, ctx: ParallelContext, *, seed: int = 1234) -> None:
        super().__init__(config, ctx, seed=seed)
        if self.is_first_stage or self.is_last_stage:
            self.embedding = LanguageModelEmbedding(
                config, self.vocab_groups, self.rng, with_positions=self.is_first_stage,
                num_tokentypes=config.num_tokentypes if self.is_first_stage else 0)
        if self.is_last_stage:
            self.final_norm = make_norm(config)
            self.lm_head = BertLMHead(config, self.vocab_groups)
            if config.bert_binary_head:
                self.pooler = nn.Linear(config.hidden_size, config.hidden_size)
                self.binary_head = nn.Linear(config.hidden_size, 2)
        self.last_losses: dict[str, torch.Tensor] = {}
        self._finish_init()

    def forward(self, x: torch.Tensor | None = None, *, labels: torch.Tensor | None = None,
                loss_mask: torch.Tensor | None = None, types: torch.Tensor | None = None,
                padding_mask: torch.Tensor | None = None, is_random: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, sop_weight: Any = None,
                text: torch.Tensor | None = None, chunk: int | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """First stage: ``x`` = token ids (b_m, s) of the whole micro-batch (the dataset's
        ``text``); else the hidden chunk in ``input_layout``. ``types``, ``padding_mask``,
        ``labels`` (-1 where nothing is predicted), ``loss_mask`` and ``is_random`` cover the
        whole micro-batch. Returns the hidden chunk, or ``(loss_sum, num_tokens)`` on the last
        stage (composition in the module docstring). The token ids may also come as the
        dataset's field name ``text=`` (then ``x`` is None). ``chunk``: the model chunk to run
        when the stage holds several (interleaved pipeline).
        """
        if x is None:
            x = text
        if x is None:
            raise ValueError("BertStage.forward needs the input: token ids (x or text=) on the "
                             "first stage, the received hidden chunk elsewhere")
        if self.is_first_chunk(chunk):
            vocab = self.vocab_groups
            tokens, pos = self.embed_inputs(x, position_ids)
            tt = None if types is None else sample_chunk(types, vocab)
            hidden, current = self.embedding.embed(tokens, pos, tt), vocab
        else:
            hidden, current = x, self.input_groups(chunk)
        hidden, current = self.run_layers(hidden, current, position_ids, padding_mask, chunk)
        if not self.is_last_chunk(chunk):
            return hidden
        if labels is None or loss_mask is None:
            raise ValueError("the last BERT stage needs labels and loss_mask (b_m, s)")
        vocab = self.vocab_groups
        hidden = self.final_norm(relayout(hidden, current, vocab, self.ctx))  # (b/dp, s, h)
        logits = self.lm_head(hidden, self.embedding)
        target = sample_chunk(labels, vocab)
        target = target.masked_fill(target < 0, 0)  # ignored positions: any valid id, mask is 0
        mask = sample_chunk(loss_mask, vocab).float()
        mlm_sum = (vocab_parallel_cross_entropy(logits, target, vocab) * mask).sum()
        num_tokens = mask.sum()
        loss_sum = mlm_sum
        sop_sum = torch.zeros((), device=mlm_sum.device)
        if self.config.bert_binary_head:
            if is_random is None:
                raise ValueError("the BERT binary (sentence-order) head needs is_random (b_m,); "
                                 "pass the batch field or set bert_binary_head=False")
            pooled = torch.tanh(self.pooler(hidden[:, 0]))
            sop_logits = self.binary_head(pooled).float()
            sop_sum = F.cross_entropy(sop_logits, batch_chunk(is_random, vocab).reshape(-1).long(),
                                      reduction="sum")
            if vocab.cp_rank > 0:  # CP: the first token is CP rank 0's; the others add nothing
                sop_sum = sop_sum * 0.0
            if sop_weight is None:
                sop_weight = loss_mask.float().sum() / loss_mask.shape[0]
            loss_sum = loss_sum + sop_weight * sop_sum
        self.last_losses = {"mlm_loss_sum": mlm_sum.detach(), "sop_loss_sum": sop_sum.detach(),
                            "num_tokens": num_tokens.detach(),
                            "num_samples": torch.tensor(float(hidden.shape[0]))}
        return loss_sum, num_tokens
