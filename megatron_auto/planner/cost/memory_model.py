"""Memory cost of one layer (or the embedding/head) under one strategy, per rank, in bytes.

Model states follow the runtime (docs/design.md §4): fp32 master parameters (4 B), fp32 gradients (4 B)
and Adam moments (8 B) per parameter whatever the compute precision; ``zero1`` shards the
optimizer states over the ``dp`` replicas, ``zero2`` gradients too, ``zero3`` parameters too. Activations are kept per
micro-batch in flight; transient bytes exist only while the component runs (a layer's backward,
the loss), so a stage adds only the largest one. Symbols and derivations: docs/cost_model.md §3.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...layout import Layout, dp_size, gathered_fraction, relayout_step
from ..inputs.profile_records import EmbeddingProfile, LayerTypeProfile
from .context_parallel import cp_kept_reduction, cp_transient_bytes

MASTER_BYTES = 4
GRAD_BYTES = 4
ADAM_BYTES = 8
# torch's foreach AdamW allocates sqrt(v) for every local parameter at once during the step
# (fp32, 4 B each), when activations are gone: a separate, step-time peak (measured on CPU:
# it binds with small micro-batches, e.g. 1 sample of s=32, h=64 per rank).
STEP_TEMP_BYTES = 4


@dataclass(frozen=True)
class MemoryCost:
    """Bytes per rank. ``activations_per_microbatch`` is multiplied by the micro-batches in
    flight; ``transient`` is the extra peak while this component runs (forward or backward).

    ``released_early`` (part of ``activations_per_microbatch``) is what the micro-batch being
    differentiated frees before any other component's backward runs (the loss's softmax): it is
    counted for ``in_flight - 1`` micro-batches and, inside ``transient``, for the running one.

    ``lazy_gradients`` (part of ``gradients``, set only when the stage peaks at its first
    backward, see :func:`lazy_gradients`) do not exist yet at that peak: they count as
    ``max(0, lazy - activations_per_microbatch)``, and once inside ``transient``.

    ``held_in_backward`` exists beside every other component's backward transient (the tied
    head's pending gradient, :func:`embedding_memory`): it counts in ``persistent`` (once, with
    any micro-batch in flight) and ``transient`` holds only what this component adds above it,
    so that a stage's ``sum persistent + max transient`` prices both moments.

    ``host_per_microbatch``: activations offloaded to host memory per micro-batch in flight
    (``cost/offload.py``), already taken out of ``activations_per_microbatch``.

    ``sync_transient``: buffers of this component's gradient synchronisation that exist at the
    end of the backward pass, when the activations are gone (an MoE layer's FSDP2 experts,
    ``cost/moe.py``): a stage counts the largest beside its model states, with the optimizer
    step's temporaries as the other candidate of that after-backward peak
    (``estimate.evaluate_plan``).
    """

    parameters: float
    gradients: float
    optimizer_states: float
    activations_per_microbatch: float
    transient: float
    released_early: float = 0.0
    lazy_gradients: float = 0.0
    step_temporary: float = 0.0
    held_in_backward: float = 0.0
    host_per_microbatch: float = 0.0
    sync_transient: float = 0.0

    @property
    def model_states(self) -> float:
        return self.parameters + self.gradients + self.optimizer_states

    @property
    def gradients_at_peak(self) -> float:
        lazy = self.lazy_gradients
        return self.gradients - lazy + max(0.0, lazy - self.activations_per_microbatch)

    def persistent(self, in_flight: int) -> float:
        return (self.parameters + self.gradients_at_peak + self.optimizer_states
                + in_flight * self.activations_per_microbatch
                + ((self.held_in_backward - self.released_early) if in_flight > 0 else 0.0))

    @property
    def step_peak(self) -> float:
        """Bytes once the activations are gone: model states plus the step's temporaries or
        the end of backward's ``sync_transient``, the larger. Summed over a stage's components
        (the search) this bounds ``evaluate_plan``'s ``states + max(sum of temporaries,
        largest sync_transient)`` from above; a component with ``sync_transient`` is sharded,
        so fused AdamW's dropping of the temporaries never applies to it."""
        return self.model_states + max(self.step_temporary, self.sync_transient)

    def persistent_bound(self, in_flight: int) -> float:
        """``persistent`` raised to cover the optimizer step too: summed over a stage's
        components it bounds ``max(backward peak, step peak)`` from above (the sum of maxima is
        at least the maximum of sums), which the per-stage search needs, being additive."""
        return self.persistent(in_flight) + max(0.0, self.step_peak - self.persistent(in_flight))


