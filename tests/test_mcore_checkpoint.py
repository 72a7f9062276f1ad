"""Megatron-Core ``torch_dist`` checkpoints in and out, against megatron-core's own code.

A LLaMA-shaped Megatron-Core ``GPTModel`` (local layer spec: 4 heads over 2 key/value groups,
SwiGLU, RMSNorm, untied head, no biases; every parameter drawn at random) is built on 2 forked
gloo ranks with tensor parallelism 2 and saved by ``megatron.core.dist_checkpointing.save`` in
Megatron-LM's layout (the model's sharded state under ``"model"``, the iteration beside it)
into a Megatron-LM save directory. Megatron-Core loads it into one process and computes its own
logits. The tool imports it (``--loader mcore``): our model loaded from the import gives the
same logits (fp32, relative max difference <= 1e-5), and so does transformers' LLaMA of the
import's HF export. Our checkpoint is then exported back (``--saver mcore``) and
``dist_checkpointing.load`` reads it into a fresh TP-2 model on 2 ranks (strict
``load_state_dict``): every rank's shard equals what megatron-core saved, bit for bit.

What needs CUDA in megatron-core 0.16.1 and is replaced here by its CPU equivalent, in the
forked ranks only. Save: ``FileSystemWriterAsync.preload_tensors`` calls
``torch.cuda.synchronize()`` (a no-op here: the tensors are on the CPU) and
``save_state_dict_async_finalize`` puts its failure flag on ``torch.cuda.current_device()``
(``"cpu"`` here); the writer's result queue, which a synchronous save fills and drains in
the saving process, is a plain queue instead of one served by a spawned manager process (our
tests never spawn). Forward: the rotary embedding and the attention's buffers ask for
``torch.cuda.current_device()`` (``"cpu"`` here), the default causal mask is built on
``"cuda"`` (we pass the causal mask instead) and the attention's dropout runs under the CUDA
RNG tracker's ``fork`` (a no-op context here; dropout is off in eval). Loading needs none of
these.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from dist_utils import run_distributed

pytestmark = [pytest.mark.multirank,
              pytest.mark.skipif(importlib.util.find_spec("megatron") is None
                                 or importlib.util.find_spec("megatron.core") is None,
                                 reason="megatron-core is not installed (the test extra has "
                                        "it)"),
              pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                 reason="transformers is not installed (the test extra has it)")]

CONVERT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                       "tools", "checkpoint", "convert.py")
LAYERS, HIDDEN, HEADS, GROUPS, FFN, VOCAB, SEQ = 2, 32, 4, 2, 48, 64, 16
FLAGS = ["--num-layers", str(LAYERS), "--hidden-size", str(HIDDEN), "--num-attention-heads",
         str(HEADS), "--group-query-attention", "--num-query-groups", str(GROUPS),
         "--ffn-hidden-size", str(FFN), "--swiglu", "--normalization", "RMSNorm",
         "--position-embedding-type", "rope", "--untie-embeddings-and-output-weights",
         "--disable-bias-linear", "--seq-length", str(SEQ), "--vocab-size", str(VOCAB),
         "--make-vocab-size-divisible-by", "64"]
REL = 1e-5


def _mcore_model(tp: int):
    """A Megatron-Core GPTModel on this rank (parallel state set up for ``tp``)."""
    import torch.nn.functional as F
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    config = TransformerConfig(
        num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
        num_query_groups=GROUPS, ffn_hidden_size=FFN, gated_linear_unit=True,
        activation_func=F.silu, normalization="RMSNorm", add_bias_linear=False,
        layernorm_epsilon=1e-5, use_cpu_initialization=True, params_dtype=torch.float32)
    return GPTModel(config, get_gpt_layer_local_spec(normalization="RMSNorm"),
                    vocab_size=VOCAB, max_sequence_length=SEQ,
                    position_embedding_type="rope", share_embeddings_and_output_weights=False)


def _cpu_save_patches() -> None:
    """megatron-core 0.16.1's torch_dist save on a CPU build (see the module docstring)."""
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"
    # a synchronous save fills and drains this queue in this process; megatron-core's
    # default is a manager process, spawned
    filesystem_async._results_queue = queue.Queue()


def _local_state(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()
            if isinstance(v, torch.Tensor)}


