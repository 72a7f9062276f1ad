"""Local moves on an answer the optimality gap (or the time limit) stopped short of the optimum.

A search stopped by ``--optimality-gap`` returns the best plan it met, which may be up to the
gap slower than the optimum: the tasks whose bounds were within the gap of it were never
searched. Among them are, most often, the answer's own layers under another vocabulary layout
(the embedding and head's TP degree and DP mode: seeds price only the first few layouts of a
layer table, ``driver.SEEDS_PER_TABLE``) and the answer with one run of identical layers under
another DP mode. :func:`polish` prices those neighbours with ``evaluate_plan`` and moves to the
fastest that fits while one is faster, so a near-tie the gap let through is not left on the
table (measured: Galvatron's plan for BERT-Large at 16 GB and GPT-1.5B at 40 GB differs from
the stopped answer only in the vocabulary's DP mode). It never returns a slower plan, the
lower bound is untouched (the certified gap only shrinks), and every move stays in the
searched space (``allowed``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Iterator, Sequence

from ...plan import Plan, VocabStrategy
from ...plan_errors import PlanError
from ..cost.estimate import Estimate, evaluate_plan
from ..inputs.cluster_model import ClusterModel
from ..inputs.model_spec import ModelSpec, TrainingSpec
from ..inputs.profiles import ModelProfile
from .walk_state import TIE

# Rounds of best-improvement moves; each round prices every neighbour once.
MAX_ROUNDS = 4


def changes(plan: Plan, vocabs: Sequence[VocabStrategy], dp_modes: Sequence[str]
            ) -> Iterator[tuple[VocabStrategy, tuple]]:
    """The ``(vocab, layers)`` of each neighbour of ``plan`` (:func:`neighbours`), unchecked:
    cheap to compare with the neighbours already priced before any ``Plan`` is built."""
    for vocab in vocabs:
        if vocab != plan.vocab:
            yield vocab, plan.layers
    layers = list(plan.layers)
    for stage in range(plan.pp_size):
        idx = list(plan.stage_layers(stage))
        start = 0
        while start < len(idx):
            end = start
            while end + 1 < len(idx) and layers[idx[end + 1]] == layers[idx[start]]:
                end += 1
            run = idx[start:end + 1]
            s = layers[run[0]]
            for mode in dp_modes:
                if mode != s.dp_mode:
                    moved = replace(s, dp_mode=mode)
                    yield plan.vocab, tuple(moved if i in run else x
                                            for i, x in enumerate(layers))
            start = end + 1


def _build(plan: Plan, vocab: VocabStrategy, layers: tuple) -> Plan | None:
    """``plan`` with ``vocab`` and ``layers``, or None where the plan's own checks refuse it."""
    try:
        return replace(plan, vocab=vocab, layers=layers)
    except PlanError:
        return None


def neighbours(plan: Plan, vocabs: Sequence[VocabStrategy], dp_modes: Sequence[str]
               ) -> Iterator[Plan]:
    """``plan`` under each other vocabulary layout of ``vocabs``, then with each maximal run of
    identical layer strategies within a stage under each other DP mode of ``dp_modes``; those
    the plan's own checks refuse (a vocabulary TP degree whose replicas do not divide the
    micro-batch, say) are left out."""
    for vocab, layers in changes(plan, vocabs, dp_modes):
        if (cand := _build(plan, vocab, layers)) is not None:
            yield cand


def polish(plan: Plan, estimate: Estimate, spec: ModelSpec, training: TrainingSpec,
           cluster: ClusterModel, profile: ModelProfile, budget: float,
           vocabs: Sequence[VocabStrategy], dp_modes: Sequence[str],
           allowed: Callable[[Plan], bool], out_of_time: Callable[[], bool],
           host_budget: float | None = None) -> tuple[Plan, Estimate, int]:
    """The fastest plan that fits ``budget`` reached from ``plan`` by best-improvement
    :func:`neighbours` moves (at most ``MAX_ROUNDS``, until ``out_of_time()``), its estimate,
    and how many moves were taken. ``allowed``: whether a neighbour is a plan of the searched
    space (pins, layer strategies, vocabulary layouts); others are not priced. ``host_budget``:
    the host-memory budget a neighbour must fit as well (activation offload), None for none."""
    batch = replace(training, global_batch_size=plan.global_batch_size)
    value = estimate.iteration_time_s
    moves = 0
    # Neighbours differ in vocabulary and layers only; after a vocabulary move the next round's
    # other vocabulary layouts are the same plans as this round's: priced once.
    seen: dict[tuple[Any, Any], tuple[Plan, Estimate] | None] = {
        (plan.vocab, plan.layers): (plan, estimate)}
    for _ in range(MAX_ROUNDS):
        found: tuple[Plan, Estimate] | None = None
        for key in changes(plan, vocabs, dp_modes):
            if out_of_time():
                return plan, estimate, moves
            if key not in seen:  # built, checked and priced once
                cand = _build(plan, *key)
                seen[key] = None if cand is None or not allowed(cand) else (cand, replace(
                    evaluate_plan(cand, spec, batch, cluster, profile, budget),
                    host_memory_budget_bytes=host_budget))
            entry = seen[key]
            if entry is not None and entry[1].feasible \
                    and entry[1].iteration_time_s < value * (1 - TIE):
                found, value = entry, entry[1].iteration_time_s
        if found is None:
            break
        plan, estimate = found
        moves += 1
    return plan, estimate, moves

