"""Megatron's ``--expert-model-parallel-size`` (issue 25 item 3): it builds the uniform plan
(every MoE layer's ``ep``, dense layers untouched), pins ep under ``--auto-parallel`` and
``megatron-auto plan``, is written back by the Megatron-flag export, and bad values stop with
one line naming the flag. End to end, ``pretrain_gpt.py --num-experts 4
--expert-model-parallel-size 2`` on 2 gloo ranks trains the losses of one process."""

from __future__ import annotations

import pytest

from harness import assert_one_error_line, metrics_losses, run_main

pytestmark = pytest.mark.multirank

MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "16", "--max-position-embeddings", "16", "--vocab-size", "256",
         "--hidden-dropout", "0", "--attention-dropout", "0", "--global-batch-size", "8",
         "--micro-batch-size", "2", "--num-experts", "4", "--moe-router-topk", "2",
         "--moe-ffn-hidden-size", "32", "--moe-layer-freq", "2", "--disable-bias-linear",
         "--lr", "1e-3", "--log-interval", "1", "--mock-data", "--train-iters", "3",
         "--seed", "7"]


def _flags_plan(ep: int, moe_layers=(0,), world: int = 4, **kw):
    from megatron_auto.planner.interop.megatron_flags import plan_from_megatron_flags

    return plan_from_megatron_flags(world_size=world, num_layers=4, global_batch_size=8,
                                    micro_batch_size=1, expert_model_parallel_size=ep,
                                    moe_layers=moe_layers, **kw)


def test_the_flag_sets_every_moe_layer_and_only_those():
    plan = _flags_plan(2, moe_layers=(0, 2))
    assert [layer.ep for layer in plan.layers] == [2, 1, 2, 1]
    assert [layer.ep for layer in _flags_plan(1, moe_layers=(0, 2)).layers] == [1, 1, 1, 1]
    # tp 2 leaves 2 data-parallel ranks: ep 2 still divides them
    assert [layer.ep for layer in _flags_plan(2, moe_layers=(1,),
                                              tensor_model_parallel_size=2).layers] == [1, 2, 1, 1]


@pytest.mark.parametrize("ep,kw,message", [
    (3, {}, "--expert-model-parallel-size=3: must be a power of two dividing the data-parallel "
            "size 4"),
    (4, {"tensor_model_parallel_size": 2}, "--expert-model-parallel-size=4: must be a power of "
                                           "two dividing the data-parallel size 2"),
    (0, {}, "--expert-model-parallel-size=0: must be a positive integer"),
])
def test_bad_values_name_the_flag(ep, kw, message):
    from megatron_auto.planner.interop.megatron_flags import MegatronFlagError

    with pytest.raises(MegatronFlagError) as err:
        _flags_plan(ep, **kw)
    assert str(err.value).startswith(message)
    with pytest.raises(MegatronFlagError, match="the model has no MoE layers"):
        _flags_plan(2, moe_layers=())


def test_the_export_writes_it_back():
    from megatron_auto.planner.interop.megatron_flags import to_megatron_flags

    plan = _flags_plan(2, moe_layers=(0, 1, 2, 3))
    flags, reasons = to_megatron_flags(plan)
    assert not reasons and flags is not None
    i = flags.index("--expert-model-parallel-size")
    assert flags[i + 1] == "2"


@pytest.mark.parametrize("flag,option", [("expert_model_parallel_size", "expert_parallel"),
                                         ("expert_tensor_parallel_size",
                                          "expert_tensor_parallel")])
def test_a_typed_value_pins_the_search(flag, option):
    import argparse

    from megatron_auto.planner.inputs.pins import search_options

    pins = argparse.Namespace(tensor_model_parallel_size=None, pipeline_model_parallel_size=None,
                              use_distributed_optimizer=False, sequence_parallel=False,
                              num_layers_per_virtual_pipeline_stage=None, **{flag: 2})
    assert getattr(search_options(pins, 4, 2), option) == 2
    setattr(pins, flag, None)
    assert getattr(search_options(pins, 4, 2), option) is None
    setattr(pins, flag, 3)
    name = "--" + flag.replace("_", "-")
    with pytest.raises(ValueError, match=f"{name}=3: must be a power of"):
        search_options(pins, 4, 2)

def test_pretrain_gpt_trains_ep2_like_one_process(tmp_path):
    losses = {}
    for world, extra in ((1, []), (2, ["--expert-model-parallel-size", "2"])):
        metrics = tmp_path / f"m{world}.jsonl"
        assert run_main("pretrain_gpt", world, [*MODEL, *extra, "--metrics-file",
                                                str(metrics)],
                        env={"MEGATRON_AUTO_CACHE": str(tmp_path / "cache")}) == [0] * world
        losses[world] = metrics_losses(metrics)
    assert sorted(losses[2]) == [1, 2, 3]
    for it, loss in losses[1].items():
        assert losses[2][it] == pytest.approx(loss, rel=1e-5)


def test_a_dense_model_refuses_the_flag(capfd):
    dense = [a for a in MODEL]
    i = dense.index("--num-experts")
    del dense[i:i + 8]  # --num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 32 ...freq 2
    assert_one_error_line("pretrain_gpt", [*dense, "--expert-model-parallel-size", "2"],
                          "error: --expert-model-parallel-size=2: the model has no MoE layers",
                          capfd)


def test_next_to_a_plan_file_the_flag_is_refused(tmp_path, capfd):
    from megatron_auto.planner.interop.megatron_flags import plan_from_megatron_flags

    plan = plan_from_megatron_flags(world_size=1, num_layers=2, global_batch_size=8,
                                    micro_batch_size=2)
    path = tmp_path / "plan.json"
    plan.save(path)
    assert_one_error_line("pretrain_gpt", [*MODEL, "--plan", str(path),
                                           "--expert-model-parallel-size", "2"],
                          "error: --expert-model-parallel-size=2: conflicts with --plan", capfd)
