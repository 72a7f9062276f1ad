"""Classic Megatron flags -> Plan -> flags, and the reasons a plan has no classic equivalent."""

from dataclasses import replace

import pytest

from megatron_auto.plan import LayerStrategy, PipelineSpec, Plan, VocabStrategy
from megatron_auto.planner.interop.megatron_flags import (MegatronFlagError,
                                                          plan_from_megatron_flags,
                                                          to_megatron_flags)

pytestmark = pytest.mark.pure


def flags_to_kwargs(flags):
    """Parse the flag list back into plan_from_megatron_flags keywords (a tiny reference parser)."""
    out = {}
    i = 0
    while i < len(flags):
        key = flags[i][2:].replace("-", "_")
        if key in ("use_distributed_optimizer", "sequence_parallel"):
            out[key] = True
            i += 1
            continue
        value = flags[i + 1]
        out[key] = int(value) if value.isdigit() else value
        i += 2
    out["tensor_model_parallel_size"] = out.pop("tensor_model_parallel_size")
    return out


@pytest.mark.parametrize("kwargs", [
    dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, micro_batch_size=2),
    dict(tensor_model_parallel_size=1, pipeline_model_parallel_size=1, micro_batch_size=4,
         use_distributed_optimizer=True),
    dict(tensor_model_parallel_size=4, pipeline_model_parallel_size=2, micro_batch_size=1,
         recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, micro_batch_size=2,
         sequence_parallel=True, num_layers_per_virtual_pipeline_stage=2,
         use_distributed_optimizer=True, recompute_granularity="full", recompute_method="block",
         recompute_num_layers=1),
    dict(tensor_model_parallel_size=1, pipeline_model_parallel_size=4, micro_batch_size=1,
         recompute_granularity="full", recompute_method="block", recompute_num_layers=1,
         decoder_first_pipeline_num_layers=5),
])
def test_flags_plan_flags_round_trip(kwargs):
    plan = plan_from_megatron_flags(world_size=8, num_layers=8, global_batch_size=32, **kwargs)
    flags, reasons = to_megatron_flags(plan)
    assert reasons == []
    again = plan_from_megatron_flags(world_size=8, num_layers=8, **flags_to_kwargs(flags))
    assert again == plan


def test_flag_semantics_by_hand():
    # 8 ranks, tp 2, pp 2 -> dp 2; 32 samples / (micro 2 * dp 2) = 8 micro-batches.
    plan = plan_from_megatron_flags(world_size=8, num_layers=6, global_batch_size=32,
                                    micro_batch_size=2, tensor_model_parallel_size=2,
                                    pipeline_model_parallel_size=2, use_distributed_optimizer=True,
                                    recompute_granularity="full", recompute_method="block",
                                    recompute_num_layers=2)
    assert plan.num_microbatches == 8
    assert plan.pipeline.layers_per_stage == (3, 3)
    assert [layer.recompute for layer in plan.layers] == [True, True, False, True, True, False]
    # --use-distributed-optimizer is Megatron's distributed optimizer: zero1 (it was zero2
    # before zero1 existed; changed on purpose, issue 13)
    assert {layer.dp_mode for layer in plan.layers} == {"zero1"}
    assert plan.vocab == VocabStrategy(tp=2, dp_mode="zero1")
    assert all(layer.tp == 2 and layer.tp_consecutive for layer in plan.layers)
    # Megatron's pinned first/last stage with an even middle.
    uneven = plan_from_megatron_flags(world_size=4, num_layers=10, global_batch_size=4,
                                      micro_batch_size=1, pipeline_model_parallel_size=4,
                                      decoder_first_pipeline_num_layers=2,
                                      decoder_last_pipeline_num_layers=2)
    assert uneven.pipeline.layers_per_stage == (2, 3, 3, 2)
    selective = plan_from_megatron_flags(world_size=1, num_layers=2, global_batch_size=2,
                                         micro_batch_size=1, recompute_granularity="selective")
    assert not any(layer.recompute for layer in selective.layers)
    assert "selective" in selective.search["notes"][0]


@pytest.mark.parametrize("kwargs, message", [
    (dict(tensor_model_parallel_size=3), "--tensor-model-parallel-size=3 x "
                                         "--pipeline-model-parallel-size=1 = 3 must divide"),
    (dict(global_batch_size=6), "--global-batch-size=6: must be a multiple of --micro-batch-size=1"),
    (dict(pipeline_model_parallel_size=4, num_layers=6), "--num-layers=6: Megatron needs it "
                                                         "divisible by --pipeline-model-parallel-size=4"),
    (dict(recompute_granularity="half"), "--recompute-granularity='half'"),
    (dict(recompute_granularity="full", recompute_method="block"), "--recompute-num-layers=None"),
    (dict(micro_batch_size=0), "--micro-batch-size=0: must be a positive integer"),
])
def test_bad_flags_name_the_flag(kwargs, message):
    base = dict(world_size=8, num_layers=8, global_batch_size=16, micro_batch_size=1)
    base.update(kwargs)
    with pytest.raises(MegatronFlagError) as err:
        plan_from_megatron_flags(**base)
    assert message in str(err.value)


