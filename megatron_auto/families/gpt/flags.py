"""The mixture-of-experts flags of the GPT family (Megatron-LM's names) and their conversion into
a :class:`~megatron_auto.families.gpt.config.MoEConfig`.

Model flags: ``--num-experts`` (absent: a dense model), ``--moe-router-topk``,
``--moe-ffn-hidden-size``, ``--moe-layer-freq``, ``--moe-shared-expert-intermediate-size``,
``--moe-aux-loss-coeff``, ``--moe-z-loss-coeff``, ``--moe-expert-capacity-factor``,
``--moe-router-score-function``, ``--moe-router-pre-softmax``. The layout flag
``--expert-model-parallel-size`` sits with the other layout flags (``plan_flags.py``; the
uniform plan: ``planner/interop/megatron_flags.py``).
"""

from __future__ import annotations

import argparse
from typing import Any

from .config import MoEConfig, MoEConfigError, parse_layer_freq

#: The MoE model flags' destinations; any of them given without --num-experts is an error.
MOE_MODEL_DESTS = ("moe_router_topk", "moe_ffn_hidden_size", "moe_layer_freq",
                   "moe_shared_expert_intermediate_size", "moe_aux_loss_coeff",
                   "moe_z_loss_coeff", "moe_expert_capacity_factor", "moe_router_score_function",
                   "moe_router_pre_softmax")


def add_moe_model_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The MoE model flags (defaults None: a flag left alone is told from one given)."""
    g = parser.add_argument_group("mixture of experts")
    g.add_argument("--num-experts", type=int, default=None,
                   help="routed experts per MoE layer (absent: a dense model)")
    g.add_argument("--moe-router-topk", type=int, default=None, help="experts per token "
                                                                      "(default 2)")
    g.add_argument("--moe-ffn-hidden-size", type=int, default=None,
                   help="width of one expert (default: --ffn-hidden-size)")
    g.add_argument("--moe-layer-freq", default=None,
                   help="MoE every N-th layer from layer 0 (default 1), or a 0/1 pattern "
                        "[1,0,1,0]")
    g.add_argument("--moe-shared-expert-intermediate-size", type=int, default=None,
                   help="width of the shared experts every token also passes (default: none)")
    g.add_argument("--moe-aux-loss-coeff", type=float, default=None,
                   help="Switch/GShard load-balancing loss weight (default 0)")
    g.add_argument("--moe-z-loss-coeff", type=float, default=None,
                   help="router z-loss weight (default: none)")
    g.add_argument("--moe-expert-capacity-factor", type=float, default=None,
                   help="drop assignments over capacity x tokens x k / experts per sequence "
                        "(default: dropless)")
    g.add_argument("--moe-router-score-function", default=None, choices=["softmax", "sigmoid"],
                   help="softmax (default) or sigmoid (DeepSeek-V3) scores")
    g.add_argument("--moe-router-pre-softmax", action="store_true", default=None,
                   help="softmax over all experts before the top-k (Switch)")
    return parser


def moe_config_from_args(args: argparse.Namespace) -> MoEConfig | None:
    """The MoE settings the flags give, or None for a dense model; raises ``MoEConfigError``
    naming the flag (an MoE flag without ``--num-experts``, a value out of range)."""
    num_experts = getattr(args, "num_experts", None)
    if num_experts is None:
        given = [d for d in MOE_MODEL_DESTS if getattr(args, d, None) is not None]
        if given:
            flag = "--" + given[0].replace("_", "-")
            raise MoEConfigError(f"{flag}={getattr(args, given[0])}: needs --num-experts (the "
                                 f"model is dense without it); add --num-experts or drop {flag}")
        return None

    def value(dest: str, default: Any) -> Any:
        got = getattr(args, dest, None)
        return default if got is None else got

    freq = getattr(args, "moe_layer_freq", None)
    return MoEConfig(
        num_experts=num_experts, router_topk=value("moe_router_topk", 2),
        ffn_hidden_size=value("moe_ffn_hidden_size", None),
        layer_freq=1 if freq is None else parse_layer_freq(str(freq)),
        shared_expert_intermediate_size=value("moe_shared_expert_intermediate_size", None),
        aux_loss_coeff=value("moe_aux_loss_coeff", 0.0),
        z_loss_coeff=value("moe_z_loss_coeff", None),
        expert_capacity_factor=value("moe_expert_capacity_factor", None),
        router_score_function=value("moe_router_score_function", "softmax"),
        router_pre_softmax=bool(value("moe_router_pre_softmax", False)))


def moe_flags(moe: MoEConfig | None) -> list[str]:
    """The pretrain script's (and Megatron-LM's) MoE model flags that build ``moe``."""
    if moe is None:
        return []
    out = ["--num-experts", str(moe.num_experts), "--moe-router-topk", str(moe.router_topk)]
    if moe.ffn_hidden_size is not None:
        out += ["--moe-ffn-hidden-size", str(moe.ffn_hidden_size)]
    if isinstance(moe.layer_freq, tuple):
        out += ["--moe-layer-freq", "[" + ",".join(map(str, moe.layer_freq)) + "]"]
    elif moe.layer_freq != 1:
        out += ["--moe-layer-freq", str(moe.layer_freq)]
    if moe.shared_expert_intermediate_size is not None:
        out += ["--moe-shared-expert-intermediate-size",
                str(moe.shared_expert_intermediate_size)]
    if moe.aux_loss_coeff:
        out += ["--moe-aux-loss-coeff", repr(moe.aux_loss_coeff)]
    if moe.z_loss_coeff is not None:
        out += ["--moe-z-loss-coeff", repr(moe.z_loss_coeff)]
    if moe.expert_capacity_factor is not None:
        out += ["--moe-expert-capacity-factor", repr(moe.expert_capacity_factor)]
    if moe.router_score_function != "softmax":
        out += ["--moe-router-score-function", moe.router_score_function]
    if moe.router_pre_softmax:
        out.append("--moe-router-pre-softmax")
    return out
