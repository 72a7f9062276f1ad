"""The TP collectives a transformer layer issues, with and without sequence parallelism, are the
ones ``layout.layer_tp_collectives`` lists (the description the cost model is to price SP
with), kind, group size, bytes and count, in forward and in backward, with recompute too."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from dist_utils import run_distributed
from megatron_auto.layout import (layer_tp_collectives, make_layout,
                                  sequence_parallel_boundary_collectives)
from test_collective_count import recording
from harness import layer, plan_of
from test_equivalence import CONFIG

pytestmark = pytest.mark.multirank

B, S, H = 2, 16, 32


def _worker(rank, world_size, tp, sp, recompute, consecutive):
    from megatron_auto.models.transformer import TransformerLayer
    from megatron_auto.parallel.context import ParallelContext
    from megatron_auto.parallel.mappings import gather_from_sequence, scatter_to_sequence
    from megatron_auto.plan import Plan

    plan = Plan.from_dict(plan_of(world_size, [layer(tp=tp, sp=sp, consecutive=consecutive)] * 4,
                                  vocab_tp=tp))
    ctx = ParallelContext(plan)
    groups = ctx.layer_groups(0)
    module = TransformerLayer(CONFIG, groups, sequence_parallel=sp, recompute=recompute)
    for p in module.parameters():
        torch.nn.init.normal_(p, std=0.02)
    x = torch.randn(B, S, H, requires_grad=True)
    with recording() as boundary_in:
        h = scatter_to_sequence(x, groups.tp_group) if sp else x
    with recording() as fwd:
        y = module(h)
    with recording() as boundary_out:
        out = gather_from_sequence(y, groups.tp_group, reduce_grad=False) if sp else y
    with recording() as bwd:
        out.sum().backward()
    keep = lambda calls: [(k, len(r), n) for k, r, n, _ in calls]  # noqa: E731
    return {"fwd": keep(fwd), "bwd": keep(bwd), "enter": keep(boundary_in),
            "leave": keep(boundary_out)}


def _as_counter(collectives):
    return Counter((c.kind, c.group_size, int(c.nbytes)) for c in collectives)


@pytest.mark.parametrize("world_size,tp,sp,recompute,consecutive", [
    (2, 2, False, False, True), (2, 2, True, False, True), (2, 2, True, True, True),
    (4, 2, True, False, False), (4, 4, True, True, True), (4, 4, False, True, True)])
def test_layer_issues_the_described_tp_collectives(world_size, tp, sp, recompute, consecutive):
    out = run_distributed(_worker, world_size, tp, sp, recompute, consecutive)[0]
    layout = make_layout(tp, consecutive, world_size)
    act = B * S * H * 4  # this rank's whole-sequence activation in fp32 (the layer alone)
    norm = [H * 4] * 4  # two LayerNorms: weight and bias each
    bias = [H * 4] * 2  # linear_proj and linear_fc2 biases
    forward, backward = layer_tp_collectives(layout, world_size, act, sequence_parallel=sp,
                                             norm_tensor_bytes=norm, row_bias_bytes=bias,
                                             recompute=recompute)
    # the layer's own collectives; the boundary's are separate (below). Backward also runs the
    # boundary's backward, recorded with the layer's.
    enter_f, enter_b = sequence_parallel_boundary_collectives(layout, act, entering=True) \
        if sp else ((), ())
    leave_f, leave_b = sequence_parallel_boundary_collectives(layout, act, entering=False) \
        if sp else ((), ())
    assert Counter(out["fwd"]) == _as_counter(forward)
    assert Counter(out["bwd"]) == _as_counter(backward + enter_b + leave_b)
    assert Counter(out["enter"]) == _as_counter(enter_f)
    assert Counter(out["leave"]) == _as_counter(leave_f)
