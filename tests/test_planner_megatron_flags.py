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
        if key in ("use_distributed_optimizer", "sequence_parallel", "use_megatron_fsdp",
                   "no_gradient_accumulation_fusion"):
            if key != "no_gradient_accumulation_fusion":  # a kernel switch, not the layout
                out[key] = True
            i += 1
            continue
        if key == "ckpt_format":  # Megatron-FSDP's checkpoint format, not the layout
            i += 2
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
    # any partition: the layout string, with and without interleaving
    dict(tensor_model_parallel_size=1, pipeline_model_parallel_size=4, micro_batch_size=1,
         pipeline_model_parallel_layout="Et|t*2|t*4|tL"),
    dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, micro_batch_size=1,
         pipeline_model_parallel_layout="Et*3|t|t*2|t*2L", recompute_granularity="full",
         recompute_method="block", recompute_num_layers=1),
    # Megatron-FSDP: zero2 and zero3 on every layer
    dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=1, micro_batch_size=2,
         use_megatron_fsdp=True, data_parallel_sharding_strategy="optim_grads"),
    dict(tensor_model_parallel_size=1, pipeline_model_parallel_size=2, micro_batch_size=1,
         use_megatron_fsdp=True, data_parallel_sharding_strategy="optim_grads_params",
         use_distributed_optimizer=True),
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
    # selective recomputes core attention on every layer (was silently none; issue 27)
    assert [layer.recompute for layer in selective.layers] == ["selective", "selective"]


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
    half = replace(base, layers=tuple(replace(l, dp_mode="zero2") for l in base.layers[:2])
                   + base.layers[2:])
    flags, reasons = to_megatron_flags(half)
    assert flags is None and any("per-layer data-parallel flavours differ (['ddp', 'zero2'])"
                                 in r for r in reasons)
    vocab = replace(base, layers=tuple(replace(l, dp_mode="zero3") for l in base.layers))
    assert any("vocab.dp_mode=ddp differs from the layers' zero3" in r
               for r in to_megatron_flags(vocab)[1])


def test_any_partition_is_a_layout_string():
    uneven = _plan([LayerStrategy()] * 7, pp=4, sizes=(1, 2, 3, 1))
    flags, reasons = to_megatron_flags(uneven)
    assert reasons == []
    assert flags[flags.index("--pipeline-model-parallel-layout") + 1] == "Et|t*2|t*3|tL"
    # Megatron's first/last pins where they say it (older Megatron-LM reads them too)
    pinned = _plan([LayerStrategy()] * 8, pp=4, sizes=(1, 3, 3, 1))
    flags, _ = to_megatron_flags(pinned)
    assert "--pipeline-model-parallel-layout" not in flags
    assert flags[flags.index("--decoder-first-pipeline-num-layers") + 1] == "1"
    # interleaved chunks of different sizes: chunk c on rank c mod pp
    inter = Plan(world_size=8, global_batch_size=16, num_microbatches=4,
                 pipeline=PipelineSpec(size=2, layers_per_stage=(3, 1, 2, 2), virtual_size=2),
                 vocab=VocabStrategy(), layers=(LayerStrategy(),) * 8)
    flags, reasons = to_megatron_flags(inter)
    assert reasons == [] and flags[flags.index("--pipeline-model-parallel-layout") + 1] == \
        "Et*3|t|t*2|t*2L"
    assert "--num-layers-per-virtual-pipeline-stage" not in flags


def test_megatron_fsdp_flags():
    base = plan_from_megatron_flags(world_size=4, num_layers=4, global_batch_size=8,
                                    micro_batch_size=2, tensor_model_parallel_size=2)
    for mode, strategy in (("zero2", "optim_grads"), ("zero3", "optim_grads_params")):
        plan = replace(base, layers=tuple(replace(l, dp_mode=mode) for l in base.layers),
                       vocab=replace(base.vocab, dp_mode=mode))
        flags, reasons = to_megatron_flags(plan)
        assert reasons == []
        assert flags[flags.index("--data-parallel-sharding-strategy") + 1] == strategy
        assert {"--use-megatron-fsdp", "--use-distributed-optimizer"} <= set(flags)
    with pytest.raises(MegatronFlagError, match="--data-parallel-sharding-strategy=optim_grads: "
                                                "shards only with --use-megatron-fsdp"):
        plan_from_megatron_flags(world_size=2, num_layers=2, global_batch_size=2,
                                 micro_batch_size=1, data_parallel_sharding_strategy="optim_grads")


