"""Megatron-Core ``torch_dist`` checkpoints of a mixture-of-experts GPT, in and out, against
megatron-core's own code (the dense case and what is patched for a CPU build:
tests/test_mcore_checkpoint.py).

A Megatron-Core ``GPTModel`` with every MLP an MoE (local layer spec, ``SequentialMLP``: 4
SwiGLU experts of width 24, top-2 softmax routing, the ``allgather`` token dispatcher; 4 heads
over 2 key/value groups, RMSNorm, untied head, no biases; every parameter drawn at random) is
saved by ``dist_checkpointing.save`` from 2 gloo ranks with expert parallelism 2 (each rank
holds 2 experts). Megatron-Core loads it into one process and computes its own logits; the tool
imports it (``--loader mcore`` with ``--num-experts 4 --moe-router-topk 2
--moe-ffn-hidden-size 24``) and our MoE model gives the same logits (fp32, relative max
difference <= 1e-5). Exported back (``--saver mcore``), megatron-core loads it strictly into a
fresh EP-2 model on 2 ranks: every rank's experts and the rest bit-identical to what it saved.

Beyond the dense test's CPU patches: megatron-core 0.16.1's router calls ``te_general_gemm``,
a name it leaves undefined when Transformer Engine is not installed (set to ``None`` here, which
selects its own ``torch.mm`` path), and its ``alltoall`` dispatcher creates a CUDA stream when
built (the ``allgather`` dispatcher is used: the same routing and experts).
"""

from __future__ import annotations

import os

import torch

from dist_utils import run_distributed
from test_mcore_checkpoint import (FLAGS, HEADS, GROUPS, HIDDEN, LAYERS, REL, SEQ, VOCAB,
                                   _cpu_save_patches, _local_state, convert_main, load_into,
                                   rel)
from test_mcore_checkpoint import pytestmark  # noqa: F401 - its marks and skips, here too

EXPERTS, TOPK, EXPERT_FFN = 4, 2, 24
MOE_FLAGS = FLAGS + ["--num-experts", str(EXPERTS), "--moe-router-topk", str(TOPK),
                     "--moe-ffn-hidden-size", str(EXPERT_FFN)]


def _moe_model(ep: int):
    import torch.nn.functional as F
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.transformer_config import TransformerConfig

    moe_utils.te_general_gemm = getattr(moe_utils, "te_general_gemm", None)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(expert_model_parallel_size=ep)
    config = TransformerConfig(
        num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
        num_query_groups=GROUPS, ffn_hidden_size=48, gated_linear_unit=True,
        activation_func=F.silu, normalization="RMSNorm", add_bias_linear=False,
        layernorm_epsilon=1e-5, use_cpu_initialization=True, params_dtype=torch.float32,
        num_moe_experts=EXPERTS, moe_router_topk=TOPK, moe_ffn_hidden_size=EXPERT_FFN,
        moe_token_dispatcher_type="allgather")
    spec = get_gpt_layer_local_spec(num_experts=EXPERTS, moe_grouped_gemm=False,
                                    normalization="RMSNorm")
    return GPTModel(config, spec, vocab_size=VOCAB, max_sequence_length=SEQ,
                    position_embedding_type="rope", share_embeddings_and_output_weights=False)


def _save(rank, world_size, save_dir):
    from megatron.core import dist_checkpointing

    _cpu_save_patches()
    model = _moe_model(world_size)
    with torch.no_grad():
        for i, (name, p) in enumerate(model.named_parameters()):
            # local experts differ per EP rank; everything else is replicated
            gen = torch.Generator().manual_seed(100 * i + (1 + rank if "experts" in name else 0))
            noise = torch.randn(p.shape, generator=gen) * 0.2
            p.copy_(1.0 + noise if "norm" in name else noise)
    path = os.path.join(save_dir, "iter_0000005")
    if rank == 0:
        os.makedirs(path)
    torch.distributed.barrier()
    dist_checkpointing.save({"model": model.sharded_state_dict(), "iteration": 5,
                             "checkpoint_version": 3.0}, path)
    if rank == 0:
        with open(os.path.join(save_dir, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write("5\n")
    return _local_state(model)


def _load(rank, world_size, path, ids):
    return load_into(_moe_model(world_size), path, ids, world_size)[1]


def test_megatron_core_moe_checkpoint_imports_with_the_same_logits_and_exports_back(tmp_path):
    from test_hf_convert import ours, read_config

    mcore_dir, ckpt, back = (str(tmp_path / n) for n in ("mcore", "ckpt", "back"))
    saved = run_distributed(_save, 2, mcore_dir)  # EP 2: each rank two experts
    ids = torch.randint(0, VOCAB, (3, SEQ), generator=torch.Generator().manual_seed(6))
    reference = run_distributed(_load, 1, os.path.join(mcore_dir, "iter_0000005"), ids)[0]

    main = convert_main()
    assert main(["--model-type", "GPT", "--loader", "mcore", "--saver", "megatron",
                 "--load-dir", mcore_dir, "--save-dir", ckpt, *MOE_FLAGS]) == 0
    config = read_config(ckpt)
    assert (config.moe.num_experts, config.moe.router_topk) == (EXPERTS, TOPK)
    logits = ours(ckpt, config, {"tokens": ids})["logits"][..., :VOCAB]
    assert rel(logits, reference["logits"]) <= REL

    assert main(["--model-type", "GPT", "--loader", "megatron", "--saver", "mcore",
                 "--load-dir", ckpt, "--save-dir", back]) == 0
    loaded = run_distributed(_load, 2, os.path.join(back, "iter_0000000"), ids)
    for rank in range(2):
        assert loaded[rank]["state"].keys() == saved[rank].keys()
        for name, value in saved[rank].items():
            torch.testing.assert_close(loaded[rank]["state"][name], value, rtol=0, atol=0,
                                       msg=f"rank {rank} {name}")
