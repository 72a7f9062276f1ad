"""A plain-PyTorch mixture-of-experts block, written from the definitions, token by token.

For each token ``t`` with router logits ``l_t = W_r x_t`` (``E`` experts):

- softmax routing (Mixtral, Shazeer et al. 2017): the ``k`` largest logits, their weights the
  softmax over those ``k`` logits; "pre-softmax" (Switch, Fedus et al. 2021): softmax over all
  ``E`` logits, the ``k`` largest probabilities as the weights;
- sigmoid routing (DeepSeek-V3): scores ``sigmoid(l_t)``, the ``k`` largest, divided by their
  sum when ``k > 1``;
- capacity (GShard, Lepikhin et al. 2020): an expert takes at most
  ``ceil(factor * s * k / E)`` tokens of one sequence of ``s`` tokens, those it weighs most
  (ties: the earlier token);
  the rest of its tokens skip it (no renormalisation of the weights);
- output ``sum over kept (e, w) of w * Expert_e(x_t)`` plus the shared expert's output; an
  expert is ``W2 act(W1 x)``, GELU, or SwiGLU ``W2 (silu(W_gate x) * (W_up x))``;
- load-balancing loss per sequence (Switch eq. 4, with ``k`` assignments a token):
  ``E * sum_e f_e P_e``, ``f_e`` the fraction of the sequence's ``s*k`` assignments (before
  the capacity) that chose ``e``, ``P_e`` the sequence's mean router probability of ``e``
  (softmax over all experts; sigmoid scores divided by their sum over the experts);
- z-loss per sequence (ST-MoE, Zoph et al. 2022): the mean over its tokens of
  ``logsumexp(l_t)^2``.

Imports nothing of megatron_auto. Weights are plain tensors handed in by the test:
``router`` (E, h); per expert ``gate``, ``up`` (f, h) and ``down`` (h, f) for SwiGLU, or
``fc1`` (f, h) and ``fc2`` (h, f) for GELU; the shared expert likewise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RefMoE:
    num_experts: int
    topk: int
    activation: str = "swiglu"  # or "gelu"
    score: str = "softmax"  # or "sigmoid"
    pre_softmax: bool = False
    capacity_factor: float | None = None


def expert_mlp(x: torch.Tensor, w: dict[str, torch.Tensor], activation: str) -> torch.Tensor:
    if activation == "swiglu":
        gate, up = w["gate"] @ x, w["up"] @ x
        return w["down"] @ (gate * torch.sigmoid(gate) * up)
    a = w["fc1"] @ x
    return w["fc2"] @ (0.5 * a * (1.0 + torch.erf(a / math.sqrt(2.0))))


def _choose(logits: torch.Tensor, cfg: RefMoE) -> list[tuple[int, torch.Tensor]]:
    """(expert, weight) of one token, largest first."""
    if cfg.score == "sigmoid":
        scores = 1.0 / (1.0 + torch.exp(-logits))
        ranked = sorted(range(cfg.num_experts), key=lambda e: -float(scores[e].detach()))[:cfg.topk]
        total = sum(scores[e] for e in ranked)
        return [(e, scores[e] / total if cfg.topk > 1 else scores[e]) for e in ranked]
    if cfg.pre_softmax:
        probs = torch.exp(logits - logits.max())
        probs = probs / probs.sum()
        ranked = sorted(range(cfg.num_experts), key=lambda e: -float(probs[e].detach()))[:cfg.topk]
        return [(e, probs[e]) for e in ranked]
    ranked = sorted(range(cfg.num_experts), key=lambda e: -float(logits[e].detach()))[:cfg.topk]
    top = torch.stack([logits[e] for e in ranked])
    w = torch.exp(top - top.max())
    w = w / w.sum()
    return [(e, w[i]) for i, e in enumerate(ranked)]


def _balance_probs(logits: torch.Tensor, cfg: RefMoE) -> torch.Tensor:
    if cfg.score == "sigmoid":
        s = 1.0 / (1.0 + torch.exp(-logits))
        return s / s.sum()
    p = torch.exp(logits - logits.max())
    return p / p.sum()


def moe_forward(x: torch.Tensor, router: torch.Tensor, experts: list[dict[str, torch.Tensor]],
                cfg: RefMoE, shared: dict[str, torch.Tensor] | None = None
                ) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor], list[int]]:
    """``x`` (b, s, h) -> (output (b, s, h), per-sequence balance losses, per-sequence
    z-losses, kept tokens per expert)."""
    b, s, _ = x.shape
    out = torch.zeros_like(x)
    balance: list[torch.Tensor] = []
    zloss: list[torch.Tensor] = []
    counts = [0] * cfg.num_experts
    for n in range(b):
        choices = []
        chosen_count = [0] * cfg.num_experts
        mean_prob = torch.zeros(cfg.num_experts, dtype=x.dtype)
        z = torch.zeros((), dtype=x.dtype)
        for t in range(s):
            logits = router @ x[n, t]
            picks = _choose(logits, cfg)
            choices.append(picks)
            for e, _ in picks:
                chosen_count[e] += 1
            mean_prob = mean_prob + _balance_probs(logits, cfg) / s
            m = logits.max()
            z = z + (m + torch.log(torch.exp(logits - m).sum())) ** 2 / s
        kept = [[True] * len(p) for p in choices]
        if cfg.capacity_factor is not None:
            cap = math.ceil(cfg.capacity_factor * s * cfg.topk / cfg.num_experts)
            for e in range(cfg.num_experts):
                mine = [(float(w.detach()), t, i) for t, p in enumerate(choices)
                        for i, (ee, w) in enumerate(p) if ee == e]
                mine.sort(key=lambda item: -item[0])
                for _, t, i in mine[cap:]:
                    kept[t][i] = False
        for t, picks in enumerate(choices):
            for i, (e, w) in enumerate(picks):
                if kept[t][i]:
                    out[n, t] = out[n, t] + w * expert_mlp(x[n, t], experts[e], cfg.activation)
                    counts[e] += 1
            if shared is not None:
                out[n, t] = out[n, t] + expert_mlp(x[n, t], shared, cfg.activation)
        frac = torch.tensor(chosen_count, dtype=x.dtype) / (s * cfg.topk)
        balance.append(cfg.num_experts * (frac * mean_prob).sum())
        zloss.append(z)
    return out, balance, zloss, counts
