"""Megatron-Core ``torch_dist`` checkpoints of a GPT / LLaMA model, in and out.

A Megatron-LM ``--save`` directory in the ``torch_dist`` format holds
``latest_checkpointed_iteration.txt`` and ``iter_NNNNNNN/`` with ``metadata.json``
(``"sharded_backend": "torch_dist"``), ``common.pt`` (the non-sharded state) and
torch.distributed.checkpoint (DCP) files. Its model tensors are global tensors under
Megatron-Core's sharded keys, whatever TP / PP wrote them; a transformer layer's tensors are
stacked over the layers into one key with a leading layer axis:

====================================================  ==========================================
Megatron-Core sharded key                              ours (``layers.i.`` for row ``i``)
====================================================  ==========================================
``embedding.word_embeddings.weight``                   ``embedding.word_embeddings.weight``
``embedding.position_embeddings.weight``               the same (learned positions only)
``decoder.layers.self_attention.linear_qkv.``          ``input_layernorm.weight`` / ``.bias``
``layer_norm_weight`` / ``layer_norm_bias``
``decoder.layers.self_attention.linear_qkv.weight``    ``self_attention.linear_qkv.weight`` (the
(``.bias``)                                            same per-group q..q k v rows)
``decoder.layers.self_attention.linear_proj.*``        ``self_attention.linear_proj.*``
``decoder.layers.mlp.linear_fc1.layer_norm_*``         ``pre_mlp_layernorm.*``
``decoder.layers.mlp.linear_fc1.*``                    ``mlp.linear_fc1.*``: SwiGLU rows are all
                                                       gates then all ups there, interleaved here
``decoder.layers.mlp.linear_fc2.*``                    ``mlp.linear_fc2.*``
``decoder.layers.mlp.router.weight`` (MoE)             ``mlp.router.weight`` (E, h)
``decoder.layers.mlp.experts.experts.linear_fc1.``     ``mlp.experts.linear_fc1.weight``: stacked
``weight`` (MoE: layers, E, 2f, h)                     over the experts too; gates | ups there
``decoder.layers.mlp.experts.experts.linear_fc2.``     ``mlp.experts.linear_fc2.weight``
``weight`` (MoE: layers, E, h, f)
``decoder.final_layernorm.*``                          ``final_norm.*``
``output_layer.weight``                                ``output_layer.weight`` (untied only)
====================================================  ==========================================

Both of Megatron-Core's layer specs (Transformer Engine's fused norms and the local one) save
these keys for a dense model; an MoE model converts when every layer is MoE, without shared
experts, as the local spec (its ``SequentialMLP``) saves it (Transformer Engine's MoE spec keeps
the pre-MLP norm under ``decoder.layers.pre_mlp_layernorm.*``, which is not mapped: the import
names it as a tensor the model lacks). DCP reads and writes them here in one process (its single-process mode), so no
Megatron-Core import is needed; ``_extra_state`` objects (Transformer Engine's FP8 metadata)
are not read, and the export writes each as ``[None]`` (a ShardedObject's stored form: the
list of its copies), what the local spec saves. The model
shape comes from our model flags (``pretrain_gpt.py``'s), checked against every tensor's
shape: a disagreement names the tensor and the flags that set its shape.
"""

from __future__ import annotations

import argparse
import json
import os
import warnings
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ..arguments import add_model_args, model_config_from_args
from ..config import ModelConfig
from ..training.checkpoint import read_info
from ..utils.output_paths import check_output_dir, refuse_non_empty_dir
from .checkpoint_files import (check_new_checkpoint_dir, read_model_checkpoint,
                               write_weights_checkpoint)
from .hf_mapping import ConversionError, merge_gate_up, split_gate_up

LATEST = "latest_checkpointed_iteration.txt"
METADATA = "metadata.json"
BACKEND = {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
           "common_backend": "torch", "common_backend_version": 1}