def lazy_gradients(dp_mode: str, dp: int) -> bool:
    """True when the runtime drops this component's gradients between iterations (``ddp`` on
    one rank: no bucket to keep; ``zero2``/``zero3`` shards), so each is made by its first
    backward of the iteration. ``ddp`` over several ranks keeps its bucket buffers allocated.

    That matters where a stage peaks at its first backward, with every micro-batch in flight
    (GPipe): the gradients of the layers not yet differentiated do not exist then. Bound used:
    a stage holds at most ``sum_i [(m - 1) a_i + max(a_i, g_i)]`` plus the running layer's
    transient and its own new gradient -- at the first backward the layers already
    differentiated have traded one micro-batch of activations ``a_i`` for gradients ``g_i``,
    and at every later backward one micro-batch fewer is in flight.
    """
    return (dp_mode in ("ddp", "zero1") and dp == 1) or (dp_mode in ("zero2", "zero3") and dp > 1)


def sharded_gradients(dp_mode: str, dp: int) -> bool:
    """True when FSDP2 holds this component's gradients (``zero2``/``zero3`` over ``dp > 1``):
    a backward's new gradient is then the unsharded gradient itself, not a temporary added
    into a kept ``.grad``."""
    return dp_mode in ("zero2", "zero3") and dp > 1


def model_states(num_params: float, dp_mode: str, dp: int) -> tuple[float, float, float, float]:
    """``(parameters, gradients, optimizer_states, transient)`` bytes for ``num_params`` local
    parameters replicated or sharded over ``dp`` ranks.

    ``zero2`` (FSDP2 without resharding between forward and the last backward) keeps the
    gathered full parameters next to its fp32 master shard for the whole step: ``4P(1 + 1/d)``,
    counted at 4 B even when the gather is in 16-bit (conservative).
    Transient: ``zero2`` and ``zero3`` produce each micro-batch's gradient unsharded before the
    reduce-scatter; ``zero3`` also gathers the full fp32 parameters for the layer in use.
    ``zero1`` (``parallel/distributed_optimizer.py``) keeps the parameters (fp32: they are the
    master weights too) and the gradient buckets whole, and the AdamW moments of its ``1/dp``
    slice only: ``4P + 4P + 8P/d``; the reduce-scatter and the all-gather work in place
    (bucket padding, under ``d`` elements per bucket, is not counted).
    """
    if dp_mode == "ddp" or dp == 1:
        return MASTER_BYTES * num_params, GRAD_BYTES * num_params, ADAM_BYTES * num_params, 0.0
    shard = num_params / dp
    if dp_mode == "zero1":
        return MASTER_BYTES * num_params, GRAD_BYTES * num_params, ADAM_BYTES * shard, 0.0
    unsharded = (1 - 1 / dp) * num_params
    if dp_mode == "zero2":
        return (MASTER_BYTES * (num_params + shard), GRAD_BYTES * shard, ADAM_BYTES * shard,
                GRAD_BYTES * unsharded)
    if dp_mode == "zero3":
        return (MASTER_BYTES * shard, GRAD_BYTES * shard, ADAM_BYTES * shard,
                (MASTER_BYTES + GRAD_BYTES) * unsharded)
    raise ValueError(f"dp_mode={dp_mode!r}: choose one of ddp, zero1, zero2, zero3")


