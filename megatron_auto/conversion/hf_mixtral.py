"""Mixtral (``MixtralForCausalLM``) <-> our GPT with MoE layers: what differs from LLaMA.

Mixtral is LLaMA's attention, norms and embeddings (``hf_mapping.py`` maps those) with every
MLP replaced by a mixture of experts: a bias-free router ``mlp.gate`` (E, h) choosing
``num_experts_per_tok`` of ``num_local_experts`` SwiGLU experts by softmax over all experts,
then the chosen weights renormalised to sum 1, which is the softmax of the top-k logits: our
``router_score_function="softmax"`` with ``router_pre_softmax`` false, dropless. transformers 5
keeps the experts stacked: ``mlp.experts.gate_up_proj`` (E, 2f, h: all gate rows, then all up
rows) and ``mlp.experts.down_proj`` (E, h, f); ours are ``mlp.experts.linear_fc1.weight``
(E, 2f, h, rows interleaved gate_0, up_0, ...) and ``mlp.experts.linear_fc2.weight``
(E, h, f); the router is ``mlp.router.weight``. (Older checkpoints with one ``w1/w2/w3`` per
expert are converted to the stacked form by transformers' own loading.)

Pure tensor arithmetic and config fields; no ``transformers`` import here.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..config import ModelConfig
from ..families.gpt.config import MoEConfig

State = dict[str, torch.Tensor]


def mixtral_problem(cfg: ModelConfig) -> str | None:
    """The first field of ``cfg`` that Mixtral cannot hold (a clause naming it), or None."""
    moe = cfg.moe
    if moe is None:
        return "no experts (a dense model): Mixtral's MLPs are mixtures of experts"
    n = cfg.num_layers
    pairs = [
        (cfg.position_embedding_type == "rope", "position_embedding_type=learned: Mixtral uses "
         "rotary embeddings"),
        (cfg.normalization == "rmsnorm", "normalization=layernorm: Mixtral uses RMSNorm"),
        (cfg.activation == "swiglu", "activation=gelu: Mixtral's experts are SwiGLU"),
        (not cfg.add_bias_linear and not cfg.qkv_bias, "linear biases: Mixtral has none "
         "(--disable-bias-linear, no --add-qkv-bias)"),
        (moe.moe_layers(n) == tuple(range(n)), f"moe_layer_freq={moe.layer_freq}: every "
         f"Mixtral layer is a mixture of experts"),
        (moe.shared_expert_intermediate_size is None, "shared experts: Mixtral has none"),
        (moe.router_score_function == "softmax" and not moe.router_pre_softmax,
         "the router's scores: Mixtral softmaxes the top-k logits (softmax, no pre-softmax)"),
        (moe.expert_capacity_factor is None, f"expert_capacity_factor="
         f"{moe.expert_capacity_factor}: Mixtral drops no token"),
    ]
    return next((why for ok, why in pairs if not ok), None)


def mixtral_config_kwargs(cfg: ModelConfig, llama: dict[str, Any]) -> dict[str, Any]:
    """``MixtralConfig`` keyword arguments: LLaMA's (``llama``) without the bias switches,
    plus the experts."""
    assert cfg.moe is not None  # mixtral_problem refused a dense model
    out = {k: v for k, v in llama.items() if k not in ("attention_bias", "mlp_bias")}
    out.update(intermediate_size=cfg.moe.expert_ffn(cfg.ffn_hidden_size),
               num_local_experts=cfg.moe.num_experts, num_experts_per_tok=cfg.moe.router_topk,
               router_aux_loss_coef=cfg.moe.aux_loss_coeff, router_jitter_noise=0.0,
               sliding_window=None, architectures=["MixtralForCausalLM"])
    return out


def mixtral_fields(hf: Any, need: Callable[[bool, str, Any, str], None],
                   fields: dict[str, Any], names: dict[str, str]) -> None:
    """Add the experts of Mixtral config ``hf`` to LLaMA's ``fields`` / ``names`` (in place);
    ``need`` raises the conversion error naming the HF key."""
    window = getattr(hf, "sliding_window", None)
    need(window is None or window >= hf.max_position_embeddings, "sliding_window", window,
         "sliding-window attention is not modelled (our layers attend every earlier token)")
    jitter = getattr(hf, "router_jitter_noise", 0.0) or 0.0
    need(not jitter, "router_jitter_noise", jitter, "our router adds no input jitter")
    experts = hf.num_local_experts
    need(isinstance(experts, int) and experts > 0, "num_local_experts", experts,
         "must be a positive integer")
    fields.update(add_bias_linear=False, moe=MoEConfig(
        num_experts=experts, router_topk=hf.num_experts_per_tok,
        aux_loss_coeff=float(getattr(hf, "router_aux_loss_coef", 0.0) or 0.0)))
    names.update(moe="num_local_experts", add_bias_linear="model_type")


def experts_to_hf(get: Callable[[str], torch.Tensor], ours: str, theirs: str) -> State:
    """Layer ``ours`` (``layers.i.``)'s router and experts as Mixtral's under ``theirs``."""
    fc1 = get(f"{ours}mlp.experts.linear_fc1.weight")  # (E, 2f, h), interleaved
    pairs = fc1.reshape(fc1.shape[0], fc1.shape[1] // 2, 2, fc1.shape[2])
    return {f"{theirs}mlp.gate.weight": get(f"{ours}mlp.router.weight"),
            f"{theirs}mlp.experts.gate_up_proj": torch.cat([pairs[:, :, 0], pairs[:, :, 1]], 1),
            f"{theirs}mlp.experts.down_proj": get(f"{ours}mlp.experts.linear_fc2.weight")}


def experts_from_hf(get: Callable[[str], torch.Tensor], ours: str, theirs: str) -> State:
    """The inverse of :func:`experts_to_hf`."""
    gate, up = get(f"{theirs}mlp.experts.gate_up_proj").chunk(2, dim=1)
    fc1 = torch.stack([gate, up], dim=2).reshape(gate.shape[0], 2 * gate.shape[1], -1)
    return {f"{ours}mlp.router.weight": get(f"{theirs}mlp.gate.weight"),
            f"{ours}mlp.experts.linear_fc1.weight": fc1,
            f"{ours}mlp.experts.linear_fc2.weight": get(f"{theirs}mlp.experts.down_proj")}