#: Keys of the stacked transformer layers (the decoder's only; no MoE, no cross-attention)
LAYER_PREFIX = "decoder.layers."
_EXTRA = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1",
          "mlp.linear_fc2")
#: An MoE layer's router and experts (Megatron-Core stacks the experts too: (layers, E, ...))
ROUTER = LAYER_PREFIX + "mlp.router.weight"
EXPERTS = LAYER_PREFIX + "mlp.experts.experts."


def _shape_flags(cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], str]]:
    """Megatron-Core key -> (its global shape for ``cfg``, the flags that set it)."""
    h, f, n = cfg.hidden_size, cfg.ffn_hidden_size, cfg.num_layers
    qkv = cfg.hidden_size + 2 * cfg.kv_size
    fc1 = 2 * f if cfg.activation == "swiglu" else f
    heads = "--num-attention-heads/--num-query-groups/--hidden-size"
    out = {"embedding.word_embeddings.weight": ((None, h), "--hidden-size"),
           "decoder.final_layernorm.weight": ((h,), "--hidden-size"),
           LAYER_PREFIX + "self_attention.linear_qkv.layer_norm_weight": ((n, h), "--num-layers"),
           LAYER_PREFIX + "self_attention.linear_qkv.weight": ((n, qkv, h), heads),
           LAYER_PREFIX + "self_attention.linear_proj.weight": ((n, h, h), "--hidden-size"),
           LAYER_PREFIX + "mlp.linear_fc1.layer_norm_weight": ((n, h), "--num-layers"),
           LAYER_PREFIX + "mlp.linear_fc1.weight": ((n, fc1, h), "--ffn-hidden-size/--swiglu"),
           LAYER_PREFIX + "mlp.linear_fc2.weight": ((n, h, f), "--ffn-hidden-size")}
    if cfg.position_embedding_type == "learned":
        out["embedding.position_embeddings.weight"] = ((cfg.max_position_embeddings, h),
                                                       "--max-position-embeddings")
    if cfg.untie_embeddings_and_output_weights:
        out["output_layer.weight"] = ((None, h), "--untie-embeddings-and-output-weights")
    if cfg.normalization == "layernorm":
        out["decoder.final_layernorm.bias"] = ((h,), "--normalization")
        for norm in ("self_attention.linear_qkv", "mlp.linear_fc1"):
            out[f"{LAYER_PREFIX}{norm}.layer_norm_bias"] = ((n, h), "--normalization")
    if cfg.qkv_bias:
        out[LAYER_PREFIX + "self_attention.linear_qkv.bias"] = (
            (n, qkv), "--disable-bias-linear/--add-qkv-bias")
    if cfg.add_bias_linear:
        out[LAYER_PREFIX + "self_attention.linear_proj.bias"] = ((n, h), "--disable-bias-linear")
        out[LAYER_PREFIX + "mlp.linear_fc1.bias"] = ((n, fc1), "--disable-bias-linear")
        out[LAYER_PREFIX + "mlp.linear_fc2.bias"] = ((n, h), "--disable-bias-linear")
    if cfg.moe is not None:  # every layer's MLP is the experts (_check_model)
        for key in [k for k in out if k.startswith(LAYER_PREFIX + "mlp.linear_fc")
                    and "layer_norm" not in k]:
            del out[key]
        e, fe = cfg.moe.num_experts, cfg.moe.expert_ffn(f)
        experts = "--num-experts/--moe-ffn-hidden-size"
        out[ROUTER] = ((n, e, h), "--num-experts")
        out[EXPERTS + "linear_fc1.weight"] = ((n, e, 2 * fe if cfg.activation == "swiglu"
                                               else fe, h), experts + "/--swiglu")
        out[EXPERTS + "linear_fc2.weight"] = ((n, e, h, fe), experts)
    return out


