"""Memory cost of one layer (or the embedding/head) under one strategy, per rank, in bytes.

Model states follow the runtime (DESIGN §4): fp32 master parameters (4 B), fp32 gradients (4 B)
and Adam moments (8 B) per parameter whatever the compute precision; ``zero2`` shards gradients
and optimizer states over the ``dp`` replicas, ``zero3`` parameters too. Activations are kept per
micro-batch in flight; transient bytes exist only while the layer runs its backward, so a stage
adds only the largest one. Symbols and derivations: docs/cost_model.md §3.
"""

from __future__ import annotations

from dataclasses import dataclass

from .profiles import EmbeddingProfile, LayerTypeProfile

# (s, h) activation slices of the running micro-batch alive beside a layer's own backward
# scratch: the incoming gradient and its accumulation into the input gradient, autograd's
# intermediates between sub-layers, and the pipeline's send/receive buffers of activations and
# gradients. Measured on CPU against the runtime (benchmarks/validate_cost_model.py: without
# it 4-stage plans were under-estimated by 10-15%); a small share of any large model.
BOUNDARY_BUFFERS = 8

MASTER_BYTES = 4
GRAD_BYTES = 4
ADAM_BYTES = 8


@dataclass(frozen=True)
class MemoryCost:
    """Bytes per rank. ``activations_per_microbatch`` is multiplied by the micro-batches in
    flight; ``transient`` is the extra peak while this component runs its backward."""

    parameters: float
    gradients: float
    optimizer_states: float
    activations_per_microbatch: float
    transient: float

    @property
    def model_states(self) -> float:
        return self.parameters + self.gradients + self.optimizer_states

    def persistent(self, in_flight: int) -> float:
        return self.model_states + in_flight * self.activations_per_microbatch


def model_states(num_params: float, dp_mode: str, dp: int) -> tuple[float, float, float, float]:
    """``(parameters, gradients, optimizer_states, transient)`` bytes for ``num_params`` local
    parameters replicated or sharded over ``dp`` ranks.

    ``zero2`` (FSDP2 without resharding between forward and the last backward) keeps the
    gathered full parameters next to its fp32 master shard for the whole step: ``4P(1 + 1/d)``,
    counted at 4 B even when the gather is in 16-bit (conservative).
    Transient: ``zero2`` and ``zero3`` produce each micro-batch's gradient unsharded before the
    reduce-scatter; ``zero3`` also gathers the full fp32 parameters for the layer in use.
    """
    if dp_mode == "ddp" or dp == 1:
        return MASTER_BYTES * num_params, GRAD_BYTES * num_params, ADAM_BYTES * num_params, 0.0
    shard = num_params / dp
    unsharded = (1 - 1 / dp) * num_params
    if dp_mode == "zero2":
        return (MASTER_BYTES * (num_params + shard), GRAD_BYTES * shard, ADAM_BYTES * shard,
                GRAD_BYTES * unsharded)
    if dp_mode == "zero3":
        return (MASTER_BYTES * shard, GRAD_BYTES * shard, ADAM_BYTES * shard,
                (MASTER_BYTES + GRAD_BYTES) * unsharded)
    raise ValueError(f"dp_mode={dp_mode!r}: choose one of ddp, zero2, zero3")


def layer_memory(profile: LayerTypeProfile, tp: int, dp: int, dp_mode: str, recompute: bool,
                 samples: float) -> MemoryCost:
    """Memory of one layer at TP ``tp`` with ``samples`` samples per rank per micro-batch.

    Without recompute a micro-batch keeps ``activation_bytes(tp)`` per sample plus the autocast
    weight copies autograd saved (``weight_copy_bytes_per_parameter`` per local parameter). With
    recompute it keeps only its input; backward then rebuilds everything once, so the rebuilt
    activations and copies become transient.
    """
    local = profile.parameter_count / tp
    params, grads, optim, states_transient = model_states(local, dp_mode, dp)
    copies = profile.weight_copy_bytes_per_parameter * local
    full = profile.activation_bytes(tp) * samples + copies
    scratch = (profile.scratch_bytes(tp) + BOUNDARY_BUFFERS * profile.hidden_bytes_per_sample) \
        * samples
    if recompute:
        kept = profile.recompute_bytes_per_sample * samples
        transient = scratch + full + states_transient
        if dp_mode != "ddp" and dp > 1:
            # FSDP2 defers the reduce-scatter of a checkpointed layer to the end of backward
            # (measured: all of them pending at once), so its unsharded gradient and the
            # reduce-scatter's input copy stay until then: kept, not transient.
            kept += 2 * GRAD_BYTES * local * (1 - 1 / dp)
    else:
        kept = full
        transient = scratch + states_transient
    return MemoryCost(params, grads, optim, kept, transient)


def embedding_memory(profile: EmbeddingProfile, vocab_tp: int, dp: int, dp_mode: str,
                     samples: float, first: bool, last: bool, pp: int) -> MemoryCost:
    """Memory of the embedding (``first``) and/or LM head (``last``) on one rank.

    With tied weights and ``pp > 1`` the last stage keeps its own copy of the word embedding (the
    runtime all-reduces their gradients), so it is counted on both stages. Position embeddings
    are counted with the vocabulary-split rows (a small approximation: they are replicated).
    """
    num_params = 0.0
    kept = 0.0
    transient = 0.0
    if first:
        num_params += profile.embedding_parameters / vocab_tp
        kept += profile.embedding_activation_bytes * samples
    if last:
        num_params += profile.head_parameters
        if profile.tied and (pp > 1 or not first):
            num_params += profile.embedding_parameters / vocab_tp
        kept += (profile.head_activation_replicated_bytes
                 + profile.head_activation_split_bytes / vocab_tp) * samples
        transient += (profile.head_transient_split_bytes / vocab_tp
                      + BOUNDARY_BUFFERS * profile.hidden_bytes_per_sample) * samples
    params, grads, optim, states_transient = model_states(num_params, dp_mode, dp)
    return MemoryCost(params, grads, optim, kept, transient + states_transient)
