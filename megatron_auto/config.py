"""Model configuration shared by the runtime, the profiler and the planner.

Only plain data lives here (no torch, no torch.distributed), so that every layer of the package
can import it. Argparse is converted into these dataclasses once, in ``arguments.py``; the
other components' settings are in ``run_config.py``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar, Mapping

from .families.gpt.config import MoEConfig, MoEConfigError
from .utils.jsonfile import unknown_fields

# The global batch when --global-batch-size is not given (training, --auto-parallel, the CLI);
# here rather than in run_config.py so that the planning commands' flags need no run_config.
DEFAULT_GLOBAL_BATCH_SIZE = 8

POSITION_EMBEDDING_TYPES = ("learned", "rope")
ACTIVATIONS = ("gelu", "swiglu")
NORMALIZATIONS = ("layernorm", "rmsnorm")
MODEL_TYPES = ("gpt", "bert")


class ConfigError(ValueError):
    """An invalid configuration; the message names the field, the value and the fix."""


class ArgumentError(ConfigError):
    """An invalid flag combination; the message names the flag, its value and the fix."""


def resolve_precision(bf16: bool, fp16: bool, default: str | None = "fp32") -> str | None:
    """``bf16``/``fp16`` when that flag is set, else ``default`` (e.g. the precision a plan file
    recorded; ``fp32``, Megatron's default, when nothing says otherwise).

    Raises ``ArgumentError`` (a ``ConfigError``) when both flags are set.
    """
    if bf16 and fp16:
        raise ArgumentError("--bf16=True: cannot be combined with --fp16; choose one precision")
    return "bf16" if bf16 else "fp16" if fp16 else default


def filled(value: int | None) -> int:
    """A field whose None default ``__post_init__`` replaces (``ffn_hidden_size``,
    ``max_position_embeddings``, T5's ``kv_channels``), read as the int it then holds."""
    assert value is not None, "a config field read before __post_init__ filled its default"
    return value


def pad_vocab_size(vocab_size: int, divisible_by: int) -> int:
    """Round ``vocab_size`` up to a multiple of ``divisible_by``.

    Unlike Megatron-LM (which pads to ``divisible_by * tp``) the padding does not depend on the
    tensor-parallel degree: the model, and so its losses, must be the same under every plan.
    Any vocab-TP degree must therefore divide the padded size (checked by the plan).
    """
    if divisible_by <= 0:
        raise ConfigError(
            f"make_vocab_size_divisible_by={divisible_by}: must be a positive integer (e.g. 128)"
        )
    return -(-vocab_size // divisible_by) * divisible_by


# --transformer-impl values (Megatron's) and the FP8 recipes of --fp8-format.
TRANSFORMER_IMPLS = ("local", "transformer_engine")
FP8_FORMATS = ("e4m3", "hybrid")


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a Transformer language model (GPT decoder or BERT encoder).

    ``vocab_size`` is the tokenizer's vocabulary; ``padded_vocab_size`` the embedding rows.
    A subclass for another family (``families.t5.config.T5Config``) widens the accepted model and
    position-embedding types through the two class attributes below.
    """

    model_types: ClassVar[tuple[str, ...]] = MODEL_TYPES
    position_embedding_types: ClassVar[tuple[str, ...]] = POSITION_EMBEDDING_TYPES
    # Whether the family's stages run Megatron sequence parallelism (plans and flags asking for
    # it are refused otherwise, naming the model instead of a sequence-length rule).
    runs_sequence_parallel: ClassVar[bool] = True
    # Whether its stages run context parallelism (per-layer ``cp`` > 1, models/cp_attention.py).
    runs_context_parallel: ClassVar[bool] = True
    # The flag that sets ``seq_length`` (T5: its encoder's), for the messages that name it.
    seq_length_flag: ClassVar[str] = "--seq-length"

    num_layers: int = 4
    hidden_size: int = 256
    num_attention_heads: int = 4
    ffn_hidden_size: int | None = None  # default 4 * hidden_size
    seq_length: int = 128
    max_position_embeddings: int | None = None  # default seq_length
    vocab_size: int = 8192
    make_vocab_size_divisible_by: int = 128
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    layernorm_epsilon: float = 1e-5
    init_method_std: float = 0.02
    position_embedding_type: str = "learned"
    rotary_base: float = 10000.0
    activation: str = "gelu"
    normalization: str = "layernorm"
    untie_embeddings_and_output_weights: bool = False
    model_type: str = "gpt"  # "gpt" (causal) or "bert" (bidirectional)
    bert_binary_head: bool = True  # BERT sentence-order head
    num_tokentypes: int = 0  # BERT token-type embeddings (2 for sentence pairs)
    add_bias_linear: bool = True  # biases of the QKV, output and MLP projections (Megatron's)
    # --add-qkv-bias: a bias on the QKV projection only (Qwen2's attention), where
    # add_bias_linear is off; with add_bias_linear the QKV projection has its bias anyway.
    add_qkv_bias: bool = False
    openai_gelu: bool = False  # GeLU's tanh approximation (GPT-2's ``gelu_new``), not erf
    num_query_groups: int | None = None  # key/value heads (grouped-query attention); None: heads
    # --transformer-impl: our layers, or Transformer Engine's modules behind the same layer
    # interface and parameter names (models/te_layers.py); --fp8-format: TE's FP8 recipe.
    transformer_impl: str = "local"
    fp8_format: str | None = None
    # Mixture of experts (families/gpt/config.py): None is a dense model. Omitted from
    # to_dict() when None, so dense records stay as they were.
    moe: MoEConfig | None = None

    def __post_init__(self) -> None:
        if isinstance(self.moe, Mapping):
            object.__setattr__(self, "moe", _moe_from_dict(self.moe))
        if self.ffn_hidden_size is None:
            object.__setattr__(self, "ffn_hidden_size", 4 * self.hidden_size)
        if self.num_query_groups == self.num_attention_heads:
            # one spelling of multi-head attention, so that configs compare equal and a
            # ``dataclasses.replace`` of the head count keeps meaning "one group per head"
            object.__setattr__(self, "num_query_groups", None)
        if self.max_position_embeddings is None:
            object.__setattr__(self, "max_position_embeddings", self.seq_length)
        self.validate()

    # ------------------------------------------------------------------ derived
    @property
    def padded_vocab_size(self) -> int:
        return pad_vocab_size(self.vocab_size, self.make_vocab_size_divisible_by)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def query_groups(self) -> int:
        """Key/value heads: ``num_query_groups``, or one per attention head (None)."""
        return self.num_attention_heads if self.num_query_groups is None else self.num_query_groups

    @property
    def kv_size(self) -> int:
        """Width of the keys (and of the values): ``query_groups * head_dim``."""
        return self.query_groups * self.head_dim

    @property
    def qkv_bias(self) -> bool:
        """Whether the fused QKV projection has a bias (``--add-qkv-bias`` or all biases)."""
        return self.add_bias_linear or self.add_qkv_bias

    @property
    def causal(self) -> bool:
        return self.model_type == "gpt"

    # ------------------------------------------------------------ mixture of experts
    @property
    def moe_layers(self) -> tuple[int, ...]:
        """Indices of the MoE layers (none in a dense model)."""
        return () if self.moe is None else self.moe.moe_layers(self.num_layers)

    @property
    def moe_shape(self) -> tuple[int, int, tuple[int, ...], int | None] | None:
        """What decides the MoE parameters' names and shapes (experts, expert width, MoE
        layers, shared width); None for a dense model. Checkpoints must agree on it."""
        if self.moe is None:
            return None
        return (self.moe.num_experts, self.expert_ffn_hidden_size, self.moe_layers,
                self.moe.shared_expert_intermediate_size)

    def is_moe_layer(self, layer: int) -> bool:
        return layer in self.moe_layers

    @property
    def expert_ffn_hidden_size(self) -> int:
        """The width of one routed expert (``--moe-ffn-hidden-size``, default the FFN's)."""
        assert self.moe is not None
        return self.moe.expert_ffn(filled(self.ffn_hidden_size))

    def check_expert_parallel(self, layer: int, ep: int, expert_tp: int, tp: int,
                              what: str = "plan field layers") -> None:
        """Raise ``ConfigError`` unless layer ``layer`` can take expert parallelism ``ep`` and
        expert TP ``expert_tp`` (1 and 1 for a dense layer)."""
        where = f"{what}[{layer}]"
        if not self.is_moe_layer(layer):
            if ep != 1 or expert_tp != 1:
                field_name, value = ("ep", ep) if ep != 1 else ("expert_tp", expert_tp)
                raise ConfigError(f"{where}.{field_name}={value}: layer {layer} is dense (MoE "
                                  f"layers: {list(self.moe_layers) or 'none'}); set it to 1")
            return
        assert self.moe is not None
        if self.moe.num_experts % ep:
            raise ConfigError(f"{where}.ep={ep}: must divide --num-experts="
                              f"{self.moe.num_experts} (each EP rank holds whole experts); "
                              f"choose a divisor of the expert count")
        if self.expert_ffn_hidden_size % expert_tp:
            raise ConfigError(f"{where}.expert_tp={expert_tp}: must divide "
                              f"--moe-ffn-hidden-size={self.expert_ffn_hidden_size}; choose a "
                              f"divisor of the expert width")
        shared = self.moe.shared_expert_intermediate_size
        if shared is not None and shared % tp:
            raise ConfigError(f"{where}.tp={tp}: must divide "
                              f"--moe-shared-expert-intermediate-size={shared} (the shared "
                              f"experts are split like the MLP); choose a TP degree dividing it")

    def num_layer_parameters(self, layer: int | None = None) -> int:
        """Parameters of one transformer layer (weights, biases and norms); ``layer``: that
        layer, whose MLP may be an MoE block (None: a dense layer)."""
        h, f, kv = self.hidden_size, filled(self.ffn_hidden_size), self.kv_size
        norm = 2 * h if self.normalization == "layernorm" else h
        fc1 = 2 * f if self.activation == "swiglu" else f
        bias = self.add_bias_linear
        attention = h * (h + 2 * kv) + h * h + ((h + 2 * kv) + h if bias else 0)
        if self.add_qkv_bias and not bias:
            attention += h + 2 * kv
        if layer is not None and self.is_moe_layer(layer):
            assert self.moe is not None
            mlp = (self.moe.num_expert_parameters(h, f, self.activation)
                   + self.moe.num_dense_parameters(h, self.activation))
        else:
            mlp = h * fc1 + f * h + (fc1 + h if bias else 0)
        return attention + mlp + 2 * norm

    def num_parameters(self) -> int:
        """All parameters, counting tied embeddings once."""
        h = self.hidden_size
        emb = self.padded_vocab_size * h
        if self.position_embedding_type == "learned":
            emb += filled(self.max_position_embeddings) * h
        emb += self.num_tokentypes * h
        final_norm = 2 * h if self.normalization == "layernorm" else h
        head = 0 if not self.untie_embeddings_and_output_weights else self.padded_vocab_size * h
        layers = sum(self.num_layer_parameters(i) for i in range(self.num_layers))
        return emb + layers + final_norm + head

    # --------------------------------------------------------------- validation
    def validate(self) -> None:
        def need(cond: bool, flag: str, value: Any, fix: str) -> None:
            if not cond:
                raise ConfigError(f"{flag}={value}: {fix}")

        for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "vocab_size"):
            flag = self.seq_length_flag if name == "seq_length" else f"--{name.replace('_', '-')}"
            need(getattr(self, name) > 0, flag, getattr(self, name), "must be a positive integer")
        need(filled(self.ffn_hidden_size) > 0, "--ffn-hidden-size", self.ffn_hidden_size,
             "must be a positive integer")
        need(self.hidden_size % self.num_attention_heads == 0, "--hidden-size", self.hidden_size,
             f"must be divisible by --num-attention-heads={self.num_attention_heads}; "
             f"choose a hidden size that is a multiple of the head count")
        need(filled(self.max_position_embeddings) >= self.seq_length, "--max-position-embeddings",
             self.max_position_embeddings,
             f"must be at least {self.seq_length_flag}={self.seq_length}")
        need(0.0 <= self.hidden_dropout < 1.0, "--hidden-dropout", self.hidden_dropout,
             "must be in [0, 1)")
        need(0.0 <= self.attention_dropout < 1.0, "--attention-dropout", self.attention_dropout,
             "must be in [0, 1)")
        need(self.position_embedding_type in self.position_embedding_types,
             "--position-embedding-type", self.position_embedding_type,
             f"choose one of {', '.join(self.position_embedding_types)}")
        need(self.activation in ACTIVATIONS, "--activation", self.activation,
             f"choose one of {', '.join(ACTIVATIONS)}")
        need(self.normalization in NORMALIZATIONS, "--normalization", self.normalization,
             f"choose one of {', '.join(NORMALIZATIONS)}")
        need(self.model_type in self.model_types, "model_type", self.model_type,
             f"choose one of {', '.join(self.model_types)}")
        if self.position_embedding_type == "rope":
            need(self.head_dim % 2 == 0, "--hidden-size", self.hidden_size,
                 "rotary embeddings need an even head dimension (hidden/heads)")
        groups = self.query_groups
        need(isinstance(groups, int) and not isinstance(groups, bool) and groups > 0
             and self.num_attention_heads % groups == 0, "--num-query-groups", groups,
             f"must be a positive divisor of --num-attention-heads={self.num_attention_heads} "
             f"(each key/value head serves the same number of query heads)")
        need(self.transformer_impl in TRANSFORMER_IMPLS, "--transformer-impl",
             self.transformer_impl, f"choose one of {', '.join(TRANSFORMER_IMPLS)}")
        need(self.fp8_format in (None,) + FP8_FORMATS, "--fp8-format", self.fp8_format,
             f"choose one of {', '.join(FP8_FORMATS)}")
        need(self.fp8_format is None or self.transformer_impl == "transformer_engine",
             "--fp8-format", self.fp8_format,
             "needs --transformer-impl transformer_engine (FP8 GEMMs are Transformer Engine's); "
             "add it or drop --fp8-format")
        if self.moe is not None:
            self._validate_moe(need)

    def _validate_moe(self, need: Any) -> None:
        """What an MoE model needs of the rest of the config (the MoE flags check themselves)."""
        assert self.moe is not None
        try:
            self.moe.check_num_layers(self.num_layers)
        except MoEConfigError as err:
            raise ConfigError(str(err)) from None
        need(not self.add_bias_linear, "--num-experts", self.moe.num_experts,
             "the experts have no biases (as Mixtral, DeepSeek and Qwen-MoE); add "
             "--disable-bias-linear")
        need(self.transformer_impl == "local", "--num-experts", self.moe.num_experts,
             f"MoE layers run with --transformer-impl local only (not {self.transformer_impl})")
        need(self.model_type == "gpt", "--num-experts", self.moe.num_experts,
             f"mixture of experts is built for GPT models, not {self.model_type}; drop the MoE "
             f"flags")

    @property
    def runs_module_recompute(self) -> bool:
        """Whether the layers recompute single modules (plan ``recompute`` "selective" or a
        module list); the Transformer Engine layer recomputes whole layers only."""
        return self.transformer_impl != "transformer_engine"

    def check_tensor_parallel(self, tp: int, what: str = "--tensor-model-parallel-size") -> None:
        """Raise ``ConfigError`` unless a TP degree ``tp`` can split this model's layers."""
        if tp < 1:
            raise ConfigError(f"{what}={tp}: must be a positive integer")
        if self.num_attention_heads % tp:
            raise ConfigError(
                f"{what}={tp}: must divide --num-attention-heads={self.num_attention_heads}; "
                f"use a TP degree that divides the head count")
        if self.query_groups % tp:
            raise ConfigError(
                f"{what}={tp}: must divide --num-query-groups={self.query_groups} (every TP "
                f"rank holds whole key/value heads); use a TP degree that divides the group count")
        if filled(self.ffn_hidden_size) % tp:
            raise ConfigError(
                f"{what}={tp}: must divide --ffn-hidden-size={self.ffn_hidden_size}; "
                f"use a TP degree that divides the FFN size")

    def check_vocab_parallel(self, tp: int, what: str = "vocab tp") -> None:
        if tp < 1 or self.padded_vocab_size % tp:
            raise ConfigError(
                f"{what}={tp}: must divide the padded vocabulary size {self.padded_vocab_size} "
                f"(--vocab-size={self.vocab_size} padded to a multiple of "
                f"--make-vocab-size-divisible-by={self.make_vocab_size_divisible_by}); "
                f"raise --make-vocab-size-divisible-by or lower the TP degree")

    # ----------------------------------------------------------------- JSON
    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        if self.moe is None:  # dense records stay as they were
            del out["moe"]
        else:
            out["moe"] = self.moe.to_dict()
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ModelConfig":
        unknown, known = unknown_fields(cls, data)
        if unknown:
            raise ConfigError(f"model config: unknown field(s) {unknown}; known fields are {known}")
        return cls(**dict(data))


def _moe_from_dict(data: Mapping[str, Any]) -> MoEConfig:
    """A record's ``moe`` entry, its errors as ``ConfigError``."""
    try:
        return MoEConfig.from_dict(data)
    except (MoEConfigError, TypeError) as err:
        raise ConfigError(f"model config moe: {err}") from None
