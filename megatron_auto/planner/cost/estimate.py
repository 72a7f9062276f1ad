"""The cost model of a whole plan: per-stage memory peak and time, and the iteration estimate.

:func:`evaluate_plan` prices ANY plan (searched, imported from Galvatron, uniform Megatron) with
the same per-layer costs the search uses (``cost_memory``, ``cost_time``), so a searched plan's
recorded estimate equals what ``evaluate`` says about it. Per stage ``k`` of a plan with ``m``
micro-batches:

- peak memory = reserve + sum of model states + ``in_flight_k`` x activations per micro-batch +
  embedding/head + the largest transient (one layer's backward or the loss);
  ``in_flight_k = schedule.in_flight`` (``min(pp - k, m)`` for 1F1B, ``m`` for GPipe);
  interleaved plans hold the schedule's worst mix of chunk activations
  (``interleaving.in_flight_vectors``).
- time per micro-batch ``C_k`` = layers' forward + backward + the moves of the micro-batch's
  activation, both ways: embedding -> first layer (first stage), the incoming p2p hop and
  relayout (later stages and chunks), layer -> layer, last layer -> LM head (last stage), with
  the sequence-parallel boundaries, each priced by ``cost_time.relayout_cost`` /
  ``stage_boundary_cost`` and ``layout.sequence_parallel_boundary_collectives`` as the
  runtime issues it; the largest
  move's transient counts with the other transients. The gradient-sync tail and the pipeline
  formula are in ``cost_time.pipeline_time``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from ...layout import dp_size, layout_of, plan_stage_layouts
from ...plan import Plan
from ...plan_optimizer_offload import stage_fraction
from ...schedule import in_flight
from .collectives import gloo_bucket_copy_bytes, step_collectives
from .memory_model import ADAM_BYTES, MemoryCost, embedding_memory, layer_memory
from .moves import chunk_moves, move_cost, sp_reduced_tensor_bytes
from .time_model import (NO_MOVE, NO_TIME, MoveCost, TimeCost, embedding_time, layer_time,
                         pipeline_time)
from .gpu_terms import fragmentation_bytes, stage_nccl_bytes
from .interleaving import InFlightMemo, peak_activations, pipeline_fill
from ..inputs.model_spec import ModelSpec, TrainingSpec
from ..inputs.profiles import ModelProfile, dropout_mask_bytes, fill_attention_defaults
from ..inputs.cluster_model import ClusterModel
from .offload import (apply_offload_memory, apply_offload_time, offload_cost,
                      optimizer_offload_cost)
from .recompute import module_terms
from .moe import has_mlp, with_experts

__all__ = ["Estimate", "StageEstimate", "evaluate_plan", "in_flight", "step_overhead"]

GIB = 1024 ** 3
# A stage whose peak is within this fraction of the budget is reported as memory-bound.
MEMORY_BINDING_HEADROOM = 0.05


@dataclass(frozen=True)
class StageEstimate:
    time_s: float
    microbatch_time_s: float
    forward_time_s: float
    backward_time_s: float
    sync_tail_s: float
    peak_memory_bytes: float
    memory_breakdown: Mapping[str, float]
    in_flight_microbatches: int
    num_layers: int
    binding: str = ""
    # Host memory each rank of the stage holds (cost/offload.py): offloaded activations and,
    # of it, ``host_optimizer_bytes`` for the offloaded optimizer share.
    host_memory_bytes: float = 0.0
    host_optimizer_bytes: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        out = {"time_s": self.time_s, "microbatch_time_s": self.microbatch_time_s,
               "forward_time_s": self.forward_time_s, "backward_time_s": self.backward_time_s,
               "sync_tail_s": self.sync_tail_s, "peak_memory_bytes": self.peak_memory_bytes,
               "memory_breakdown": dict(self.memory_breakdown),
               "in_flight_microbatches": self.in_flight_microbatches,
               "num_layers": self.num_layers, "binding": self.binding}
        if self.host_memory_bytes:  # absent without offload: estimates stay as they were
            out["host_memory_bytes"] = self.host_memory_bytes
        if self.host_optimizer_bytes:
            out["host_optimizer_bytes"] = self.host_optimizer_bytes
        return out


@dataclass(frozen=True)
class Estimate:
    """The cost model's verdict on a plan. ``to_dict()`` is the plan's ``estimate`` record."""

    iteration_time_s: float
    samples_per_s: float
    tokens_per_s: float
    bubble_fraction: float
    stages: tuple[StageEstimate, ...]
    memory_budget_bytes: float | None = None
    per_layer: tuple[Mapping[str, float], ...] = field(default=(), compare=False)
    # --host-memory-budget-gb in bytes (activation offload's second budget); None: not given
    host_memory_budget_bytes: float | None = None

    @property
    def host_memory_bytes(self) -> float:
        """The most host memory one rank holds for offloaded activations (any stage)."""
        return max((st.host_memory_bytes for st in self.stages), default=0.0)

    @property
    def host_optimizer_bytes(self) -> float:
        """The most host memory one rank holds for its offloaded optimizer share."""
        return max((st.host_optimizer_bytes for st in self.stages), default=0.0)

    @property
    def peak_memory_bytes(self) -> float:
        return max(s.peak_memory_bytes for s in self.stages)

    @property
    def feasible(self) -> bool:
        """True when no budget was given or every stage's peak fits it (and the host budget, when
        given, holds every stage's offloaded activations)."""
        host = self.host_memory_budget_bytes
        return ((self.memory_budget_bytes is None
                 or self.peak_memory_bytes <= self.memory_budget_bytes)
                and (host is None or self.host_memory_bytes <= host))

    @property
    def binding(self) -> tuple[str, ...]:
        return tuple(s.binding for s in self.stages)

    def to_dict(self) -> dict[str, Any]:
        out = {"iteration_time_s": self.iteration_time_s, "samples_per_s": self.samples_per_s,
               "tokens_per_s": self.tokens_per_s, "bubble_fraction": self.bubble_fraction,
               "peak_memory_bytes": self.peak_memory_bytes,
               "stages": [s.to_dict() for s in self.stages]}
        if self.memory_budget_bytes is not None:
            out["memory_budget_bytes"] = self.memory_budget_bytes
            out["feasible"] = self.feasible
        if self.host_memory_budget_bytes is not None:
            out["host_memory_budget_bytes"] = self.host_memory_budget_bytes
            out["feasible"] = self.feasible
        return out


