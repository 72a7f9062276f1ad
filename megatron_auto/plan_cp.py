"""What context parallelism asks of a model, checked once when a plan meets its model
(``Plan.check_model``): the family runs CP, the sequence splits into ``2 cp`` chunks, Ulysses
layers have heads and key/value groups divisible by ``cp x tp``, ring layers run without
attention dropout, no MoE layers. Each failure is one line (``Plan.check_model`` raises it as a ``PlanError``) naming the field, the
value and the fix (``models/cp_attention.py`` is what runs)."""

from __future__ import annotations

from typing import Any


def cp_model_problem(plan: Any, model: Any) -> str | None:
    """Why ``model`` cannot run ``plan``'s context parallelism (module doc), as the one-line
    message ``Plan.check_model`` raises; None when it can."""
    cp = plan.cp_size
    if not getattr(model, "runs_context_parallel", False):
        return (f"plan field layers[0].cp={cp}: the {model.model_type} model does not "
                f"run context parallelism; set cp to 1 (drop --context-parallel-size)")
    if getattr(model, "moe", None) is not None:
        # the router's per-sequence capacity and balance loss need a sequence's tokens on
        # one rank; CP splits them
        return (f"plan field layers[0].cp={cp}: MoE layers (--num-experts) do not "
                f"run under context parallelism yet; set cp to 1 (drop "
                f"--context-parallel-size)")
    if model.seq_length % (2 * cp):
        return (f"plan field layers[0].cp={cp}: --seq-length={model.seq_length} must be "
                f"divisible by 2 x cp = {2 * cp} (each CP rank holds two of 2cp "
                f"chunks); change the sequence length or cp")
    for i, layer in enumerate(plan.layers):
        if layer.cp_mode == "ulysses":
            k = cp * layer.tp
            heads, groups = model.num_attention_heads, model.query_groups
            if heads % k or groups % k:
                what = (f"--num-attention-heads={heads}" if heads % k else
                f"--num-query-groups={groups}")
                return (
                    f"plan field layers[{i}].cp_mode='ulysses': {what} must be divisible by "
                    f"cp x tp = {cp} x {layer.tp} = {k} (Ulysses gives each CP rank whole "
                    f"heads and key/value groups); use cp_mode ring (--cp-comm-type p2p) "
                    f"or a smaller cp or tp")
        elif model.attention_dropout > 0:
            return (
                f"plan field layers[{i}].cp_mode='ring': ring attention runs without "
                f"attention dropout but --attention-dropout={model.attention_dropout}; set "
                f"--attention-dropout 0 or use cp_mode ulysses (--cp-comm-type a2a)")
    return None
