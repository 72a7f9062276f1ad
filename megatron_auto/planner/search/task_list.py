"""The search's tasks: every (global batch, pipeline degree, micro-batch count, schedule, CP
degree, optimizer offload, vocabulary layout, virtual size) of a space, as ``tasks.Task`` objects
sharing their layer tables (``driver._run`` visits them).

With a host budget each task is also built at every optimizer offload fraction searched (one
fraction for every stage), and for ``pp > 1`` a ``mixed_offload.MixedOffloadTask`` over those
variants lets each stage take its own.
"""

from __future__ import annotations

from dataclasses import replace

from ...plan import VocabStrategy
from ...plan_optimizer_offload import OFFLOADABLE_DP_MODES
from ..inputs.cluster_model import ClusterModel
from ..inputs.model_spec import ModelSpec, TrainingSpec
from ..inputs.profiles import ModelProfile
from .cp_space import cp_degrees
from .family_bound import join_families
from .layer_tables import LayerTables
from .mixed_offload import MixedOffloadTask, same_classes
from .options import SearchOptions
from .search_cache import SearchCache
from .spaces import Space, SpaceRules, pipeline_degrees, vocab_tps
from .tasks import TablesKey, Task


def batches(training: TrainingSpec, options: SearchOptions) -> list[int]:
    b = training.global_batch_size
    if not options.search_batch_size:
        return [b]
    return sorted({b * 2 ** j // 8 for j in range(0, 7) if (b * 2 ** j) % 8 == 0})


def vocabs(spec: ModelSpec, space: Space, options: SearchOptions, n: int, b_m: int,
            rules: SpaceRules, devices_per_node: int) -> list[VocabStrategy]:
    modes = space.vocab_modes or tuple(options.dp_modes)
    if space.vocab_tp == "layer":
        tps = list(rules.tps or ())
    elif isinstance(space.vocab_tp, int):
        tps = [space.vocab_tp]
    elif options.vocab_tp is not None:
        tps = [options.vocab_tp]
    else:
        # A pinned layer tp does not pin the vocabulary (that is ``vocab_tp``).
        tps = vocab_tps(spec.vocab_size, n, b_m, replace(rules, tps=None), devices_per_node)
    out = []
    cp = rules.cp  # the task's CP degree: the vocabulary shares it
    for tp in tps:
        if tp > n // cp or (n // cp) % tp or spec.vocab_size % tp or b_m % (n // (tp * cp)):
            continue
        for mode in (("ddp",) if n // tp == 1 else modes):
            out.append(VocabStrategy(tp=tp, dp_mode=mode))
    return out


def build_tasks(space: Space, spec: ModelSpec, training: TrainingSpec, cluster: ClusterModel,
                profile: ModelProfile, budget: float, options: SearchOptions, world: int,
                step: int, cache: SearchCache) -> list[Task]:
    """Every task of ``space`` (module docstring), in enumeration order."""
    schedules = [options.schedule] if options.schedule else ["1f1b"]
    pps = space.pps or tuple(pipeline_degrees(world, cluster.devices_per_node, spec.num_layers))
    if options.pp is not None and space.pps is None:
        pps = tuple(p for p in pps if p == options.pp)
    out: list[Task] = []
    shared: dict[TablesKey, LayerTables] = {}  # a space's tasks share layer tables

    def make(batch: int, pp: int, m: int, sched: str, rules: SpaceRules, vocab: VocabStrategy,
             v: int = 1, sibling: Task | None = None) -> Task:
        return Task(spec, profile, cluster, world, batch, pp, m, sched, rules, vocab, budget,
                    step, shared, virtual_size=v, cache=cache, sibling=sibling)

    for batch in batches(training, options):
        for pp in pps:
            if pp > spec.num_layers or world % pp:
                continue
            ms = [options.num_microbatches] if options.num_microbatches else \
                [d for d in range(1, batch + 1) if batch % d == 0]
            for m in ms:
                if batch % m:
                    continue
                for sched in schedules:
                    if space.even_split or space.pps is not None or not space.interleave:
                        vs = [1]  # a baseline space keeps its own rules: no interleaving
                    else:
                        vs = [v for v in sorted(set(options.virtual_sizes))
                              if v == 1 or interleaves(options, spec, pp, m, sched, v)]
                    cps = space.cps if space.cps is not None else \
                        cp_degrees(spec, world // pp, options)
                    for cp in cps:
                        cp_rules = space.rules if cp == space.rules.cp else \
                            replace(space.rules, cp=cp)
                        uniform: dict[tuple[SpaceRules, VocabStrategy], Task] = {}
                        every = offload_rules(cp_rules, options)
                        for rules in every:
                            for vocab in vocabs(spec, space, options, world // pp, batch // m,
                                                rules, cluster.devices_per_node):
                                if rules.optimizer_offload \
                                        and vocab.dp_mode not in OFFLOADABLE_DP_MODES:
                                    continue
                                base = None  # the v = 1 task: its least peak is shared
                                for v in vs:
                                    task = make(batch, pp, m, sched, rules, vocab, v,
                                                base if v > 1 else None)
                                    if not task.ok:
                                        break
                                    if v == 1:
                                        base = uniform[rules, vocab] = task
                                    out.append(task)
                        if pp > 1 and len(every) > 1 and options.per_stage_offload:
                            out += _mixed(every, uniform, lambda r, voc: make(
                                batch, pp, m, sched, r, voc))
    join_families(out)  # one bound for a layer table's vocabulary layouts (family_bound)
    return out


def _mixed(every: list[SpaceRules], uniform: dict[tuple[SpaceRules, VocabStrategy], Task],
           make) -> list[Task]:
    """The per-stage offload tasks of one (batch, pp, micro-batches, schedule, CP degree):
    per vocabulary layout, a ``MixedOffloadTask`` over its uniform tasks at every fraction of
    ``every`` (``every[0]``: no offload). A vocabulary whose DP flavour the host optimizer does
    not step has no uniform offloading task; its variants are built here for the middle stages
    (pp > 2), which hold neither the embedding nor the head."""
    out: list[Task] = []
    for (rules, vocab), base in list(uniform.items()):
        if rules != every[0]:
            continue
        ends = vocab.dp_mode in OFFLOADABLE_DP_MODES
        if not ends and base.pp < 3:
            continue  # no stage may offload: the uniform task is the whole space
        variants = [base]
        for offloading in every[1:]:
            task = uniform.get((offloading, vocab)) if ends else make(offloading, vocab)
            if task is None or not task.ok or not same_classes(base, task):
                break
            variants.append(task)
        else:
            out.append(MixedOffloadTask(variants))
    return out


def offload_rules(rules: SpaceRules, options: SearchOptions) -> list[SpaceRules]:
    """``rules`` and, when a host budget is given (``SearchOptions.host_memory_budget_bytes``),
    its variant for each optimizer offload fraction searched: one fraction for every stage of
    the task, its layers and vocabulary in the DP flavours the host optimizer steps (ddp,
    zero1; ``plan_optimizer_offload``)."""
    out = [rules]
    if rules.host_memory_budget_bytes is None:
        return out
    modes = tuple(m for m in rules.dp_modes if m in OFFLOADABLE_DP_MODES)
    if not modes:
        return out
    for fraction in sorted(set(options.optimizer_offload_fractions)):
        out.append(replace(rules, optimizer_offload=float(fraction), dp_modes=modes))
    return out


def interleaves(options: SearchOptions, spec: ModelSpec, pp: int, m: int, schedule: str,
                 v: int) -> bool:
    """Whether tasks with virtual size ``v > 1`` exist: pp > 1, m a multiple of pp (the
    schedule's rule), 1F1B, at least one layer per chunk, and every partition or the even one
    searched (the other partition kinds are defined for contiguous stages)."""
    return (pp > 1 and m % pp == 0 and schedule == "1f1b" and pp * v <= spec.num_layers
            and options.partition in ("exact", "even"))