def _save(rank, world_size, save_dir, iteration):
    from megatron.core import dist_checkpointing

    _cpu_save_patches()
    model = _mcore_model(world_size)
    with torch.no_grad():
        for i, (name, p) in enumerate(model.named_parameters()):
            # a TP shard draws per rank; a replicated tensor (the norms) the same on every rank,
            # as training keeps it
            split = getattr(p, "tensor_model_parallel", False)
            gen = torch.Generator().manual_seed(100 * i + (1 + rank if split else 0))
            noise = torch.randn(p.shape, generator=gen) * 0.2
            p.copy_(1.0 + noise if "norm" in name else noise)
    path = os.path.join(save_dir, f"iter_{iteration:07d}")
    if rank == 0:
        os.makedirs(path)
    torch.distributed.barrier()
    # Megatron-LM's layout: the model under "model", the iteration and version beside it
    dist_checkpointing.save({"model": model.sharded_state_dict(), "iteration": iteration,
                             "checkpoint_version": 3.0}, path)
    if rank == 0:
        with open(os.path.join(save_dir, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(f"{iteration}\n")
    return _local_state(model)


def _cpu_forward_patches() -> None:
    """megatron-core 0.16.1's GPTModel forward on a CPU build (see the module docstring)."""
    import contextlib

    from megatron.core.tensor_parallel import random as mcore_random

    torch.cuda.current_device = lambda: "cpu"
    # the attention's dropout runs under the CUDA RNG tracker's fork; dropout is off (eval)
    mcore_random.CudaRNGStatesTracker.fork = lambda self, name=None: contextlib.nullcontext()


def _load(rank, world_size, path, ids):
    """Load ``path`` into a fresh model (megatron-core's load); the local shards, and on one
    rank Megatron-Core's own logits (b, s, vocab) of ``ids``."""
    loaded, out = load_into(_mcore_model(world_size), path, ids, world_size)
    out.update(iteration=loaded["iteration"], checkpoint_version=loaded["checkpoint_version"])
    return out


def load_into(model, path, ids, world_size):
    """megatron-core's load of ``path`` into ``model`` (strict: every key of the model, no
    other): what it loaded, and ``{"state": local shards}`` with, on one rank, ``"logits"``
    of ``ids`` by Megatron-Core's own forward."""
    from megatron.core import dist_checkpointing

    loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, path)
    model.load_state_dict(loaded["model"])
    out = {"state": _local_state(model)}
    if world_size == 1:
        _cpu_forward_patches()
        positions = torch.arange(ids.shape[1]).expand(ids.shape[0], -1)
        causal = torch.ones(1, 1, ids.shape[1], ids.shape[1], dtype=torch.bool).triu(1)
        with torch.no_grad():
            out["logits"] = model.eval()(ids, positions, causal)
    return loaded, out


def convert_main():
    spec = importlib.util.spec_from_file_location("convert_tool", CONVERT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def test_megatron_core_checkpoint_imports_means_the_same_model_and_exports_back(tmp_path,
                                                                                capsys):
    from transformers import LlamaForCausalLM

    from test_hf_convert import ours, read_config

    mcore_dir, ckpt, hf_dir, back_dir = (str(tmp_path / n) for n in
                                         ("mcore", "ckpt", "hf", "mcore_back"))
    saved = run_distributed(_save, 2, mcore_dir, 7)  # TP 2: each rank its shards
    ids = torch.randint(0, VOCAB, (3, SEQ), generator=torch.Generator().manual_seed(5))
    reference = run_distributed(_load, 1, os.path.join(mcore_dir, "iter_0000007"), ids)[0]

    main = convert_main()
    assert main(["--model-type", "GPT", "--loader", "mcore", "--saver", "megatron",
                 "--load-dir", mcore_dir, "--save-dir", ckpt, *FLAGS]) == 0
    assert "> train it with: pretrain_gpt.py --load" in capsys.readouterr().out
    # our model from the import computes Megatron-Core's own logits
    logits = ours(ckpt, read_config(ckpt), {"tokens": ids})["logits"][..., :VOCAB]
    assert rel(logits, reference["logits"]) <= REL
    assert main(["--model-type", "GPT", "--loader", "megatron", "--saver", "hf",
                 "--load-dir", ckpt, "--save-dir", hf_dir]) == 0
    hf = LlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():  # and so does transformers' LLaMA of its HF export
        assert rel(hf(input_ids=ids).logits, reference["logits"]) <= REL

    assert main(["--model-type", "GPT", "--loader", "megatron", "--saver", "mcore",
                 "--load-dir", ckpt, "--save-dir", back_dir]) == 0
    assert open(os.path.join(back_dir, "latest_checkpointed_iteration.txt")).read() == "0\n"
    loaded = run_distributed(_load, 2, os.path.join(back_dir, "iter_0000000"), ids)
    for rank in range(2):
        assert (loaded[rank]["iteration"], loaded[rank]["checkpoint_version"]) == (0, 3.0)
        assert loaded[rank]["state"].keys() == saved[rank].keys()
        for name, value in saved[rank].items():
            torch.testing.assert_close(loaded[rank]["state"][name], value, rtol=0, atol=0,
                                       msg=f"rank {rank} {name}")


def test_megatron_core_flags_that_disagree_name_the_tensor(tmp_path, capsys):
    mcore_dir = str(tmp_path / "mcore")
    run_distributed(_save, 2, mcore_dir, 3)
    main = convert_main()
    flags = [f if f != str(FFN) else "64" for f in FLAGS]
    assert main(["--model-type", "GPT", "--loader", "mcore", "--saver", "megatron",
                 "--load-dir", mcore_dir, "--save-dir", str(tmp_path / "c"), *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("error: --load-dir: decoder.layers.mlp.linear_fc1.weight has shape (2, 96, "
                   "32) in the checkpoint, --ffn-hidden-size/--swiglu give (2, 128, 32); set "
                   "them to the checkpoint's model"), err
    no_bias = [f for f in FLAGS if f != "--disable-bias-linear"]
    assert main(["--model-type", "GPT", "--loader", "mcore", "--saver", "megatron",
                 "--load-dir", mcore_dir, "--save-dir", str(tmp_path / "c"), *no_bias]) == 2
    assert "has no tensor decoder.layers.self_attention.linear_qkv.bias, which " \
           "--disable-bias-linear/--add-qkv-bias imply" in capsys.readouterr().err
    assert main(["--model-type", "GPT", "--loader", "mcore", "--saver", "megatron",
                 "--load-dir", str(tmp_path), "--save-dir", str(tmp_path / "c"), *FLAGS]) == 2
    assert "no latest_checkpointed_iteration.txt and no metadata.json" in capsys.readouterr().err