def _expert_fc1_from_mcore(t: torch.Tensor) -> torch.Tensor:
    """Experts' SwiGLU fc1 (E, 2f, h): Megatron-Core's gate rows | up rows -> interleaved."""
    return torch.stack(t.chunk(2, dim=1), dim=2).reshape(t.shape)


def _expert_fc1_to_mcore(t: torch.Tensor) -> torch.Tensor:
    pairs = t.reshape(t.shape[0], t.shape[1] // 2, 2, t.shape[2])
    return torch.cat([pairs[:, :, 0], pairs[:, :, 1]], dim=1)


def _ours(key: str) -> str:
    """Our FQN suffix (after ``layers.i.`` for a layer key) of a Megatron-Core key."""
    renames = {"self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
               "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
               "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
               "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias",
               "decoder.final_layernorm.weight": "final_norm.weight",
               "decoder.final_layernorm.bias": "final_norm.bias"}
    if key.startswith(EXPERTS):  # ours: mlp.experts.linear_fc1.weight
        key = "mlp.experts." + key[len(EXPERTS):]
    elif key.startswith(LAYER_PREFIX):
        key = key[len(LAYER_PREFIX):]
    return renames.get(key, key)


def _vocab_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] >= rows:
        return t[:rows]
    return torch.cat([t, t.new_zeros((rows - t.shape[0],) + tuple(t.shape[1:]))])


def _check_model(cfg: ModelConfig) -> None:
    if cfg.model_type != "gpt":
        raise ConversionError(f"--model-type={cfg.model_type.upper()}: Megatron-Core "
                              f"checkpoints convert for GPT / LLaMA models only; use GPT")
    moe = cfg.moe
    if moe is not None and moe.moe_layers(cfg.num_layers) != tuple(range(cfg.num_layers)):
        raise ConversionError(f"--moe-layer-freq={moe.layer_freq}: Megatron-Core stores dense "
                              f"and MoE layers under other keys; only models whose every layer "
                              f"is MoE convert")
    if moe is not None and moe.shared_expert_intermediate_size is not None:
        raise ConversionError(f"--moe-shared-expert-intermediate-size="
                              f"{moe.shared_expert_intermediate_size}: shared experts do not "
                              f"convert; convert a model without them")


# ------------------------------------------------------------------------------- import
def iteration_dir(load_dir: str) -> str:
    """The ``iter_*`` directory of a Megatron-LM save directory (its latest), or ``load_dir``
    itself when it is a ``torch_dist`` checkpoint; ConversionError naming what is missing."""
    latest = os.path.join(load_dir, LATEST)
    path = load_dir
    if os.path.isfile(latest):
        text = open(latest, encoding="utf-8").read().strip()
        if not text.isdigit():
            raise ConversionError(f"--load-dir={load_dir}: {LATEST} holds {text!r}, not an "
                                  f"iteration; give a Megatron-LM --save directory")
        path = os.path.join(load_dir, f"iter_{int(text):07d}")
    meta = os.path.join(path, METADATA)
    if not os.path.isfile(meta):
        raise ConversionError(f"--load-dir={load_dir}: no {LATEST} and no {METADATA} at "
                              f"{path}; give a Megatron-LM --save directory written with "
                              f"--ckpt-format torch_dist")
    try:
        backend = json.load(open(meta, encoding="utf-8")).get("sharded_backend")
    except (OSError, ValueError, AttributeError) as err:
        raise ConversionError(f"--load-dir={load_dir}: {meta} cannot be read ({err}); copy "
                              f"the checkpoint again") from None
    if backend != "torch_dist":
        raise ConversionError(f"--load-dir={load_dir}: {meta} has sharded_backend={backend!r}; "
                              f"only torch_dist converts (Megatron-LM --ckpt-format torch_dist; "
                              f"its tools/checkpoint converts zarr and legacy torch checkpoints)")
    return path


