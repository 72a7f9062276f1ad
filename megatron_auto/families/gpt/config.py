"""Mixture of experts in the GPT family: :class:`MoEConfig`, the ``moe`` field of a
``config.ModelConfig`` (``None``: every layer is dense).

An MoE layer replaces the dense MLP of a transformer layer by ``num_experts`` expert MLPs
(SwiGLU or GELU as the model's ``activation``, each ``ffn_hidden_size`` wide, no biases, as
Mixtral, DeepSeek and Qwen-MoE) and a linear router (no bias) choosing ``router_topk`` experts
per token; optional shared experts (one dense MLP of ``shared_expert_intermediate_size``, on
every token, beside the routed ones). ``layer_freq``: MoE every ``N``-th layer, starting with
layer 0 (Megatron's ``--moe-layer-freq N``), or one 0/1 entry per layer.

Routing (Megatron's names and defaults):

- ``router_score_function="softmax"``: with ``router_pre_softmax`` false (Megatron's default,
  Mixtral's routing) the top-k logits are softmaxed among themselves; with it true the softmax
  runs over all experts and the top-k probabilities are the weights (Switch). ``"sigmoid"``
  (DeepSeek-V3): scores ``sigmoid(logits)``, the top-k scores normalised to sum 1.
- ``aux_loss_coeff``: the Switch/GShard load-balancing loss, ``coeff * E * sum_e f_e P_e`` with
  ``f_e`` the fraction of the token-expert assignments that go to ``e`` and ``P_e`` the mean
  score of ``e`` (softmax over all experts; sigmoid scores normalised per token), computed per
  sequence and averaged over the global batch's sequences (the rule that makes it the same
  under every plan: docs/design.md §4).
- ``z_loss_coeff``: the router z-loss ``coeff * mean_t logsumexp(logits_t)^2`` over the global
  batch's tokens.
- ``expert_capacity_factor`` (None: dropless): each expert takes at most
  ``ceil(capacity_factor * s * k / E)`` assignments of each sequence of ``s`` tokens, those of
  the highest routing weight, ties to the earlier token (Megatron's ``probs`` drop policy, per
  sequence so that the same tokens drop under every plan); a dropped assignment contributes
  nothing. The balance loss counts the assignments before the capacity.

Pure data, no torch.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Mapping

from ...utils.jsonfile import unknown_fields

SCORE_FUNCTIONS = ("softmax", "sigmoid")


class MoEConfigError(ValueError):
    """An invalid MoE setting; the message names the flag, the value and the fix."""


def _need(cond: bool, flag: str, value: Any, fix: str) -> None:
    if not cond:
        raise MoEConfigError(f"{flag}={value}: {fix}")


@dataclass(frozen=True)
class MoEConfig:
    """The mixture-of-experts settings of a GPT model (see the module docstring)."""

    num_experts: int
    router_topk: int = 2
    ffn_hidden_size: int | None = None  # None: the model's --ffn-hidden-size
    layer_freq: int | tuple[int, ...] = 1
    shared_expert_intermediate_size: int | None = None
    aux_loss_coeff: float = 0.0
    z_loss_coeff: float | None = None
    expert_capacity_factor: float | None = None
    router_score_function: str = "softmax"
    router_pre_softmax: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.layer_freq, list):
            object.__setattr__(self, "layer_freq", tuple(self.layer_freq))
        _need(isinstance(self.num_experts, int) and not isinstance(self.num_experts, bool)
              and self.num_experts >= 1, "--num-experts", self.num_experts,
              "must be a positive integer (the routed experts of every MoE layer)")
        _need(isinstance(self.router_topk, int) and 1 <= self.router_topk <= self.num_experts,
              "--moe-router-topk", self.router_topk,
              f"must be between 1 and --num-experts={self.num_experts}; lower it or add experts")
        _need(self.ffn_hidden_size is None or self.ffn_hidden_size >= 1, "--moe-ffn-hidden-size",
              self.ffn_hidden_size, "must be a positive integer (the width of one expert)")
        _need(self.shared_expert_intermediate_size is None
              or self.shared_expert_intermediate_size >= 1,
              "--moe-shared-expert-intermediate-size", self.shared_expert_intermediate_size,
              "must be a positive integer, or leave it out for no shared experts")
        _need(math.isfinite(self.aux_loss_coeff) and self.aux_loss_coeff >= 0.0,
              "--moe-aux-loss-coeff", self.aux_loss_coeff, "must be a number >= 0 (0: off)")
        _need(self.z_loss_coeff is None or (math.isfinite(self.z_loss_coeff)
                                            and self.z_loss_coeff >= 0.0),
              "--moe-z-loss-coeff", self.z_loss_coeff, "must be a number >= 0, or left out")
        _need(self.expert_capacity_factor is None
              or (math.isfinite(self.expert_capacity_factor) and self.expert_capacity_factor > 0),
              "--moe-expert-capacity-factor", self.expert_capacity_factor,
              "must be a number > 0 (e.g. 1.0 or 1.25), or left out for dropless routing")
        _need(self.router_score_function in SCORE_FUNCTIONS, "--moe-router-score-function",
              self.router_score_function, f"choose one of {', '.join(SCORE_FUNCTIONS)}")
        _need(not (self.router_pre_softmax and self.router_score_function != "softmax"),
              "--moe-router-pre-softmax", True,
              "applies to --moe-router-score-function softmax only; drop one of them")
        freq = self.layer_freq
        if isinstance(freq, tuple):
            _need(len(freq) >= 1 and all(x in (0, 1) for x in freq), "--moe-layer-freq",
                  list(freq), "a pattern lists 0 (dense) or 1 (MoE) per layer, e.g. [1,0,1,0]")
        else:
            _need(isinstance(freq, int) and not isinstance(freq, bool) and freq >= 1,
                  "--moe-layer-freq", freq, "must be a positive integer N (MoE every N-th "
                  "layer) or a 0/1 pattern such as [1,0,1,0]")

    # ----------------------------------------------------------------------- derived
    def expert_ffn(self, model_ffn_hidden_size: int) -> int:
        """The width of one routed expert."""
        return self.ffn_hidden_size or model_ffn_hidden_size

    def moe_layers(self, num_layers: int) -> tuple[int, ...]:
        """Indices of the MoE layers of a ``num_layers``-layer model."""
        if isinstance(self.layer_freq, tuple):
            return tuple(i for i, x in enumerate(self.layer_freq) if x)
        return tuple(i for i in range(num_layers) if i % self.layer_freq == 0)

    def check_num_layers(self, num_layers: int) -> None:
        """A pattern must list every layer."""
        if isinstance(self.layer_freq, tuple):
            _need(len(self.layer_freq) == num_layers, "--moe-layer-freq", list(self.layer_freq),
                  f"lists {len(self.layer_freq)} layers but --num-layers={num_layers}; give one "
                  f"0/1 entry per layer")
        _need(bool(self.moe_layers(num_layers)), "--moe-layer-freq", self.layer_freq,
              "makes no layer an MoE layer; use 1 (every layer) or a pattern with a 1")

    def num_expert_parameters(self, hidden_size: int, model_ffn: int, activation: str) -> int:
        """Parameters of the routed experts of one MoE layer (all ``num_experts``)."""
        f = self.expert_ffn(model_ffn)
        per_expert = (3 if activation == "swiglu" else 2) * hidden_size * f
        return self.num_experts * per_expert

    def num_dense_parameters(self, hidden_size: int, activation: str) -> int:
        """The router's and the shared experts' parameters of one MoE layer (no biases)."""
        shared = self.shared_expert_intermediate_size or 0
        return (self.num_experts * hidden_size
                + (3 if activation == "swiglu" else 2) * hidden_size * shared)

    # -------------------------------------------------------------------------- JSON
    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        if isinstance(self.layer_freq, tuple):
            out["layer_freq"] = list(self.layer_freq)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "MoEConfig":
        unknown, known = unknown_fields(cls, data)
        _need(not unknown, "model config moe", unknown,
              f"unknown field(s); known fields are {known}")
        return cls(**dict(data))


def parse_layer_freq(text: str) -> int | tuple[int, ...]:
    """``--moe-layer-freq``: an integer ``N``, or a 0/1 list ``[1,0,1,0]`` (Megatron's forms;
    its Python-expression form ``([1]*4)`` is not evaluated here)."""
    text = text.strip()
    if text.startswith("["):
        body = text.strip("[]").replace(" ", "")
        try:
            return tuple(int(x) for x in body.split(",") if x)
        except ValueError:
            raise MoEConfigError(f"--moe-layer-freq={text}: a pattern lists 0 or 1 per layer, "
                                 f"e.g. [1,0,1,0]") from None
    try:
        return int(text)
    except ValueError:
        raise MoEConfigError(f"--moe-layer-freq={text}: give an integer N (MoE every N-th layer) "
                             f"or a 0/1 pattern such as [1,0,1,0]") from None