def layer_memory(profile: LayerTypeProfile, tp: int, dp: int, dp_mode: str, recompute: bool,
                 samples: float, first_backward_peak: bool = False,
                 sequence_parallel: bool = False, cp: int = 1, cp_mode: str = "ring",
                 compute_bytes: int = 2, released_bytes: float = 0.0,
                 rebuilt_bytes: float = 0.0) -> MemoryCost:
    """Memory of one layer at TP ``tp`` with ``samples`` samples per rank per micro-batch.
    ``first_backward_peak``: the stage peaks at its first backward (GPipe), see
    :func:`lazy_gradients`.

    ``sequence_parallel`` (Megatron-SP, ``tp > 1``): what is kept is split over the TP group
    (:meth:`LayerTypeProfile.sequence_parallel_activation_bytes`), and a recomputing layer keeps
    its input's sequence chunk, ``1/tp`` of it. The backward scratch stays as measured without
    SP (conservative: SP's re-gathered inputs and output gradients are whole-sequence there).

    Without recompute a micro-batch keeps ``activation_bytes(tp)`` per sample plus the autocast
    weight copies autograd saved (``weight_copy_bytes_per_parameter`` per local parameter). With
    recompute it keeps only its input; backward then rebuilds everything once, so the rebuilt
    activations and copies become transient. The measured backward scratch (incoming gradient,
    input gradient, autograd intermediates) is transient either way.

    Context parallelism (``cp > 1``; ``samples`` in sample equivalents, ``dp`` the ``dp x cp``
    group the states are sharded over): ring attention keeps no score matrix and its chunk
    buffers are transient (``context_parallel``); ``compute_bytes`` is the activations' dtype.

    Module recompute (``cost/recompute.py``, not with ``recompute``): a micro-batch keeps
    ``released_bytes`` less; ``rebuilt_bytes`` (the largest module's) is transient in backward.
    """
    local = profile.local_parameters(tp)
    params, grads, optim, states_transient = model_states(local, dp_mode, dp)
    copies = profile.weight_copy_bytes_per_parameter * local
    sp = sequence_parallel and tp > 1
    per_sample = profile.sequence_parallel_activation_bytes(tp) if sp else profile.activation_bytes(tp)
    per_sample = max(0.0, per_sample - cp_kept_reduction(profile, tp, cp, cp_mode))
    full = per_sample * samples + copies
    if not recompute and released_bytes:
        full = max(0.0, full - released_bytes)
    # The measured scratch grows with the samples; its constant part is a weight's gradient,
    # made whole beside the activation gradients before autograd adds it into the kept
    # ``.grad`` (a bucket view). FSDP2's gradients are that new tensor itself, the unsharded
    # gradient already in ``states_transient``.
    scratch = profile.scratch_bytes(tp) * samples
    scratch += cp_transient_bytes(profile, tp, cp, cp_mode, samples, compute_bytes)
    if not sharded_gradients(dp_mode, dp):
        scratch += profile.scratch_constant_bytes(tp)
    if recompute:
        kept = profile.recompute_bytes_per_sample * samples / (tp if sp else 1)
        transient = scratch + full + states_transient
        if dp_mode in ("zero2", "zero3") and dp > 1:
            # FSDP2 defers the reduce-scatter of a checkpointed layer to the end of the backward
            # pass (measured: all of them pending at once), so one unsharded copy of its
            # gradient stays until then: the reduce-scatter's input, which FSDP2 fills from the
            # unsharded gradient and frees that (two copies over-priced a 4-layer zero2 stage
            # by 8.9%, 21.0 MiB against 19.3 MiB measured; one gives 19.5). Once per backward
            # pass, not per micro-batch in flight: counted with the gradients.
            grads += GRAD_BYTES * local * (1 - 1 / dp)
    else:
        kept = full
        transient = scratch + states_transient + rebuilt_bytes
    step = STEP_TEMP_BYTES * optim / ADAM_BYTES  # one fp32 value per local master parameter
    if first_backward_peak and lazy_gradients(dp_mode, dp):
        return MemoryCost(params, grads, optim, kept, transient + min(kept, grads),
                          lazy_gradients=grads, step_temporary=step)
    return MemoryCost(params, grads, optim, kept, transient, step_temporary=step)


def vocab_parameters(profile: EmbeddingProfile, vocab_tp: int, first: bool, last: bool,
                     pp: int) -> float:
    """Local parameters of the embedding (``first``) and/or final norm and head (``last``):
    vocabulary-split rows divided by ``vocab_tp`` (position embeddings replicated, when the
    profile records them), the tied word embedding's own copy on the last stage when
    ``pp > 1``."""
    num_params = 0.0
    if first:
        num_params += profile.local_embedding_parameters(vocab_tp)
    if last:
        num_params += profile.head_parameters
        if profile.tied and (pp > 1 or not first):  # the word embedding's copy alone
            num_params += profile.split_embedding_parameters / vocab_tp
    return num_params