def read_mcore_state(path: str, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Our FQN -> full fp32 tensor of the model of ``cfg`` in the torch_dist checkpoint at
    ``path`` (an iteration directory); every tensor's shape is checked against ``cfg``."""
    _check_model(cfg)
    metadata = FileSystemReader(path).read_metadata().state_dict_metadata
    expected = _shape_flags(cfg)
    for key, md in metadata.items():  # a tensor of something the model lacks
        if (isinstance(md, TensorStorageMetadata) and key not in expected
                and (key.startswith(("decoder.", "embedding.", "output_layer.")))):
            raise ConversionError(f"--load-dir: the checkpoint has {key} {tuple(md.size)}, "
                                  f"which the model of these flags lacks; give the flags it was "
                                  f"trained with (biases, norms, positions, MoE)")
    state: dict[str, torch.Tensor] = {}
    for key, (shape, flags) in expected.items():
        md = metadata.get(key)
        if not isinstance(md, TensorStorageMetadata):
            raise ConversionError(f"--load-dir: the checkpoint has no tensor {key}, which "
                                  f"{flags} imply; give the flags it was trained with")
        got = tuple(md.size)
        want = tuple(g if w is None else w for g, w in zip(got, shape)) if len(got) == len(
            shape) else shape
        if got != want:
            raise ConversionError(f"--load-dir: {key} has shape {got} in the checkpoint, "
                                  f"{flags} give {want}; set them to the checkpoint's model")
        state[key] = torch.empty(got, dtype=md.properties.dtype)
    with warnings.catch_warnings():  # one process on purpose
        warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
        dcp.load(state, checkpoint_id=path)
    out: dict[str, torch.Tensor] = {}
    for key, t in state.items():
        t = t.float()
        if key.startswith(LAYER_PREFIX):
            for i in range(cfg.num_layers):
                row = t[i]
                if key.startswith(LAYER_PREFIX + "mlp.linear_fc1.") and \
                        cfg.activation == "swiglu" and "layer_norm" not in key:
                    gate, up = row.chunk(2)
                    row = merge_gate_up(gate, up)
                elif key == EXPERTS + "linear_fc1.weight" and cfg.activation == "swiglu":
                    row = _expert_fc1_from_mcore(row)
                out[f"layers.{i}.{_ours(key)}"] = row.contiguous().clone()
        elif key in ("embedding.word_embeddings.weight", "output_layer.weight"):
            out[_ours(key)] = _vocab_rows(t, cfg.padded_vocab_size).contiguous()
        else:
            out[_ours(key)] = t.contiguous()
    return out


def vocab_rows(path: str) -> int:
    """The embedding's rows in the checkpoint at ``path`` (Megatron's padded vocabulary)."""
    md = FileSystemReader(path).read_metadata().state_dict_metadata.get(
        "embedding.word_embeddings.weight")
    if not isinstance(md, TensorStorageMetadata):
        raise ConversionError(f"--load-dir={path}: no embedding.word_embeddings.weight there; "
                              f"give a GPT checkpoint of Megatron-Core")
    return int(md.size[0])


# ------------------------------------------------------------------------------- export
def write_mcore_checkpoint(save_dir: str, cfg: ModelConfig, state: dict[str, torch.Tensor],
                           iteration: int, *, overwrite: bool = False) -> str:
    """Write our full state of ``cfg`` as a Megatron-LM ``torch_dist`` save directory
    (``iter_NNNNNNN`` and ``latest_checkpointed_iteration.txt``); returns the iteration
    directory. The embedding keeps our padded rows."""
    _check_model(cfg)
    out = check_output_dir(save_dir, "--save-dir", ConversionError)
    refuse_non_empty_dir(out, "--save-dir", overwrite, ConversionError)
    tensors: dict[str, Any] = {}
    for key, (shape, _) in _shape_flags(cfg).items():
        if key.startswith(LAYER_PREFIX):
            rows = []
            for i in range(cfg.num_layers):
                name = f"layers.{i}.{_ours(key)}"
                if name not in state:
                    raise ConversionError(f"the checkpoint lacks {name!r} its model config "
                                          f"needs; convert a checkpoint written by this model")
                row = state[name]
                if key.startswith(LAYER_PREFIX + "mlp.linear_fc1.") and \
                        cfg.activation == "swiglu" and "layer_norm" not in key:
                    row = torch.cat(split_gate_up(row))
                elif key == EXPERTS + "linear_fc1.weight" and cfg.activation == "swiglu":
                    row = _expert_fc1_to_mcore(row)
                rows.append(row.float())
            tensors[key] = torch.stack(rows).contiguous()
        else:
            tensors[key] = state[_ours(key)].float().contiguous()
    n = cfg.num_layers
    # what Megatron-Core's local spec saves for each stacked module: a ShardedObject, which its
    # torch_dist save stores as the pickle of a list of the object's local copies (its load
    # unpacks that list: a bare None there fails its load with a TypeError); DCP pickles a
    # tensor-free list as one object
    for module in _EXTRA[:2] if cfg.moe is not None else _EXTRA:
        for i in range(n):
            tensors[f"{LAYER_PREFIX}{module}._extra_state/shard_{i}_{n}"] = [None]
    if cfg.moe is not None:  # each expert's, numbered (layer, expert) as its sequential MLP
        e = cfg.moe.num_experts
        for fc in ("linear_fc1", "linear_fc2"):
            for i in range(n):
                for j in range(e):
                    tensors[f"{EXPERTS}{fc}._extra_state/shard_{i}.{j}_{n}.{e}"] = [None]
    path = os.path.join(out, f"iter_{iteration:07d}")
    os.makedirs(path, exist_ok=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
        dcp.save(tensors, checkpoint_id=path)
    torch.save({"checkpoint_version": 3.0, "iteration": iteration},
               os.path.join(path, "common.pt"))
    with open(os.path.join(path, METADATA), "w", encoding="utf-8") as f:
        json.dump(BACKEND, f)
    with open(os.path.join(out, LATEST), "w", encoding="utf-8") as f:
        f.write(f"{iteration}\n")
    return path


# ------------------------------------------------------------------------------- the two ways
def import_mcore(load_dir: str, save_dir: str, flags: dict[str, Any], *,
                 overwrite: bool = False) -> ModelConfig:
    """A Megatron-LM torch_dist save directory -> our weights-only checkpoint in ``save_dir``.
    ``flags``: the model flags given (argparse destinations -> values), the others at their
    defaults; ``--vocab-size`` defaults to the checkpoint's embedding rows."""
    path = iteration_dir(os.fspath(load_dir))
    args = add_model_args(argparse.ArgumentParser()).parse_args([])
    for dest, value in flags.items():
        setattr(args, dest, value)
    cfg = model_config_from_args(args, vocab_size=args.vocab_size or vocab_rows(path))
    check_new_checkpoint_dir(save_dir, overwrite)
    state = read_mcore_state(path, cfg)
    write_weights_checkpoint(save_dir, cfg, state, source=f"megatron-core:{path}",
                             overwrite=overwrite)
    return cfg


def export_mcore(load_dir: str, save_dir: str, *, overwrite: bool = False) -> tuple[str,
                                                                                    ModelConfig]:
    """The latest checkpoint of ours under ``load_dir`` (any plan) -> a Megatron-LM torch_dist
    save directory ``save_dir`` at the same iteration; returns (its iteration dir, config)."""
    check_output_dir(save_dir, "--save-dir", ConversionError)
    refuse_non_empty_dir(os.fspath(save_dir), "--save-dir", overwrite, ConversionError)
    cfg, state = read_model_checkpoint(load_dir)
    _check_model(cfg)
    _, info = read_info(load_dir)
    return write_mcore_checkpoint(os.fspath(save_dir), cfg, state,
                                  int(info.get("iteration", 0)), overwrite=overwrite), cfg