def _plan(layers, pp=1, sizes=None, schedule="1f1b", vocab=None):
    return Plan(world_size=8, global_batch_size=16, num_microbatches=2,
                pipeline=PipelineSpec(size=pp, schedule=schedule,
                                      layers_per_stage=tuple(sizes or (len(layers),))),
                vocab=vocab or VocabStrategy(tp=layers[0].tp, dp_mode=layers[0].dp_mode),
                layers=tuple(layers))


def test_non_expressible_plans_list_every_reason():
    mixed = [LayerStrategy(tp=2), LayerStrategy(tp=4, dp_mode="zero3"),
             LayerStrategy(tp=2, tp_consecutive=False), LayerStrategy(tp=2)]
    flags, reasons = to_megatron_flags(_plan(mixed))
    assert flags is None
    text = "\n".join(reasons)
    assert "per-layer tensor-parallel degrees differ ([2, 4])" in text
    assert "zero3" in text
    assert "layers 2 use strided TP groups" in text
    gpipe = _plan([LayerStrategy()] * 4, schedule="gpipe")
    assert "1F1B only" in "\n".join(to_megatron_flags(gpipe)[1])
    uneven = _plan([LayerStrategy()] * 7, pp=4, sizes=(1, 2, 3, 1))
    assert "layers_per_stage=[1, 2, 3, 1]" in "\n".join(to_megatron_flags(uneven)[1])
    vocab = _plan([LayerStrategy(tp=2)] * 2, vocab=VocabStrategy(tp=4))
    assert "vocab.tp=4 differs" in "\n".join(to_megatron_flags(vocab)[1])
    odd_recompute = _plan([replace(LayerStrategy(), recompute=r) for r in (False, True, False, True)])
    assert "recompute on layers 1, 3" in "\n".join(to_megatron_flags(odd_recompute)[1])


def test_two_stage_uneven_split_is_expressible():
    plan = _plan([LayerStrategy()] * 5, pp=2, sizes=(3, 2))
    flags, reasons = to_megatron_flags(plan)
    assert reasons == []
    assert flags[flags.index("--decoder-first-pipeline-num-layers") + 1] == "3"
    assert flags[flags.index("--decoder-last-pipeline-num-layers") + 1] == "2"
    # dp = 4 ranks per stage / tp 1 = 4; micro-batch 16/2 = 8 samples -> 2 per replica.
    assert flags[flags.index("--micro-batch-size") + 1] == "2"


def test_sequence_parallel_and_virtual_pipeline_flags():
    plan = plan_from_megatron_flags(world_size=4, num_layers=8, global_batch_size=8,
                                    micro_batch_size=2, tensor_model_parallel_size=2,
                                    pipeline_model_parallel_size=2, sequence_parallel=True,
                                    num_layers_per_virtual_pipeline_stage=2)
    assert all(layer.sequence_parallel for layer in plan.layers)
    assert plan.pipeline.virtual_size == 2 and plan.pipeline.layers_per_stage == (2, 2, 2, 2)
    # Megatron turns SP off at tp 1; so do we, with a note
    off = plan_from_megatron_flags(world_size=2, num_layers=4, global_batch_size=4,
                                   micro_batch_size=2, sequence_parallel=True)
    assert not any(layer.sequence_parallel for layer in off.layers)
    assert any("--sequence-parallel is ignored" in n for n in off.search["notes"])
    with pytest.raises(MegatronFlagError, match=r"--num-layers-per-virtual-pipeline-stage=3: "
                                                r"--num-layers=8 must be a multiple of"):
        plan_from_megatron_flags(world_size=2, num_layers=8, global_batch_size=4,
                                 micro_batch_size=2, pipeline_model_parallel_size=2,
                                 num_layers_per_virtual_pipeline_stage=3)


def test_plans_without_classic_equivalent_name_the_new_reasons():
    base = plan_from_megatron_flags(world_size=4, num_layers=4, global_batch_size=8,
                                    micro_batch_size=2, tensor_model_parallel_size=2)
    some_sp = replace(base, layers=(replace(base.layers[0], sequence_parallel=True),)
                      + base.layers[1:])
    flags, reasons = to_megatron_flags(some_sp)
    assert flags is None and any("sequence_parallel on layers 0 only" in r for r in reasons)
    zero2 = replace(base, layers=tuple(replace(l, dp_mode="zero2") for l in base.layers),
                    vocab=replace(base.vocab, dp_mode="zero2"))
    flags, reasons = to_megatron_flags(zero2)
    assert flags is None and any("zero2 (sharded gradients) has no classic" in r for r in reasons)
