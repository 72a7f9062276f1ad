"""Our GPT / BERT parameters <-> Hugging Face ``transformers`` GPT-2, LLaMA and Megatron-BERT.

Pure tensor arithmetic on whole (one-process) state dicts keyed by FQN; no ``transformers``
import here (:mod:`.hf` does that). The three architectures and what they require of our model:

- ``gpt2`` (``GPT2LMHeadModel``): learned positions, LayerNorm, GeLU (``gelu_new``, the tanh
  approximation, with ``--openai-gelu``; ``gelu`` without), linear biases, one key/value head
  per head. GPT-2 stores its projections as ``Conv1D`` weights ``(in, out)``: the transpose of
  ours, and its fused ``c_attn`` columns are all queries, then all keys, then all values.
- ``llama`` (``LlamaForCausalLM``): RoPE, SwiGLU, RMSNorm; separate q/k/v projections
  (``num_key_value_heads`` = our ``num_query_groups``), gate/up/down MLP; biases with
  ``attention_bias = mlp_bias = add_bias_linear``; tied or untied head (``tie_word_embeddings``).
- ``mixtral`` (``MixtralForCausalLM``): LLaMA with every MLP a mixture of experts
  (``hf_mixtral.py`` maps the router and experts), no biases.
- ``megatron-bert`` (``MegatronBertForPreTraining``, or ``...ForMaskedLM`` without the binary
  head): pre-LayerNorm BERT with a final LayerNorm and no embedding norm, which is our BERT;
  the sentence-order head maps onto ``cls.seq_relationship``.

Layouts on our side (``models/transformer.py``): ``linear_qkv`` rows are ``(g, heads/g + 2,
head_dim)`` (per key/value group its queries, its key, its value); SwiGLU's ``linear_fc1`` rows
interleave ``(gate_i, up_i)``. The embedding (and untied head, and BERT's output bias) has the
padded vocabulary's rows: export keeps the first ``vocab_size``, import pads with zeros.
"""

from __future__ import annotations

from typing import Any

import torch

from ..config import ModelConfig
from ..families.registry import family_of
from .hf_mixtral import (experts_from_hf, experts_to_hf, mixtral_config_kwargs, mixtral_fields,
                         mixtral_problem)

ARCHITECTURES = ("gpt2", "llama", "mixtral", "megatron-bert")
TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh")

State = dict[str, torch.Tensor]


class ConversionError(ValueError):
    """A model or checkpoint that cannot be converted; the message names what and the fix."""