def step_overhead(cluster: ClusterModel, world_size: int, spec: ModelSpec | None = None
                  ) -> float:
    """Fixed seconds per iteration outside the layers: the optimizer step's own overhead plus
    the :func:`step_collectives`."""
    return cluster.step_overhead_s + sum(
        count * cluster.allreduce_time(c.nbytes, c.group_size, c.consecutive)
        for c, count in step_collectives(world_size, spec).items())


def _binding(peak: float, budget: float | None, shares: Mapping[str, float]) -> str:
    if budget is not None and peak > budget:
        return f"memory (over budget by {(peak - budget) / GIB:.2f} GiB)"
    if budget is not None and peak >= (1 - MEMORY_BINDING_HEADROOM) * budget:
        return "memory"
    return max(shares, key=lambda k: shares[k])


def _add_moves(a: MoveCost, b: MoveCost) -> MoveCost:
    """Moves of one stage run one after the other: times add, the largest transient counts."""
    return MoveCost(a.forward + b.forward, a.backward + b.backward,
                    max(a.transient_bytes, b.transient_bytes))

def evaluate_plan(plan: Plan, spec: ModelSpec, training: TrainingSpec, cluster: ClusterModel,
                  profile: ModelProfile, memory_budget_bytes: float | None = None, *,
                  in_flight_memo: InFlightMemo | None = None) -> Estimate:
    """Cost-model estimate of ``plan`` (any source). Raises ``ValueError`` on a mismatch between
    plan, model and profile (layer count, world size, batch).

    Interleaved plans (``pipeline.virtual_size`` v > 1): a stage's chunks each make their own
    moves (a p2p hop into every chunk but the model's first), its activations peak at the
    largest in-flight mix of :func:`interleaving.in_flight_vectors`, and the pipeline formula
    takes the fill ``sum_k max_j c_{k,j}`` and ``m - 1/v`` steady micro-batches
    (``cost_time.pipeline_time``). ``in_flight_memo``: the caller's memo of those mixes (a
    search prices many plans of one schedule)."""
    if plan.num_layers != spec.num_layers:
        raise ValueError(f"plan has {plan.num_layers} layers but model {spec.name!r} has "
                         f"{spec.num_layers}; use a plan made for this model")
    if plan.world_size > cluster.world_size:
        raise ValueError(f"plan world_size={plan.world_size} but cluster {cluster.name!r} has "
                         f"only {cluster.world_size} devices; use a plan for this cluster")
    profile.check_matches(spec, training.precision)
    if plan.cp_size > 1:  # CP prices attention by length: give older profiles the default
        profile = fill_attention_defaults(profile, spec)
    n, pp, m, v = plan.stage_size, plan.pp_size, plan.num_microbatches, plan.virtual_size
    b_m = plan.microbatch_size
    schedule = plan.pipeline.schedule
    gpipe = schedule == "gpipe"
    emb = profile.embedding
    micro, backward, tails, steps, stage_parts, chunk_times = [], [], [], [], [], []
    per_layer: list[dict[str, float]] = [{} for _ in range(plan.num_layers)]
    # A layer's memory and time depend only on its type and strategy here (the stage size,
    # micro-batch, schedule and precision are the plan's): priced once per pair, as the search
    # prices whole plans whose layers mostly repeat a few strategies.
    priced: dict[tuple[str, Any], tuple[MemoryCost, TimeCost, bool]] = {}
    communicator_bytes = getattr(cluster, "nccl_communicator_bytes", 0.0)
    # every stage's NCCL groups come from one list of the plan's layouts: built once
    layouts = plan_stage_layouts(plan) if communicator_bytes > 0 else None
    for k in range(pp):
        first, last = k == 0, k == pp - 1
        chunks = plan.stage_chunks(k)
        states = {"parameters": 0.0, "gradients": 0.0, "optimizer_states": 0.0}
        transient = 0.0
        step_peak = 0.0  # model states + the optimizer step's temporaries (activations gone)
        step_temps, sharded = 0.0, False  # foreach temporaries; any FSDP2 (DTensor) shard?
        sync_temp = 0.0  # the largest gradient-sync buffers left at the end of backward
        total = NO_TIME  # layers, then embedding/head, one after the other
        moves = NO_MOVE  # relayouts (embedding, layers, head) and the incoming p2p hops
        kept = [0.0] * len(chunks)  # activations per micro-batch in flight, per local chunk
        host = [0.0] * len(chunks)  # offloaded activations per micro-batch, per local chunk
        times = [0.0] * len(chunks)  # per-micro-batch time of each local chunk
        first_bwd = [0.0] * len(chunks)
        layer_mems: list[tuple[int, int, MemoryCost, TimeCost]] = []
        for j, c in enumerate(chunks):
            chunk_total, chunk_moves_cost = NO_TIME, NO_MOVE
            for i in plan.chunk_layer_range(c):
                s = plan.layers[i]
                name = spec.layer_type(i).name
                dp = n // s.tp
                if (name, s) not in priced:
                    lp = profile.layer_types[name]
                    samples = b_m / dp
                    sp = s.sequence_parallel and s.tp > 1
                    # Module recompute (layers[i].recompute "selective" or a list): what it
                    # releases and re-runs (cost/recompute.py); ring CP keeps no scores anyway.
                    modules = s.recompute_modules - ({"core_attn"} if s.cp > 1 else set())
                    mod = module_terms(lp, spec.layer_type(i), modules, s.tp, samples,
                                       training.compute_bytes,
                                       dropout_mask_bytes(cluster, training.compute_bytes))
                    lt = spec.layer_type(i)
                    mem = layer_memory(lp, s.tp, dp, s.dp_mode, s.full_recompute, samples,
                                       first_backward_peak=gpipe, sequence_parallel=sp,
                                       cp=s.cp, cp_mode=s.cp_mode,
                                       compute_bytes=training.compute_bytes,
                                       released_bytes=mod.released_bytes,
                                       rebuilt_bytes=mod.largest_module_bytes)
                    t = layer_time(lp, cluster, layout_of(s, n), s.dp_mode, s.full_recompute,
                                   samples, n, training.precision, sequence_parallel=sp,
                                   norm_grad_bytes=sp_reduced_tensor_bytes(spec, i) if sp
                                   else (), cp_mode=s.cp_mode,
                                   recompute_forward_s=mod.forward_time_s,
                                   recompute_modules=s.recompute_modules, mlp=has_mlp(lt))
                    # MoE layers: the router and routed experts on top (cost/moe.py)
                    mem, t, experts_sharded = with_experts(
                        mem, t, lp, lt, cluster, s, layout_of(s, n), n, samples,
                        training.precision, first_backward_peak=gpipe)
                    # Activation offload (layers[i].offload): moved to the host, copies priced
                    off = offload_cost(s, lp, lt, cluster, samples,
                                       mem.activations_per_microbatch, training.compute_bytes,
                                       dropout_mask_bytes(cluster, training.compute_bytes))
                    priced[name, s] = (apply_offload_memory(mem, off),
                                       apply_offload_time(t, off), experts_sharded)
                mem, t, experts_sharded = priced[name, s]
                host[j] += mem.host_per_microbatch
                states["parameters"] += mem.parameters
                states["gradients"] += mem.gradients_at_peak
                states["optimizer_states"] += mem.optimizer_states
                kept[j] += mem.activations_per_microbatch
                transient = max(transient, mem.transient)
                step_peak += mem.model_states + mem.step_temporary  # sync: below, the largest
                step_temps += mem.step_temporary
                sync_temp = max(sync_temp, mem.sync_transient)
                sharded = sharded or experts_sharded or (s.dp_mode in ("zero2", "zero3")
                                                         and dp > 1)
                chunk_total = chunk_total + t
                layer_mems.append((i, j, mem, t))
            for move in chunk_moves(plan, spec, profile, c):
                chunk_moves_cost = _add_moves(chunk_moves_cost, move_cost(cluster, move, plan))
                if move.hop and v > 1:
                    # the received input (p2p buffer) stays until the chunk's backward: kept
                    # per micro-batch in flight (v = 1: not modelled, docs/cost_model.md §3)
                    kept[j] += b_m / dp_size(move.old, n) * move.bytes_per_sample
            total = total + chunk_total
            moves = _add_moves(moves, chunk_moves_cost)
            times[j] = chunk_total.microbatch + chunk_moves_cost.total
            first_bwd[j] = chunk_total.backward + chunk_moves_cost.backward
        transient = max(transient, moves.transient_bytes)
        emb_mem = MemoryCost(0, 0, 0, 0, 0)
        emb_chunk = 0 if first else len(chunks) - 1
        if first or last:
            vdp = n // plan.vocab.tp
            v_samples = b_m / vdp
            emb_mem = embedding_memory(emb, plan.vocab.tp, vdp, plan.vocab.dp_mode, v_samples,
                                       first, last, pp, first_backward_peak=gpipe)
            et = embedding_time(emb, cluster, plan.vocab.tp, plan.vocab.dp_mode, v_samples, n,
                                first, last, pp, spec.seq_length, training.precision)
            total = total + et
            transient = max(transient, emb_mem.transient)
            if v > 1:  # pp > 1 here: the embedding's chunk and the head's are different stages
                times[emb_chunk] += et.microbatch
                first_bwd[emb_chunk] += et.backward if first else 0.0
        if v == 1:
            counts: tuple[int, ...] = (in_flight(schedule, pp, k, m),)
        else:
            with_emb = list(kept)
            with_emb[emb_chunk] += emb_mem.activations_per_microbatch
            counts = peak_activations(with_emb, pp, v, m, k, in_flight_memo)[1]
        act = sum(nj * a for nj, a in zip(counts, kept))
        host_bytes = sum(nj * a for nj, a in zip(counts, host))
        k_emb = counts[emb_chunk]
        for i, j, mem, t in layer_mems:
            per_layer[i] = {"stage": k, "memory_bytes": mem.persistent(counts[j]),
                            "transient_bytes": mem.transient,
                            "forward_time_s": t.forward, "backward_time_s": t.backward,
                            "sync_time_s": t.sync}
        # The tied head's held gradient (cost_memory.embedding_memory) is shown with the
        # transient it sits beside, not with the embedding's persistent bytes.
        held = emb_mem.held_in_backward if k_emb > 0 else 0.0
        embedding_bytes = emb_mem.persistent(k_emb) - held
        transient += held
        step_peak += emb_mem.step_peak
        step_temps += emb_mem.step_temporary
        sharded = sharded or ((first or last) and plan.vocab.dp_mode in ("zero2", "zero3")
                              and n // plan.vocab.tp > 1)
        # Optimizer offload (pipeline.optimizer_offload_fraction, cost/offload.py): the share's
        # moments and step temporaries leave the device, the host holds 16 B per element, and
        # the step becomes the device's rest beside the host's share, with the copies.
        fraction = stage_fraction(plan.pipeline.optimizer_offload_fraction, k)
        owned = (states["optimizer_states"] + emb_mem.optimizer_states) / ADAM_BYTES
        opt_off = optimizer_offload_cost(cluster, fraction, owned)
        if opt_off.offloaded_elements:
            states["optimizer_states"] *= 1.0 - fraction
            embedding_bytes -= fraction * emb_mem.optimizer_states
            step_peak -= fraction * (ADAM_BYTES * owned + step_temps)
            step_temps *= 1.0 - fraction
            host_bytes += opt_off.host_bytes
            optimizer_step = (total.optimizer - cluster.optimizer_time_per_parameter_s * owned
                              + opt_off.step_time_s)
        else:
            optimizer_step = total.optimizer
        if getattr(cluster, "fused_optimizer", False) and not sharded:
            # Fused AdamW (CUDA, every parameter a plain tensor, parallel/optimizer.py): no
            # foreach temporaries; FSDP2's DTensor shards keep the foreach kernel.
            step_peak -= step_temps
            step_temps = 0.0
        # After the backward pass the activations are gone and the gradient sync's buffers
        # meet the model states, before the step's temporaries exist: the after-backward peak
        # is the states plus the larger of the two (the optimizer_step_excess shows it).
        sync_temp = max(sync_temp, gloo_bucket_copy_bytes(plan, spec, profile, cluster,
                                                          training.precision, k))
        step_peak += max(0.0, sync_temp - step_temps)
        breakdown = {**states, "activations": act, "transient": transient,
                     "embedding": embedding_bytes,
                     "context_reserve": float(cluster.memory_reserve_bytes)}
        nccl = stage_nccl_bytes(plan, k, communicator_bytes, layouts)
        frag = fragmentation_bytes(getattr(cluster, "fragmentation_fraction", 0.0),
                                   act + transient + k_emb * emb_mem.activations_per_microbatch)
        if nccl:  # outside the caching allocator, for the whole run: in both peaks
            breakdown["nccl_communicators"] = nccl
            step_peak += nccl
        if frag:
            breakdown["fragmentation_reserve"] = frag
        backward_peak = sum(breakdown.values())
        # peak = max(backward peak, optimizer-step peak): the step's excess is shown on its own.
        breakdown["optimizer_step_excess"] = max(
            0.0, step_peak + float(cluster.memory_reserve_bytes) - backward_peak)
        peak = sum(breakdown.values())
        fwd, bwd, tail = total.forward, total.backward, total.exposed_sync
        c_k = fwd + bwd + moves.total
        micro.append(c_k)
        backward.append(bwd + moves.backward if v == 1 else first_bwd[0])
        tails.append(tail)
        steps.append(optimizer_step)
        chunk_times.append(times if v > 1 else [c_k])
        stage_parts.append((fwd, bwd, tail, peak, breakdown, sum(counts), c_k, total.compute,
                            total.tp_comm, total.dp_comm, moves.total, host_bytes,
                            total.ep_comm, opt_off.host_bytes))
    pt = pipeline_time(micro, backward, tails, m, steps,
                       step_overhead(cluster, plan.world_size, spec),
                       virtual_size=v, fill=pipeline_fill(chunk_times) if v > 1 else None)
    stages = []
    for k, (fwd, bwd, tail, peak, breakdown, k_in, c_k, compute, tp_comm, dp_comm, moved,
            host_bytes, ep_comm, host_optimizer) in enumerate(stage_parts):
        shares = {"compute": m * compute, "tp_communication": m * tp_comm,
                  "dp_communication": m * dp_comm + tail, "relayout_and_p2p": m * moved,
                  "pipeline_bubble": pt.pipeline - m * c_k, "optimizer_step": steps[k]}
        if ep_comm:
            shares["ep_communication"] = m * ep_comm
        stages.append(StageEstimate(
            time_s=m * c_k + tail + steps[k], microbatch_time_s=c_k, forward_time_s=fwd,
            backward_time_s=bwd, sync_tail_s=tail, peak_memory_bytes=peak,
            memory_breakdown=breakdown, in_flight_microbatches=k_in,
            num_layers=len(plan.stage_layers(k)),
            binding=_binding(peak, memory_budget_bytes, shares), host_memory_bytes=host_bytes,
            host_optimizer_bytes=host_optimizer))
    samples_per_s = plan.global_batch_size / pt.iteration
    return Estimate(iteration_time_s=pt.iteration, samples_per_s=samples_per_s,
                    tokens_per_s=samples_per_s * spec.seq_length,
                    bubble_fraction=pt.bubble_fraction, stages=tuple(stages),
                    memory_budget_bytes=memory_budget_bytes, per_layer=tuple(per_layer))