def embedding_memory(profile: EmbeddingProfile, vocab_tp: int, dp: int, dp_mode: str,
                     samples: float, first: bool, last: bool, pp: int,
                     first_backward_peak: bool = False) -> MemoryCost:
    """Memory of the embedding (``first``) and/or LM head (``last``) on one rank.

    ``first_backward_peak`` (GPipe): the embedding alone on the first stage gets its gradients
    last, so they count as lazy (:func:`lazy_gradients`); the head's come first and always count.

    With tied weights and ``pp > 1`` the last stage keeps its own copy of the word embedding (the
    runtime all-reduces their gradients), so it is counted on both stages. Position embeddings
    are replicated over the vocab TP group (``EmbeddingProfile.replicated_parameters``; profiles
    that do not record them count them with the vocabulary-split rows).

    The loss's kept softmax is released early (see :class:`MemoryCost`): the in-place loss
    backward turns it into the logits gradient, which is gone before the layers' backward. Beside
    it, the loss's own transient (the shifted logits next to the logits, in forward; ``zero3``
    has the full parameters gathered then) and the states' transient (unsharded gradient and
    gathered parameters, in backward) come at different times: the larger counts.
    """
    num_params = vocab_parameters(profile, vocab_tp, first, last, pp)
    kept = 0.0
    loss_kept = 0.0
    loss_transient = 0.0
    if first:
        kept += profile.embedding_activation_bytes * samples
    if last:
        loss_kept = profile.head_activation_split_bytes / vocab_tp * samples
        kept += profile.head_activation_replicated_bytes * samples + loss_kept
        loss_transient = profile.head_transient_split_bytes / vocab_tp * samples
    params, grads, optim, states_transient = model_states(num_params, dp_mode, dp)
    gathered = MASTER_BYTES * num_params * (1 - 1 / dp) if dp_mode == "zero3" and dp > 1 else 0.0
    forward = loss_transient + gathered if last else 0.0
    # The head's backward makes its weight gradient whole beside the logits gradient before
    # autograd adds it into ``.grad`` (every vocabulary row of this rank; an untied head's
    # count includes the final norm: conservative by that).
    head_grad = GRAD_BYTES * (profile.split_embedding_parameters if profile.tied
                              else profile.head_parameters) / vocab_tp if last else 0.0
    # (FSDP2: that gradient is the unsharded one, already in ``states_transient``)
    transient = loss_kept + max(forward, states_transient
                                + (0.0 if sharded_gradients(dp_mode, dp) else head_grad))
    # One tied weight used by the embedding and the head of this stage: autograd holds the
    # head's gradient of it until the embedding's backward adds its own, i.e. through the
    # backward of every layer of the micro-batch (measured: ddp layers, pp 1).
    held = head_grad if first and last and profile.tied and pp == 1 else 0.0
    step = STEP_TEMP_BYTES * optim / ADAM_BYTES
    if first_backward_peak and first and not last and lazy_gradients(dp_mode, dp):
        return MemoryCost(params, grads, optim, kept, transient + min(kept, grads),
                          lazy_gradients=grads, step_temporary=step)
    return MemoryCost(params, grads, optim, kept, max(0.0, transient - held),
                      released_early=loss_kept, step_temporary=step, held_in_backward=held)


def _move_bytes(src: Layout, dst: Layout, microbatch_bytes: float, stage_size: int) -> float:
    step = relayout_step(src, dst, stage_size, 0)  # every rank takes the same branch
    if step.is_identity:
        return 0.0
    gathered = microbatch_bytes * gathered_fraction(src, step, stage_size)
    if step.gather and step.keep_count == 1:
        return gathered  # the gathered buffer is the new slice itself
    return gathered + microbatch_bytes / dp_size(dst, stage_size)  # plus the slice copied out


def relayout_memory(old: Layout, new: Layout, microbatch_size: int, bytes_per_sample: float,
                    stage_size: int) -> float:
    """Transient bytes on a rank while a micro-batch is re-laid out from ``old`` to ``new``.

    The runtime copies the slice it keeps (``parallel/redistribute.py``), so nothing outlives the
    move but that slice, which is the next layer's input (counted with its activations) and
    frees the source: the source, or the gathered micro-batch when the move gathers, exists next
    to the copy only while it is made. Forward moves ``old -> new``, backward the gradient
    ``new -> old``; the larger counts (they never run at once).
    """
    whole = microbatch_size * bytes_per_sample
    return max(_move_bytes(old, new, whole, stage_size), _move_bytes(new, old, whole, stage_size))
