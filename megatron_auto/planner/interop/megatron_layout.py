"""Megatron-Core's ``--pipeline-model-parallel-layout`` string <-> our pipeline partition.

The layout lists the model's pipeline chunks in model order, ``|`` between chunks: ``E`` the
embedding, ``t`` a transformer layer, ``L`` the loss (output layer), ``m`` a multi-token
prediction layer; ``x*n`` repeats ``x`` and ``(...)*n`` a group, commas are cosmetic
(``"Et*3|(t*4|)*2,t*3L"``). With ``pp`` pipeline ranks and ``pp * v`` chunks, chunk ``c`` runs
on rank ``c mod pp`` as virtual stage ``c // pp``: the interleaved order of our
``pipeline.layers_per_stage`` with ``virtual_size`` v. Ours keep the embedding on the first
chunk and the head on the last, each beside at least one layer, so the string of a plan is
``E`` + the first chunk's layers, ..., the last chunk's layers + ``L``.

The grammar follows Megatron-Core's ``PipelineParallelLayerLayout`` (0.16), read here by our
own parser so that the planner needs no Megatron install.
"""

from __future__ import annotations

import re
from typing import Sequence

LAYOUT_FLAG = "--pipeline-model-parallel-layout"


class LayoutError(ValueError):
    """A layout string we cannot read or whose partition our plans cannot hold."""


def layout_string(chunk_layers: Sequence[int]) -> str:
    """The layout of chunks holding ``chunk_layers`` transformer layers (model order)."""
    parts = [f"t*{n}" if n > 1 else "t" for n in chunk_layers]
    parts[0] = "E" + parts[0]
    parts[-1] = parts[-1] + "L"
    return "|".join(parts)


def _unroll(text: str) -> str:
    text = text.replace(",", "").replace(" ", "")
    group = re.compile(r"\(([^()]*)\)\*(\d+)")
    while group.search(text):  # innermost groups first
        text = group.sub(lambda m: m.group(1) * int(m.group(2)), text)
    return re.sub(r"(.)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), text)


def chunks_from_layout(layout: str, pipeline_size: int, num_layers: int) -> tuple[int, ...]:
    """The transformer layers of each chunk (model order) of ``layout``; ``LayoutError``
    naming the flag when it is malformed or holds what our plans do not (empty chunks, an
    embedding or head without layers beside it, multi-token prediction)."""
    def fail(why: str) -> LayoutError:
        return LayoutError(f"{LAYOUT_FLAG}={layout!r}: {why}")

    stages = _unroll(layout).split("|")
    bad = sorted({ch for stage in stages for ch in stage} - set("ELtm"))
    if bad:
        raise fail(f"unknown character(s) {bad}; use E (embedding), t (transformer "
                   f"layer), L (loss), | between chunks, x*n and (...)*n to repeat")
    if len(stages) % pipeline_size:
        raise fail(f"{len(stages)} chunks do not split over --pipeline-model-parallel-size="
                   f"{pipeline_size}; give a multiple of it")
    flat = "".join(stages)
    if "m" in flat:
        raise fail("multi-token prediction layers (m) are not modelled here")
    if flat.count("E") != 1 or not stages[0].startswith("E"):
        raise fail("the embedding E must open the first chunk, once")
    if flat.count("L") != 1 or not stages[-1].endswith("L"):
        raise fail("the loss L must close the last chunk, once")
    counts = tuple(stage.count("t") for stage in stages)
    if sum(counts) != num_layers:
        raise fail(f"holds {sum(counts)} transformer layers (t) but --num-layers={num_layers}")
    empty = [i for i, n in enumerate(counts) if n == 0]
    if empty:
        raise fail(f"chunk {empty[0]} holds no transformer layer; every chunk (stage) here "
                   f"holds at least one, the embedding and head beside the first and last")
    return counts
