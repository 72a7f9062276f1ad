"""What the planner plans for: the model as a sequence of layer types, and the training setup.

A model is a stack of transformer layers, each of one *layer type* (a shape: hidden size, heads,
FFN size, sequence length). GPT and BERT have one type; an encoder-decoder or a Swin-like model
with stages of different widths has several. Layers of one type cost the same, which the search
exploits (a stage's cost depends only on which types it holds, in which order, and where it sits
in the pipeline).

The planner knows no model family: each family builds the spec of its configs
(``megatron_auto.families``), with as many layer types as it has. Pure data: no torch, no
numpy. Every check raises :class:`SpecError` naming the field, the value
and a fix.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

PRECISIONS = ("fp32", "bf16", "fp16")
OPTIMIZERS = ("adam",)
ACTIVATIONS = ("gelu", "swiglu")
class SpecError(ValueError):
    """An invalid model or training description; the message names field, value and fix."""


def _need(cond: bool, name: str, value: Any, fix: str) -> None:
    if not cond:
        raise SpecError(f"{name}={value!r}: {fix}")


@dataclass(frozen=True)
class ExpertSpec:
    """The routed experts of an MoE layer type (``LayerType.moe``), as the cost model sees them
    (``planner/cost/moe.py`` prices them): ``num_experts`` experts of width ``ffn_hidden_size``
    (the layer's activation, no biases), ``topk`` chosen per token by a linear router of
    ``num_experts x hidden`` weights, and ``capacity_factor`` (0: dropless; else each expert
    takes at most that many times its even share of a sequence's assignments)."""

    num_experts: int
    topk: int
    ffn_hidden_size: int
    capacity_factor: float = 0.0

    def __post_init__(self) -> None:
        for attr in ("num_experts", "topk", "ffn_hidden_size"):
            value = getattr(self, attr)
            _need(isinstance(value, int) and not isinstance(value, bool) and value >= 1,
                  f"moe.{attr}", value, "must be a positive integer")
        _need(self.topk <= self.num_experts, "moe.topk", self.topk,
              f"must be at most num_experts={self.num_experts}")
        _need(self.capacity_factor >= 0, "moe.capacity_factor", self.capacity_factor,
              "must be >= 0 (0: dropless)")


@dataclass(frozen=True)
class LayerType:
    """One kind of transformer layer: attention + MLP with the given shape.

    ``count`` is how many layers of this type the model has (informational; ``ModelSpec.layer_order``
    is authoritative). ``causal`` only matters for the FLOP count of attention (we charge the full
    ``s x s`` score matrix either way, see docs/cost_model.md).

    Vision layers (Swin): ``window_size`` ``w > 0`` means attention inside ``w x w`` windows
    (each token attends ``w^2`` tokens, plus a ``(2w-1)^2 x heads`` relative position bias);
    ``merge_input_hidden`` ``m > 0`` means the layer begins with a patch merging from width ``m``
    (2x2 neighbours concatenated to ``4m``, normalised, projected to ``hidden_size``).

    ``num_query_groups`` ``g`` is the key/value head count of grouped-query attention (0: one
    per attention head); keys and values are ``g * head_dim`` wide and TP must divide ``g``.
    ``add_bias_linear=False``: the four projections have no bias (``add_qkv_bias``: but the
    QKV projection has one, as Qwen2's attention); ``normalization`` decides
    whether a norm has a bias (LayerNorm) or not (RMSNorm).

    Encoder-decoder layers (T5): ``kv_channels`` ``> 0`` is the width of one head (default
    ``hidden_size / heads``); ``cross_attention_seq_length`` ``> 0`` means the layer also attends
    that many encoder tokens (a decoder layer: query, key/value and output projections, norm);
    ``carried_seq_length`` tokens of width ``hidden_size`` travel beside the layer's own hidden
    state through every relayout and stage boundary around it (the pipeline carry).

    MoE layers (``moe``, an :class:`ExpertSpec`): the MLP is replaced by routed experts (and
    optional shared experts); ``ffn_hidden_size`` is then the shared experts' width, 0 for
    none, and :attr:`num_parameters` counts the router (replicated over TP) but not the routed
    experts (the cost model prices them apart: replicated over TP, split over ``ep``, in their
    own DP flavour).
    """

    name: str
    hidden_size: int
    num_attention_heads: int
    ffn_hidden_size: int
    seq_length: int
    count: int
    activation: str = "gelu"
    causal: bool = True
    window_size: int = 0
    merge_input_hidden: int = 0
    num_query_groups: int = 0
    add_bias_linear: bool = True
    normalization: str = "layernorm"
    kv_channels: int = 0
    cross_attention_seq_length: int = 0
    carried_seq_length: int = 0
    add_qkv_bias: bool = False
    moe: ExpertSpec | None = None

    def __post_init__(self) -> None:
        where = f"layer_types[{self.name!r}]"
        _need(self.moe is None or isinstance(self.moe, ExpertSpec), f"{where}.moe", self.moe,
              "must be an ExpertSpec or None (a dense layer)")
        _need(self.num_query_groups == 0 or (self.num_query_groups > 0 and
                                             self.num_attention_heads % self.num_query_groups == 0),
              f"{where}.num_query_groups", self.num_query_groups,
              f"must divide num_attention_heads={self.num_attention_heads} (0: one per head)")
        _need(self.normalization in ("layernorm", "rmsnorm"), f"{where}.normalization",
              self.normalization, "choose layernorm or rmsnorm")
        for attr in ("window_size", "merge_input_hidden", "kv_channels",
                     "cross_attention_seq_length", "carried_seq_length"):
            value = getattr(self, attr)
            _need(isinstance(value, int) and not isinstance(value, bool) and value >= 0,
                  f"{where}.{attr}", value, "must be an integer >= 0 (0: not used)")
        positive: tuple[str, ...] = ("hidden_size", "num_attention_heads", "seq_length", "count")
        # an MoE layer without shared experts has no dense MLP (ffn_hidden_size 0)
        if self.moe is None or self.ffn_hidden_size != 0:
            positive += ("ffn_hidden_size",)
        for attr in positive:
            value = getattr(self, attr)
            _need(isinstance(value, int) and not isinstance(value, bool) and value >= 1,
                  f"{where}.{attr}", value, "must be a positive integer")
        _need(self.hidden_size % self.num_attention_heads == 0, f"{where}.hidden_size",
              self.hidden_size, f"must be divisible by num_attention_heads={self.num_attention_heads}")
        _need(self.activation in ACTIVATIONS, f"{where}.activation", self.activation,
              f"choose one of {', '.join(ACTIVATIONS)}")

    @property
    def kv_size(self) -> int:
        """Width of the keys (and of the values): ``g * head_dim``, ``h`` without GQA."""
        groups = self.num_query_groups or self.num_attention_heads
        return groups * (self.kv_channels or self.hidden_size // self.num_attention_heads)

    @property
    def num_parameters(self) -> int:
        """Weights, biases and the norms of one layer (Megatron GPT/BERT layout; T5's
        decoder adds cross-attention; an MoE layer's shared experts and router, not its routed
        experts)."""
        h, f, kv, p = self.hidden_size, self.ffn_hidden_size, self.kv_size, self.attention_width
        bias = 1 if self.add_bias_linear else 0
        # fused QKV ((p + 2kv) x h) and output projection (h x p), with their biases
        attention = 2 * h * p + 2 * h * kv + bias * (p + h + 2 * kv)
        if self.add_qkv_bias and not bias:
            attention += p + 2 * kv
        if f == 0:  # an MoE layer without shared experts
            mlp = 0
        elif self.activation == "swiglu":
            mlp = 3 * h * f + bias * (2 * f + h)  # two input projections (gate, up), one output
        else:
            mlp = 2 * h * f + bias * (f + h)
        norms = 4 * h if self.normalization == "layernorm" else 2 * h
        extra = 0
        if self.cross_attention_seq_length:
            # query (p x h), fused key/value (2p x h) and output projections, and their norm
            extra += 4 * h * p + bias * (3 * p + h) + norms // 2
        if self.window_size:
            extra += (2 * self.window_size - 1) ** 2 * self.num_attention_heads
        if self.merge_input_hidden:
            m = self.merge_input_hidden
            extra += 4 * m * h + 2 * 4 * m  # reduction (no bias) and its norm
        if self.moe is not None:  # the router (E x h, no bias); the experts are apart
            extra += self.moe.num_experts * h
        return attention + mlp + norms + extra

    @property
    def attention_width(self) -> int:
        """Width of all heads together: ``heads * kv_channels`` (``hidden_size`` by default)."""
        return self.num_attention_heads * self.kv_channels if self.kv_channels else self.hidden_size

    @property
    def boundary_seq_length(self) -> int:
        """Tokens per sample a relayout or stage boundary next to this layer moves."""
        return self.seq_length + self.carried_seq_length

    @property
    def attended_tokens(self) -> int:
        """Keys each query attends: the window's tokens, else the whole sequence."""
        return self.window_size ** 2 if self.window_size else self.seq_length

    def tp_divides(self, tp: int) -> bool:
        """Whether Megatron tensor parallelism of degree ``tp`` can split this layer."""
        groups = self.num_query_groups or self.num_attention_heads
        return (self.num_attention_heads % tp == 0 and self.ffn_hidden_size % tp == 0
                and groups % tp == 0)


@dataclass(frozen=True)
class ModelSpec:
    """A model as the planner sees it.

    ``layer_order[i]`` is the index into ``layer_types`` of transformer layer ``i``.
    ``vocab_size`` is the padded vocabulary (embedding rows). ``num_position_embeddings`` is 0 for
    rotary models. ``config`` is the record of the model this spec came from, written as the
    plan's ``model`` (the runtime checks every key present against its own config): only what
    decides the costs, so that a different dropout or init does not invalidate a plan, and
    ``model_type``, which names the model's family. The family's spec builder
    (``megatron_auto.families``) fills it; it does not take part in equality.
    """

    layer_types: tuple[LayerType, ...]
    layer_order: tuple[int, ...]
    vocab_size: int
    embedding_hidden_size: int
    seq_length: int
    tied_embeddings: bool = True
    name: str = ""
    num_position_embeddings: int = 0
    config: Mapping[str, Any] | None = field(default=None, compare=False, hash=False)
    # Image classifiers: the patch embedding's and the head's
    # parameter counts, the tokens the head projects (1: a pooled image) and its width.
    embedding_parameter_count: int | None = None
    head_parameter_count: int | None = None
    head_tokens: int | None = None
    head_hidden_size: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        object.__setattr__(self, "layer_order", tuple(self.layer_order))
        _need(len(self.layer_types) >= 1, "layer_types", self.layer_types,
              "give at least one LayerType")
        _need(len(self.layer_order) >= 1, "layer_order", self.layer_order,
              "give the type index of every transformer layer")
        names = [t.name for t in self.layer_types]
        _need(len(set(names)) == len(names), "layer_types[*].name", names, "names must be unique")
        for i, t in enumerate(self.layer_order):
            _need(isinstance(t, int) and 0 <= t < len(self.layer_types), f"layer_order[{i}]", t,
                  f"must index layer_types (0..{len(self.layer_types) - 1})")
        for k, lt in enumerate(self.layer_types):
            n = sum(1 for t in self.layer_order if t == k)
            _need(n == lt.count, f"layer_types[{lt.name!r}].count", lt.count,
                  f"layer_order holds {n} layers of this type; make them agree")
        for attr in ("vocab_size", "embedding_hidden_size", "seq_length"):
            value = getattr(self, attr)
            _need(isinstance(value, int) and value >= 1, attr, value, "must be a positive integer")
        _need(self.num_position_embeddings >= 0, "num_position_embeddings",
              self.num_position_embeddings, "must be >= 0 (0 for rotary embeddings)")

    @property
    def num_layers(self) -> int:
        return len(self.layer_order)

    def layer_type(self, layer: int) -> LayerType:
        return self.layer_types[self.layer_order[layer]]

    @property
    def embedding_parameters(self) -> int:
        """Word (and position) embedding rows: the first stage's share."""
        if self.embedding_parameter_count is not None:
            return self.embedding_parameter_count
        return (self.vocab_size + self.num_position_embeddings) * self.embedding_hidden_size

    @property
    def head_parameters(self) -> int:
        """Final norm and (untied) output projection: the last stage's share.

        With tied embeddings the last stage holds its own copy of the word embedding (kept in
        sync by an all-reduce), so its parameters are counted there too when ``pp > 1``.
        """
        if self.head_parameter_count is not None:
            return self.head_parameter_count
        h = self.embedding_hidden_size
        return 2 * h + (0 if self.tied_embeddings else self.vocab_size * h)

    def max_common_tp(self) -> int:
        """Largest power of two that can split every layer type."""
        tp = 1
        while all(t.tp_divides(tp * 2) for t in self.layer_types) and tp < 1 << 20:
            tp *= 2
        return tp

    def plan_model_record(self) -> dict[str, Any]:
        """The ``model`` record of a plan (docs/design.md §5.2): ``config`` when the spec has
        one (its family's builder chose those fields), else the shape of its layers."""
        if self.config is not None:
            return dict(self.config)
        lt = self.layer_types[0]
        record: dict[str, Any] = {"name": self.name, "num_layers": self.num_layers}
        if len(self.layer_types) == 1:
            record.update(hidden_size=lt.hidden_size, num_attention_heads=lt.num_attention_heads,
                          ffn_hidden_size=lt.ffn_hidden_size, seq_length=lt.seq_length)
        else:
            record["layer_types"] = [t.name for t in self.layer_types]
        return record

    # ----------------------------------------------------------------- builders
    @classmethod
    def uniform(cls, num_layers: int, hidden_size: int, num_attention_heads: int,
                seq_length: int, vocab_size: int, ffn_hidden_size: int | None = None,
                name: str = "gpt", causal: bool = True, activation: str = "gelu",
                num_position_embeddings: int | None = None) -> "ModelSpec":
        """A single-type stack (GPT if ``causal``, BERT otherwise) without a ModelConfig."""
        lt = LayerType(name=name, hidden_size=hidden_size, num_attention_heads=num_attention_heads,
                       ffn_hidden_size=ffn_hidden_size or 4 * hidden_size, seq_length=seq_length,
                       count=num_layers, activation=activation, causal=causal)
        return cls(layer_types=(lt,), layer_order=(0,) * num_layers, vocab_size=vocab_size,
                   embedding_hidden_size=hidden_size, seq_length=seq_length, name=name,
                   num_position_embeddings=seq_length if num_position_embeddings is None
                   else num_position_embeddings)

    @classmethod
    def stacked(cls, types_and_counts: list[tuple[LayerType, int]], vocab_size: int,
                embedding_hidden_size: int, seq_length: int, name: str = "") -> "ModelSpec":
        """Blocks of layers in the given order, e.g. ``[(encoder, 12), (decoder, 12)]``."""
        types: list[LayerType] = []
        order: list[int] = []
        for lt, n in types_and_counts:
            if lt.name not in [t.name for t in types]:
                types.append(lt)
            order.extend([[t.name for t in types].index(lt.name)] * n)
        types = [LayerType(**{**t.__dict__, "count": order.count(k)}) for k, t in enumerate(types)]
        return cls(layer_types=tuple(types), layer_order=tuple(order), vocab_size=vocab_size,
                   embedding_hidden_size=embedding_hidden_size, seq_length=seq_length, name=name)


@dataclass(frozen=True)
class TrainingSpec:
    """Batch and numerics. Mixed precision (bf16/fp16) keeps fp32 master weights and gradients."""

    global_batch_size: int
    precision: str = "bf16"
    optimizer: str = "adam"

    def __post_init__(self) -> None:
        _need(isinstance(self.global_batch_size, int) and self.global_batch_size >= 1,
              "global_batch_size", self.global_batch_size, "must be a positive integer")
        _need(self.precision in PRECISIONS, "precision", self.precision,
              f"choose one of {', '.join(PRECISIONS)}")
        _need(self.optimizer in OPTIMIZERS, "optimizer", self.optimizer,
              f"choose one of {', '.join(OPTIMIZERS)}")

    @property
    def compute_bytes(self) -> int:
        """Bytes per element of activations and TP messages (the autocast dtype)."""
        return 4 if self.precision == "fp32" else 2

    @property
    def mixed(self) -> bool:
        return self.precision != "fp32"
