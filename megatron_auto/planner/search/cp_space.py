"""Context parallelism as a dimension of the search: which CP degrees a task may take and which
CP modes a layer may run under one (docs/planner.md, "Context parallelism in the search").

CP is one degree per plan (``Plan._validate_cp``): every layer and the vocabulary share it, so
the search enumerates it per task, beside the pipeline degree, and a task's layers choose their
TP degree inside blocks of ``n / cp`` ranks (``tp x cp x dp = n``, the stage's ranks). The rules,
each a runtime rule (``plan_cp.cp_model_problem``) or the one that defines the default space:

1. ``cp`` a power of two dividing the stage's ``n`` ranks, and every layer type's sequence
   divisible by ``2 cp`` (each CP rank holds two of ``2 cp`` load-balanced chunks).
2. Only for models whose every layer type runs CP: no MoE layers (the router needs a whole
   sequence on one rank), no windowed, patch-merging, cross-attention or carried layers (the
   vision and T5 families do not run CP).
3. Per layer, ``ring`` always (with ``cp > 1``); ``ulysses`` only when ``cp x tp`` divides the
   heads and the key/value groups (each CP rank gets whole heads).
4. CP is searched only when the model's sequence is at least ``CP_MIN_SEQ_LENGTH`` tokens
   (``SearchOptions.cp_min_seq_length`` overrides it): below that the attention's share of a
   layer is small and splitting the sequence buys little that TP and DP do not, so small models
   keep the search space (and speed) they had. This one *defines* the default space; it is not
   claimed to keep the optimum of a wider one. A pinned ``cp`` (``SearchOptions.cp``) is taken
   whatever the length.

Pure, no torch.
"""

from __future__ import annotations

from ..inputs.model_spec import LayerType, ModelSpec
from .options import SearchOptions

# Rule 4: the shortest sequence (tokens) at which the search tries cp > 1 by default.
CP_MIN_SEQ_LENGTH = 8192


def runs_cp(layer_type: LayerType) -> bool:
    """Whether a layer of this type can run under context parallelism (rule 2)."""
    return (layer_type.moe is None and layer_type.window_size == 0
            and layer_type.merge_input_hidden == 0
            and layer_type.cross_attention_seq_length == 0
            and layer_type.carried_seq_length == 0)


def cp_fits(spec: ModelSpec, stage_size: int, cp: int) -> bool:
    """Rules 1 and 2 for one degree on a stage of ``stage_size`` ranks."""
    if cp == 1:
        return True
    return (cp & (cp - 1) == 0 and stage_size % cp == 0
            and all(runs_cp(lt) and lt.seq_length % (2 * cp) == 0 for lt in spec.layer_types))


def cp_degrees(spec: ModelSpec, stage_size: int, options: SearchOptions) -> tuple[int, ...]:
    """The CP degrees a task with stages of ``stage_size`` ranks searches, ascending (1 first):
    the pinned one where it fits (none otherwise), else 1 and, from the rule-4 length on, every
    power of two rules 1-2 allow."""
    if options.cp is not None:
        return (options.cp,) if cp_fits(spec, stage_size, options.cp) else ()
    if spec.seq_length < options.cp_min_seq_length:
        return (1,)
    out, cp = [1], 2
    while cp <= stage_size:
        if cp_fits(spec, stage_size, cp):
            out.append(cp)
        cp *= 2
    return tuple(out)


def cp_modes(layer_type: LayerType, tp: int, cp: int, modes: tuple[str, ...]) -> tuple[str, ...]:
    """The CP modes of a layer of ``layer_type`` at ``tp`` under ``cp`` (rule 3), in ``modes``
    order; ``("ring",)`` (the field's default, no CP) when ``cp == 1``."""
    if cp == 1:
        return ("ring",)
    groups = layer_type.num_query_groups or layer_type.num_attention_heads
    k = cp * tp
    return tuple(m for m in modes
                 if m == "ring" or (m == "ulysses" and layer_type.num_attention_heads % k == 0
                                    and groups % k == 0))


def check_cp_pin(options: SearchOptions, spec: ModelSpec, world: int) -> None:
    """A pinned ``cp`` that no stage of ``world`` devices can take raises ``ValueError`` naming
    the option, the value and the fix, instead of an empty space."""
    cp = options.cp
    if cp is None or cp == 1:
        return
    if cp & (cp - 1) or world % cp:
        raise ValueError(f"search option cp={cp}: must be a power of two dividing the {world} "
                         f"devices; choose 1, 2, 4, ... up to the stage size")
    bad = [lt.name for lt in spec.layer_types if not runs_cp(lt)]
    if bad:
        raise ValueError(f"search option cp={cp}: layer type {bad[0]!r} does not run context "
                         f"parallelism (MoE, windowed, cross-attention or carried layers); "
                         f"set cp to 1 or leave it unset")
    short = [lt for lt in spec.layer_types if lt.seq_length % (2 * cp)]
    if short:
        raise ValueError(f"search option cp={cp}: the sequence length {short[0].seq_length} "
                         f"must be divisible by 2 x cp = {2 * cp}; choose a smaller cp")
