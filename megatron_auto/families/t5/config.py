"""Shape and numerics of a T5 encoder-decoder (pure data, no torch).

The runtime (``models/t5.py``), the planner (``planner/inputs/model_spec.py``), the data
(``data/t5_dataset.py``) and the entry script ``pretrain_t5.py`` read the same
:class:`T5Config`, a :class:`~megatron_auto.config.ModelConfig` with the encoder-decoder fields
of Megatron-LM's T5 (``--encoder-num-layers --decoder-num-layers --encoder-seq-length
--decoder-seq-length --kv-channels``) and T5's bucketed relative position bias
(``--relative-attention-num-buckets --relative-attention-max-distance``, Megatron-core's names).

Layers ``0 .. E-1`` of the plan are the encoder, ``E .. E+D-1`` the decoder (``num_layers`` is
``E + D``, derived); ``seq_length`` is the encoder's sequence length. Errors are
:class:`~megatron_auto.config.ConfigError` naming the flag, the value and the fix.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from ...config import ConfigError, ModelConfig, filled

#: ``--position-embedding-type`` values a T5 accepts: T5's relative bias, or a learned table
#: shared by the encoder and the decoder (Megatron-LM's legacy T5).
T5_POSITION_EMBEDDING_TYPES = ("relative", "learned")


def _need(cond: bool, flag: str, value: Any, fix: str) -> None:
    if not cond:
        raise ConfigError(f"{flag}={value}: {fix}")


@dataclass(frozen=True)
class T5Config(ModelConfig):
    """A T5: ``encoder_num_layers`` encoder then ``decoder_num_layers`` decoder layers."""

    model_types: ClassVar[tuple[str, ...]] = ("t5",)
    position_embedding_types: ClassVar[tuple[str, ...]] = T5_POSITION_EMBEDDING_TYPES
    runs_sequence_parallel: ClassVar[bool] = False  # the T5 stages refuse SP plans
    runs_context_parallel: ClassVar[bool] = False  # and CP plans
    runs_module_recompute: ClassVar[bool] = False  # whole-layer recompute only
    seq_length_flag: ClassVar[str] = "--encoder-seq-length"

    model_type: str = "t5"
    position_embedding_type: str = "relative"
    encoder_num_layers: int = 2
    decoder_num_layers: int = 2
    decoder_seq_length: int = 32
    kv_channels: int | None = None  # default hidden_size / num_attention_heads
    relative_attention_num_buckets: int = 32
    relative_attention_max_distance: int = 128

    def __post_init__(self) -> None:
        _need(isinstance(self.encoder_num_layers, int) and self.encoder_num_layers >= 1,
              "--encoder-num-layers", self.encoder_num_layers, "must be a positive integer")
        _need(isinstance(self.decoder_num_layers, int) and self.decoder_num_layers >= 1,
              "--decoder-num-layers", self.decoder_num_layers, "must be a positive integer")
        object.__setattr__(self, "num_layers", self.encoder_num_layers + self.decoder_num_layers)
        if self.kv_channels is None:
            heads = max(self.num_attention_heads, 1)
            object.__setattr__(self, "kv_channels", self.hidden_size // heads)
        if self.max_position_embeddings is None:
            object.__setattr__(self, "max_position_embeddings",
                               max(self.seq_length, self.decoder_seq_length))
        super().__post_init__()

    def validate(self) -> None:
        super().validate()
        _need(self.decoder_seq_length >= 1, "--decoder-seq-length", self.decoder_seq_length,
              "must be a positive integer")
        _need(filled(self.kv_channels) >= 1, "--kv-channels", self.kv_channels,
              "must be a positive integer (default: hidden size / heads)")
        _need(self.num_query_groups in (None, self.num_attention_heads), "--num-query-groups",
              self.num_query_groups, "T5 has one key/value head per attention head here; drop "
              "--group-query-attention")
        if self.position_embedding_type == "learned":
            _need(self.decoder_seq_length <= filled(self.max_position_embeddings),
                  "--decoder-seq-length", self.decoder_seq_length,
                  f"is longer than the learned position table (--max-position-embeddings="
                  f"{self.max_position_embeddings}); raise --max-position-embeddings to at least "
                  f"{self.decoder_seq_length}, shorten the decoder or use "
                  f"--position-embedding-type relative")
        else:
            nb = self.relative_attention_num_buckets
            _need(nb >= 4 and nb % 2 == 0, "--relative-attention-num-buckets", nb,
                  "must be an even number >= 4 (half the buckets per direction in the encoder; "
                  "T5 uses 32)")
            _need(self.relative_attention_max_distance > nb // 2,
                  "--relative-attention-max-distance", self.relative_attention_max_distance,
                  f"must exceed half the buckets ({nb // 2}), where the logarithmic buckets "
                  f"begin; T5 uses 128")

    # ------------------------------------------------------------------ derived
    @property
    def head_dim(self) -> int:
        return int(filled(self.kv_channels))

    @property
    def projection_size(self) -> int:
        """Width of the attention heads together (``heads * kv_channels``)."""
        return self.num_attention_heads * int(filled(self.kv_channels))

    @property
    def encoder_seq_length(self) -> int:
        return self.seq_length

    @property
    def causal(self) -> bool:
        return False  # the encoder; the decoder's self-attention is causal

    def is_decoder_layer(self, layer: int) -> bool:
        return layer >= self.encoder_num_layers

    @property
    def boundary_seq_length(self) -> int:
        """Tokens per sample crossing a stage boundary or a relayout: the stack's hidden state
        and what travels beside it (the decoder's embedded input through encoder stages, the
        encoder output through decoder stages)."""
        return self.seq_length + self.decoder_seq_length

    def _norm_parameters(self) -> int:
        return 2 * self.hidden_size if self.normalization == "layernorm" else self.hidden_size

    def _mlp_parameters(self) -> int:
        h, f, bias = self.hidden_size, filled(self.ffn_hidden_size), int(self.add_bias_linear)
        if self.activation == "swiglu":
            return 3 * h * f + bias * (2 * f + h)
        return 2 * h * f + bias * (f + h)

    def encoder_layer_parameters(self) -> int:
        h, p, bias = self.hidden_size, self.projection_size, int(self.add_bias_linear)
        attention = 3 * p * h + p * h + bias * (3 * p + h)  # fused QKV, output projection
        return attention + self._mlp_parameters() + 2 * self._norm_parameters()

    def decoder_layer_parameters(self) -> int:
        h, p, bias = self.hidden_size, self.projection_size, int(self.add_bias_linear)
        cross = 4 * p * h + bias * (3 * p + h)  # q, fused kv, output projection
        return self.encoder_layer_parameters() + cross + self._norm_parameters()

    def num_layer_parameters(self, layer: int | None = None) -> int:
        """The mean over the stack (the per-type counts are the two methods above); ``layer``
        is ``ModelConfig``'s MoE argument, unused (T5 has no MoE layers)."""
        total = (self.encoder_num_layers * self.encoder_layer_parameters()
                 + self.decoder_num_layers * self.decoder_layer_parameters())
        return total // self.num_layers

    def relative_bias_parameters(self) -> int:
        """Both relative position bias tables (buckets x heads each), 0 for learned positions."""
        if self.position_embedding_type != "relative":
            return 0
        return 2 * self.relative_attention_num_buckets * self.num_attention_heads

    def num_parameters(self) -> int:
        """All parameters, the tied embedding once: embeddings, both stacks, the encoder's and
        the decoder's final norms, the LM head's bias and the relative bias tables."""
        h = self.hidden_size
        emb = self.padded_vocab_size * h
        if self.position_embedding_type == "learned":
            emb += filled(self.max_position_embeddings) * h
        layers = (self.encoder_num_layers * self.encoder_layer_parameters()
                  + self.decoder_num_layers * self.decoder_layer_parameters())
        return (emb + layers + 2 * self._norm_parameters() + self.padded_vocab_size
                + self.relative_bias_parameters())

    def model_flops_per_token(self) -> float:
        """Forward + backward matmul FLOPs per encoder token (the metrics' token unit).

        Per sample, with ``p`` the heads' width: each encoder layer GPT's count over ``s_e``
        tokens (projections ``2 s 4hp``, MLP, scores and weighted sum ``4 s^2 p``), each
        decoder layer the same over ``s_d`` plus cross-attention (query and output projections
        over ``s_d``, key/value projections over ``s_e``, scores over ``s_d x s_e``), the LM
        head over ``s_d``; forward + backward is 3 times the forward.
        """
        h, f, p = self.hidden_size, filled(self.ffn_hidden_size), self.projection_size
        se, sd = self.seq_length, self.decoder_seq_length
        mlp = (3 if self.activation == "swiglu" else 2) * h * f
        enc = 2 * se * (4 * h * p + mlp) + 4 * se * se * p
        dec_self = 2 * sd * (4 * h * p + mlp) + 4 * sd * sd * p
        cross = 2 * sd * 2 * h * p + 2 * se * 2 * h * p + 4 * sd * se * p
        per_sample = (self.encoder_num_layers * enc + self.decoder_num_layers * (dec_self + cross)
                      + 2 * sd * h * self.padded_vocab_size)
        return 3.0 * per_sample / se