@pytest.mark.parametrize("layout, message", [
    ("Et|tx|tL", "unknown character(s) ['x']"),
    ("tE|t*2tL", "the embedding E must open the first chunk"),
    ("Et|t*3", "the loss L must close the last chunk"),
    ("Et*2||t|tL", "chunk 1 holds no transformer layer"),
    ("Et*2|t*3L", "holds 5 transformer layers (t) but --num-layers=4"),
    ("Et|t|tL", "3 chunks do not split over --pipeline-model-parallel-size=2"),
    ("Et*2|tmL", "multi-token prediction layers (m) are not modelled"),
    ("E|t*4L", "chunk 0 holds no transformer layer"),
])
def test_bad_layouts_name_the_flag(layout, message):
    with pytest.raises(MegatronFlagError) as err:
        plan_from_megatron_flags(world_size=2, num_layers=4, global_batch_size=2,
                                 micro_batch_size=1, pipeline_model_parallel_size=2,
                                 pipeline_model_parallel_layout=layout)
    assert f"--pipeline-model-parallel-layout={layout!r}: {message}" in str(err.value)
    with pytest.raises(MegatronFlagError, match="sets the whole partition; drop "
                                                "--decoder-first-pipeline-num-layers"):
        plan_from_megatron_flags(world_size=2, num_layers=4, global_batch_size=2,
                                 micro_batch_size=1, pipeline_model_parallel_size=2,
                                 pipeline_model_parallel_layout="Et|t*3L",
                                 decoder_first_pipeline_num_layers=1)


@pytest.mark.parametrize("sizes, pp", [((1, 2, 3, 1), 4), ((3, 1, 2, 2), 2), ((2, 1, 1, 3, 1, 2), 3),
                                       ((5,), 1)])
def test_megatron_core_reads_our_layout_strings(sizes, pp):
    """Megatron-Core's own parser (when installed) puts every chunk on the rank and virtual
    stage our plan runs it on, with the same layers."""
    pytest.importorskip("megatron.core", reason="megatron-core checks its own parser (the "
                        "test extra installs it)")
    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.pipeline_parallel_layer_layout import \
        PipelineParallelLayerLayout
    from megatron_auto.planner.interop.megatron_layout import layout_string

    theirs = PipelineParallelLayerLayout(layout_string(sizes), pp)
    theirs.validate_layer_layout(num_layers=sum(sizes), mtp_num_layers=None)
    v = len(sizes) // pp
    assert theirs.virtual_pipeline_model_parallel_size == v
    for c, n in enumerate(sizes):  # our chunk c: pipeline rank c % pp, virtual stage c // pp
        assert theirs.layout[c % pp][c // pp].count(LayerType.decoder) == n
    assert theirs.layout[0][0][0] == LayerType.embedding
    assert theirs.layout[(len(sizes) - 1) % pp][v - 1][-1] == LayerType.loss


def test_the_layout_and_fsdp_flags_reach_the_plan_and_back(capsys):
    """The classic flags of megatron-auto (and the pretrain scripts) take the layout string and
    Megatron-FSDP; explain prints them back as the equivalent flags."""
    from megatron_auto.cli import main

    code = main(["explain", "--num-layers", "8", "--hidden-size", "64", "--num-attention-heads",
                 "4", "--seq-length", "32", "--vocab-size", "512", "--cluster", "a100-40g-1x8",
                 "--pipeline-model-parallel-size", "4", "--pipeline-model-parallel-layout",
                 "Et|t*2|t*3|t*2L", "--use-megatron-fsdp", "--data-parallel-sharding-strategy",
                 "optim_grads_params", "--global-batch-size", "8"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "layers 1+2+3+2" in out and "zero3" in out
    assert "--pipeline-model-parallel-layout Et|t*2|t*3|t*2L --use-megatron-fsdp " \
           "--data-parallel-sharding-strategy optim_grads_params" in out