# --------------------------------------------------------------------- tensor layouts
def split_qkv(t: torch.Tensor, cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Our fused QKV weight (or bias) -> (q, k, v) with rows in head order."""
    g, d = cfg.query_groups, cfg.head_dim
    n = cfg.num_attention_heads // g
    grouped = t.reshape(g, n + 2, d, *t.shape[1:])
    rest = tuple(t.shape[1:])
    q = grouped[:, :n].reshape(g * n * d, *rest)
    return q, grouped[:, n].reshape(g * d, *rest), grouped[:, n + 1].reshape(g * d, *rest)


def merge_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """(q, k, v) in head order -> our fused QKV layout (inverse of :func:`split_qkv`)."""
    g, d = cfg.query_groups, cfg.head_dim
    n = cfg.num_attention_heads // g
    rest = tuple(q.shape[1:])
    return torch.cat([q.reshape(g, n, d, *rest), k.reshape(g, 1, d, *rest),
                      v.reshape(g, 1, d, *rest)], dim=1).reshape(-1, *rest)


def split_gate_up(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Our interleaved SwiGLU fc1 rows ``(gate_0, up_0, gate_1, ...)`` -> (gate, up)."""
    pairs = t.reshape(t.shape[0] // 2, 2, *t.shape[1:])
    return pairs[:, 0], pairs[:, 1]


def merge_gate_up(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.stack([gate, up], dim=1).reshape(2 * gate.shape[0], *gate.shape[1:])


def _rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """The first ``rows`` rows of ``t``, or ``t`` padded with zero rows to ``rows``."""
    if t.shape[0] >= rows:
        return t[:rows]
    return torch.cat([t, t.new_zeros((rows - t.shape[0],) + tuple(t.shape[1:]))])


# --------------------------------------------------------------------- what fits where
def export_problem(cfg: ModelConfig, arch: str) -> str | None:
    """Why ``cfg`` cannot be written as ``arch`` (one clause naming the field and the fix), or
    None when it can."""
    def check(pairs: list[tuple[bool, str]]) -> str | None:
        return next((why for ok, why in pairs if not ok), None)

    family = family_of(cfg)  # which architectures its family converts to (BERT's, GPT's)
    if arch == "megatron-bert":
        if arch not in family.hf_architectures:
            return (f"model_type={cfg.model_type}: Megatron-BERT is an encoder; use "
                    f"{' or '.join(family.hf_architectures)}")
        return check([
            (cfg.position_embedding_type == "learned", "position_embedding_type=rope: "
             "Megatron-BERT has learned positions"),
            (cfg.normalization == "layernorm", "normalization=rmsnorm: Megatron-BERT uses "
             "LayerNorm"),
            (cfg.activation == "gelu", "activation=swiglu: Megatron-BERT's MLP is GeLU"),
            (cfg.add_bias_linear, "add_bias_linear=False (--disable-bias-linear): Megatron-BERT "
             "has linear biases"),
            (cfg.query_groups == cfg.num_attention_heads, f"num_query_groups="
             f"{cfg.query_groups}: Megatron-BERT has one key/value head per head"),
        ])
    if arch in ARCHITECTURES and arch not in family.hf_architectures:
        return f"model_type={cfg.model_type}: {arch} is a decoder; use --hf-architecture " \
               f"{family.hf_architectures[0]} for {cfg.model_type.upper()}"
    if arch not in _DECODERS:
        return f"--hf-architecture={arch}: choose one of {', '.join(ARCHITECTURES)}"
    problem = _decoder_problem(cfg, arch)
    if problem is None:
        return None
    if arch == "mixtral" or cfg.moe is not None:  # experts fit Mixtral only, dense models not
        fits = [a for a in _DECODERS if a != arch and _decoder_problem(cfg, a) is None]
        return problem + (f"; use --hf-architecture {fits[0]}" if fits else "")
    other = "llama" if arch == "gpt2" else "gpt2"
    other_problem = _decoder_problem(cfg, other)
    if other_problem is None:
        return f"{problem}; use --hf-architecture {other}"
    # Each decoder refuses a different field: name both, so that neither points at the other.
    return (f"{problem}, and {_DECODERS[other]} cannot hold it either ({other_problem}): no "
            f"Hugging Face architecture here holds this combination; change one of the two "
            f"fields and retrain, or keep the model in our checkpoint format")


_DECODERS = {"gpt2": "GPT-2", "llama": "LLaMA", "mixtral": "Mixtral"}


def _decoder_problem(cfg: ModelConfig, arch: str) -> str | None:
    """The first field of the decoder ``cfg`` that ``arch`` (gpt2 or llama) cannot hold, as a
    clause naming the field and why, or None."""
    if arch == "mixtral":
        return mixtral_problem(cfg)
    if cfg.moe is not None:
        return f"num_experts={cfg.moe.num_experts}: {_DECODERS[arch]} has no experts"
    if arch == "gpt2":
        pairs = [
            (cfg.position_embedding_type == "learned", "position_embedding_type=rope: GPT-2 "
             "learns positions"),
            (cfg.normalization == "layernorm", "normalization=rmsnorm: GPT-2 uses LayerNorm"),
            (cfg.activation == "gelu", "activation=swiglu: GPT-2's MLP is GeLU"),
            (cfg.add_bias_linear, "add_bias_linear=False (--disable-bias-linear): GPT-2 has "
             "linear biases"),
            (cfg.query_groups == cfg.num_attention_heads, f"num_query_groups="
             f"{cfg.query_groups}: GPT-2 has one key/value head per head"),
        ]
    else:
        pairs = [
            (cfg.position_embedding_type == "rope", "position_embedding_type=learned: LLaMA "
             "uses rotary embeddings"),
            (cfg.normalization == "rmsnorm", "normalization=layernorm: LLaMA uses RMSNorm"),
            (cfg.activation == "swiglu", "activation=gelu: LLaMA's MLP is SwiGLU"),
        ]
    return next((why for ok, why in pairs if not ok), None)


def pick_architecture(cfg: ModelConfig) -> str:
    """The architecture ``--hf-architecture auto`` writes: the family's first (BERT's
    Megatron-BERT, GPT's GPT-2), LLaMA for a RoPE model of a family that has it
    (:func:`export_problem` then says what does not fit, if anything)."""
    architectures = family_of(cfg).hf_architectures
    if "mixtral" in architectures and cfg.moe is not None:
        return "mixtral"
    if "llama" in architectures and cfg.position_embedding_type == "rope":
        return "llama"
    return architectures[0]


def hf_config_kwargs(cfg: ModelConfig, arch: str) -> dict[str, Any]:
    """Keyword arguments of the ``transformers`` config class of ``arch`` describing ``cfg``."""
    common = {"vocab_size": cfg.vocab_size, "initializer_range": cfg.init_method_std}
    if arch == "gpt2":
        kwargs = dict(common, n_positions=cfg.max_position_embeddings, n_embd=cfg.hidden_size,
                      n_layer=cfg.num_layers, n_head=cfg.num_attention_heads,
                      n_inner=cfg.ffn_hidden_size,
                      activation_function="gelu_new" if cfg.openai_gelu else "gelu",
                      layer_norm_epsilon=cfg.layernorm_epsilon, resid_pdrop=cfg.hidden_dropout,
                      embd_pdrop=cfg.hidden_dropout, attn_pdrop=cfg.attention_dropout,
                      tie_word_embeddings=not cfg.untie_embeddings_and_output_weights,
                      architectures=["GPT2LMHeadModel"])
        if cfg.vocab_size <= 50256:  # GPT-2's default special ids would lie outside the vocab
            kwargs.update(bos_token_id=None, eos_token_id=None)
        return kwargs
    if arch in ("llama", "mixtral"):
        llama = dict(common, hidden_size=cfg.hidden_size, intermediate_size=cfg.ffn_hidden_size,
                    num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_attention_heads,
                    num_key_value_heads=cfg.query_groups, head_dim=cfg.head_dim,
                    hidden_act="silu", max_position_embeddings=cfg.max_position_embeddings,
                    rms_norm_eps=cfg.layernorm_epsilon, rope_theta=cfg.rotary_base,
                    attention_bias=cfg.add_bias_linear, mlp_bias=cfg.add_bias_linear,
                    attention_dropout=cfg.attention_dropout,
                    tie_word_embeddings=not cfg.untie_embeddings_and_output_weights,
                    architectures=["LlamaForCausalLM"])
        return llama if arch == "llama" else mixtral_config_kwargs(cfg, llama)
    head = "MegatronBertForPreTraining" if cfg.bert_binary_head else "MegatronBertForMaskedLM"
    return dict(common, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
                num_attention_heads=cfg.num_attention_heads,
                intermediate_size=cfg.ffn_hidden_size,
                hidden_act="gelu_new" if cfg.openai_gelu else "gelu",
                hidden_dropout_prob=cfg.hidden_dropout,
                attention_probs_dropout_prob=cfg.attention_dropout,
                max_position_embeddings=cfg.max_position_embeddings,
                type_vocab_size=max(cfg.num_tokentypes, 1), layer_norm_eps=cfg.layernorm_epsilon,
                position_embedding_type="absolute", architectures=[head])


# --------------------------------------------------------------------- HF config -> ours
def _rope(hf: Any) -> tuple[float, str]:
    """(theta, rope type) from a LLaMA config of transformers 5 (``rope_parameters``) or 4
    (``rope_theta`` / ``rope_scaling``)."""
    params = getattr(hf, "rope_parameters", None) or {}
    scaling = getattr(hf, "rope_scaling", None) or {}
    theta = params.get("rope_theta", getattr(hf, "rope_theta", 10000.0))
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    return float(theta), str(kind)


def model_fields_from_hf(hf: Any, arch: str) -> tuple[dict[str, Any], dict[str, str]]:
    """(ModelConfig fields, our field -> the HF config key it came from) of an HF config.

    Raises :class:`ConversionError` naming the HF config key when the model uses something our
    models do not have.
    """
    def need(ok: bool, key: str, value: Any, fix: str) -> None:
        if not ok:
            raise ConversionError(f"the Hugging Face config has {key}={value!r}: {fix}")

    if arch == "gpt2":
        act = hf.activation_function
        need(act in TANH_GELUS + ("gelu",), "activation_function", act,
             "only GeLU (gelu_new / gelu_pytorch_tanh: --openai-gelu; gelu) converts")
        need(bool(getattr(hf, "scale_attn_weights", True)), "scale_attn_weights", False,
             "our attention always scales scores by 1/sqrt(head_dim)")
        need(not getattr(hf, "scale_attn_by_inverse_layer_idx", False),
             "scale_attn_by_inverse_layer_idx", True, "our attention has no per-layer scaling")
        need(not getattr(hf, "add_cross_attention", False), "add_cross_attention", True,
             "a decoder with cross-attention does not convert")
        fields = dict(num_layers=hf.n_layer, hidden_size=hf.n_embd,
                      num_attention_heads=hf.n_head, ffn_hidden_size=hf.n_inner or 4 * hf.n_embd,
                      max_position_embeddings=hf.n_positions, vocab_size=hf.vocab_size,
                      layernorm_epsilon=hf.layer_norm_epsilon, openai_gelu=act in TANH_GELUS,
                      untie_embeddings_and_output_weights=not hf.tie_word_embeddings)
        names = dict(num_layers="n_layer", hidden_size="n_embd", num_attention_heads="n_head",
                     ffn_hidden_size="n_inner", max_position_embeddings="n_positions",
                     layernorm_epsilon="layer_norm_epsilon", openai_gelu="activation_function",
                     activation="activation_function",
                     untie_embeddings_and_output_weights="tie_word_embeddings")
    elif arch in ("llama", "mixtral"):
        need(hf.hidden_act == "silu", "hidden_act", hf.hidden_act,
             "our SwiGLU gates with SiLU; only silu converts")
        theta, kind = _rope(hf)
        need(kind == "default", "rope_type", kind,
             "only unscaled rotary embeddings convert (no rope scaling)")
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        need(head_dim * hf.num_attention_heads == hf.hidden_size, "head_dim", head_dim,
             f"our heads are hidden_size / num_attention_heads = "
             f"{hf.hidden_size // hf.num_attention_heads} wide")
        attention_bias = bool(getattr(hf, "attention_bias", False))
        mlp_bias = bool(getattr(hf, "mlp_bias", False))
        need(attention_bias == mlp_bias, "mlp_bias", mlp_bias,
             f"--disable-bias-linear drops all four projections' biases; attention_bias="
             f"{attention_bias} and mlp_bias must agree")
        groups = getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads
        fields = dict(num_layers=hf.num_hidden_layers, hidden_size=hf.hidden_size,
                      num_attention_heads=hf.num_attention_heads,
                      ffn_hidden_size=hf.intermediate_size, num_query_groups=groups,
                      max_position_embeddings=hf.max_position_embeddings,
                      vocab_size=hf.vocab_size, layernorm_epsilon=hf.rms_norm_eps,
                      position_embedding_type="rope", rotary_base=theta, activation="swiglu",
                      normalization="rmsnorm", add_bias_linear=attention_bias,
                      untie_embeddings_and_output_weights=not hf.tie_word_embeddings)
        names = dict(num_layers="num_hidden_layers", ffn_hidden_size="intermediate_size",
                     num_query_groups="num_key_value_heads", layernorm_epsilon="rms_norm_eps",
                     rotary_base="rope_theta", add_bias_linear="attention_bias",
                     untie_embeddings_and_output_weights="tie_word_embeddings")
        if arch == "mixtral":
            mixtral_fields(hf, need, fields, names)
    else:
        need(hf.hidden_act in TANH_GELUS + ("gelu",), "hidden_act", hf.hidden_act,
             "only GeLU (gelu; gelu_new: --openai-gelu) converts")
        kind = getattr(hf, "position_embedding_type", "absolute")
        need(kind == "absolute", "position_embedding_type", kind,
             "only absolute (learned) positions convert")
        fields = dict(num_layers=hf.num_hidden_layers, hidden_size=hf.hidden_size,
                      num_attention_heads=hf.num_attention_heads,
                      ffn_hidden_size=hf.intermediate_size,
                      max_position_embeddings=hf.max_position_embeddings,
                      vocab_size=hf.vocab_size, layernorm_epsilon=hf.layer_norm_eps,
                      openai_gelu=hf.hidden_act in TANH_GELUS, model_type="bert",
                      num_tokentypes=hf.type_vocab_size,
                      bert_binary_head="MegatronBertForMaskedLM" not in
                      (getattr(hf, "architectures", None) or []))
        names = dict(num_layers="num_hidden_layers", ffn_hidden_size="intermediate_size",
                     layernorm_epsilon="layer_norm_eps", openai_gelu="hidden_act",
                     activation="hidden_act",
                     num_tokentypes="type_vocab_size", bert_binary_head="architectures")
    return fields, names


# --------------------------------------------------------------------- state dicts
def _layer_maps(cfg: ModelConfig, arch: str) -> list[tuple[str, str]]:
    """(our suffix, HF suffix) of the per-layer tensors that map one to one."""
    if arch == "gpt2":
        pairs = [("input_layernorm", "ln_1"), ("pre_mlp_layernorm", "ln_2")]
        return [(f"{a}.{p}", f"{b}.{p}") for a, b in pairs for p in ("weight", "bias")]
    if arch == "mixtral":  # LLaMA's attention and norms; the experts: hf_mixtral.py
        return _layer_maps(cfg, "llama")[:3]
    if arch == "llama":
        out = [("input_layernorm.weight", "input_layernorm.weight"),
               ("pre_mlp_layernorm.weight", "post_attention_layernorm.weight"),
               ("self_attention.linear_proj.weight", "self_attn.o_proj.weight"),
               ("mlp.linear_fc2.weight", "mlp.down_proj.weight")]
        if cfg.add_bias_linear:
            out += [("self_attention.linear_proj.bias", "self_attn.o_proj.bias"),
                    ("mlp.linear_fc2.bias", "mlp.down_proj.bias")]
        return out
    pairs = [("input_layernorm", "attention.ln"), ("pre_mlp_layernorm", "ln"),
             ("self_attention.linear_proj", "attention.output.dense"),
             ("mlp.linear_fc1", "intermediate.dense"), ("mlp.linear_fc2", "output.dense")]
    return [(f"{a}.{p}", f"{b}.{p}") for a, b in pairs for p in ("weight", "bias")]


def _prefixes(arch: str) -> tuple[str, str]:
    """(HF prefix of the decoder/encoder layers, HF prefix of the embeddings)."""
    return {"gpt2": ("transformer.h.", "transformer."), "llama": ("model.layers.", "model."),
            "mixtral": ("model.layers.", "model."), "megatron-bert": ("bert.encoder.layer.", "bert.")}[arch]


def _qkv_names(arch: str) -> tuple[str, str, str]:
    return {"llama": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
            "mixtral": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
            "megatron-bert": ("attention.self.query", "attention.self.key",
                              "attention.self.value")}[arch]


def _top_level(cfg: ModelConfig, arch: str) -> list[tuple[str, str, bool]]:
    """(our FQN, HF key, has vocabulary rows) of the embeddings, final norm and heads."""
    tied = not cfg.untie_embeddings_and_output_weights
    if arch == "gpt2":
        out = [("embedding.word_embeddings.weight", "transformer.wte.weight", True),
               ("embedding.position_embeddings.weight", "transformer.wpe.weight", False),
               ("final_norm.weight", "transformer.ln_f.weight", False),
               ("final_norm.bias", "transformer.ln_f.bias", False)]
        return out + ([] if tied else [("output_layer.weight", "lm_head.weight", True)])
    if arch in ("llama", "mixtral"):
        out = [("embedding.word_embeddings.weight", "model.embed_tokens.weight", True),
               ("final_norm.weight", "model.norm.weight", False)]
        return out + ([] if tied else [("output_layer.weight", "lm_head.weight", True)])
    out = [("embedding.word_embeddings.weight", "bert.embeddings.word_embeddings.weight", True),
           ("embedding.position_embeddings.weight", "bert.embeddings.position_embeddings.weight",
            False),
           ("final_norm.weight", "bert.encoder.ln.weight", False),
           ("final_norm.bias", "bert.encoder.ln.bias", False),
           ("lm_head.dense.weight", "cls.predictions.transform.dense.weight", False),
           ("lm_head.dense.bias", "cls.predictions.transform.dense.bias", False),
           ("lm_head.norm.weight", "cls.predictions.transform.LayerNorm.weight", False),
           ("lm_head.norm.bias", "cls.predictions.transform.LayerNorm.bias", False),
           ("lm_head.bias", "cls.predictions.bias", True)]
    if cfg.num_tokentypes > 0:
        out.append(("embedding.tokentype_embeddings.weight",
                    "bert.embeddings.token_type_embeddings.weight", False))
    if cfg.bert_binary_head:
        out += [("pooler.weight", "bert.pooler.dense.weight", False),
                ("pooler.bias", "bert.pooler.dense.bias", False),
                ("binary_head.weight", "cls.seq_relationship.weight", False),
                ("binary_head.bias", "cls.seq_relationship.bias", False)]
    return out


def to_hf_state(cfg: ModelConfig, state: State, arch: str) -> State:
    """Our full state dict -> the HF model's (tied copies left out, as ``save_pretrained``
    does). Raises :class:`ConversionError` when a parameter ``cfg`` needs is missing."""
    def get(name: str) -> torch.Tensor:
        if name not in state:
            raise ConversionError(f"the checkpoint lacks parameter {name!r} its model config "
                                  f"needs; convert a checkpoint written by this model")
        return state[name]

    out: State = {}
    for ours, theirs, vocab in _top_level(cfg, arch):
        out[theirs] = _rows(get(ours), cfg.vocab_size) if vocab else get(ours)
    if arch == "megatron-bert" and cfg.num_tokentypes == 0:
        out["bert.embeddings.token_type_embeddings.weight"] = torch.zeros(1, cfg.hidden_size)
    layer_prefix, _ = _prefixes(arch)
    for i in range(cfg.num_layers):
        ours, theirs = f"layers.{i}.", f"{layer_prefix}{i}."
        for a, b in _layer_maps(cfg, arch):
            out[theirs + b] = get(ours + a)
        params = ("weight", "bias") if cfg.add_bias_linear else ("weight",)
        for p in params:
            qkv = get(f"{ours}self_attention.linear_qkv.{p}")
            q, k, v = split_qkv(qkv, cfg)
            if arch == "gpt2":  # Conv1D: (in, out), columns q | k | v
                out[f"{theirs}attn.c_attn.{p}"] = torch.cat([q, k, v]).t() if p == "weight" \
                    else torch.cat([q, k, v])
                for a, b in (("self_attention.linear_proj", "attn.c_proj"),
                             ("mlp.linear_fc1", "mlp.c_fc"), ("mlp.linear_fc2", "mlp.c_proj")):
                    t = get(f"{ours}{a}.{p}")
                    out[f"{theirs}{b}.{p}"] = t.t() if p == "weight" else t
            else:
                for name, t in zip(_qkv_names(arch), (q, k, v)):
                    out[f"{theirs}{name}.{p}"] = t
            if arch == "llama":
                gate, up = split_gate_up(get(f"{ours}mlp.linear_fc1.{p}"))
                out[f"{theirs}mlp.gate_proj.{p}"], out[f"{theirs}mlp.up_proj.{p}"] = gate, up
        if arch == "mixtral":
            out.update(experts_to_hf(get, ours, theirs))
    return {k: v.detach().float().contiguous().clone() for k, v in out.items()}


def from_hf_state(cfg: ModelConfig, hf_state: State, arch: str) -> State:
    """The HF model's state dict -> ours for ``cfg`` (vocabulary rows zero-padded)."""
    def get(name: str) -> torch.Tensor:
        if name not in hf_state:
            raise ConversionError(f"the Hugging Face checkpoint lacks {name!r}, which its "
                                  f"config implies; convert a complete checkpoint")
        return hf_state[name].detach().float()

    padded = cfg.padded_vocab_size
    out: State = {}
    for ours, theirs, vocab in _top_level(cfg, arch):
        if theirs == "lm_head.weight" and theirs not in hf_state:
            theirs = _prefixes(arch)[1] + ("wte.weight" if arch == "gpt2" else "embed_tokens.weight")
        out[ours] = _rows(get(theirs), padded) if vocab else get(theirs)
    layer_prefix, _ = _prefixes(arch)

    def t_(t: torch.Tensor, p: str) -> torch.Tensor:  # GPT-2's Conv1D weights are (in, out)
        return t.t() if p == "weight" else t

    for i in range(cfg.num_layers):
        ours, theirs = f"layers.{i}.", f"{layer_prefix}{i}."
        for a, b in _layer_maps(cfg, arch):
            out[ours + a] = get(theirs + b)
        params = ("weight", "bias") if cfg.add_bias_linear else ("weight",)
        for p in params:
            if arch == "gpt2":
                q, k, v = t_(get(f"{theirs}attn.c_attn.{p}"), p).chunk(3)
                for a, b in (("self_attention.linear_proj", "attn.c_proj"),
                             ("mlp.linear_fc1", "mlp.c_fc"), ("mlp.linear_fc2", "mlp.c_proj")):
                    out[f"{ours}{a}.{p}"] = t_(get(f"{theirs}{b}.{p}"), p)
            else:
                q, k, v = (get(f"{theirs}{name}.{p}") for name in _qkv_names(arch))
            out[f"{ours}self_attention.linear_qkv.{p}"] = merge_qkv(q, k, v, cfg)
            if arch == "llama":
                out[f"{ours}mlp.linear_fc1.{p}"] = merge_gate_up(
                    get(f"{theirs}mlp.gate_proj.{p}"), get(f"{theirs}mlp.up_proj.{p}"))
        if arch == "mixtral":
            out.update(experts_from_hf(get, ours, theirs))
    return {k: v.contiguous().clone() for k, v in out.items()}
