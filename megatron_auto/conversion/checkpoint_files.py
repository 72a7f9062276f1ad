"""Whole-model reads and weights-only writes of our checkpoints, in one process.

Our checkpoints (``training/checkpoint.py``) hold every parameter as its global tensor under a
plan-independent name (``model.<fqn>``) in torch.distributed.checkpoint (DCP) files, whatever
plan wrote them (TP shards, ZeRO chunks and pipeline stages are chunks of those global tensors).
So one process rebuilds the whole model by asking DCP for the full tensors: DCP assembles them
from every rank's chunks. Without a process group DCP runs in its single-process mode.

:func:`write_weights_checkpoint` writes the converse: the full tensors of a converted model as
an ``iter_0000000`` checkpoint marked ``weights_only`` in its ``checkpoint_info.json``, which
``--load`` reads under any plan (resharded by DCP as usual) while the optimizer, the data
position and the RNG streams start fresh, as for Megatron's ``--finetune``.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ..utils.atomicfile import atomic_write
from ..config import ModelConfig
from ..families.registry import families, family_of_record
from ..utils.output_paths import check_output_dir
from ..training.checkpoint import (FORMAT, INFO_FILE, LATEST_FILE, RECORD_KEY, VERSION,
                                   CheckpointError, describe_files, has_checkpoint, iteration_dir,
                                   read_info)

MODEL_PREFIX = "model."


def read_model_checkpoint(load_dir: str | os.PathLike) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """(model config, FQN -> full fp32 tensor) of the latest checkpoint under ``load_dir``.

    Raises :class:`CheckpointError` naming the directory when it holds no complete checkpoint
    or one of another kind of model (an image classifier).
    """
    if not has_checkpoint(load_dir):
        raise CheckpointError(f"--load-dir={os.fspath(load_dir)}: holds no checkpoint ({LATEST_FILE}"
                              f" is missing); give the --save directory of a training run")
    path, info = read_info(load_dir)
    model = info.get("model") or {}
    try:
        family = family_of_record(model)
    except ValueError:  # a family this process does not know
        family = None
    if family is None or not family.hf_architectures:
        convertible = " and ".join(f.name.upper() for f in families() if f.hf_architectures)
        raise CheckpointError(f"--load-dir={os.fspath(load_dir)}: holds a "
                              f"{model.get('model_type')} model; only {convertible} checkpoints "
                              f"convert to Hugging Face models")
    config = family.config_from_dict(model)
    metadata = FileSystemReader(path).read_metadata().state_dict_metadata
    state = {key: torch.empty(md.size, dtype=md.properties.dtype)
             for key, md in metadata.items()
             if key.startswith(MODEL_PREFIX) and isinstance(md, TensorStorageMetadata)}
    if not state:
        raise CheckpointError(f"--load-dir={os.fspath(load_dir)}: {path} holds no model "
                              f"parameters; give the --save directory of a training run")
    with warnings.catch_warnings():  # one process on purpose: DCP warns that it assumes so
        warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
        dcp.load(state, checkpoint_id=path)
    return config, {k[len(MODEL_PREFIX):]: v.float() for k, v in state.items()}


def check_new_checkpoint_dir(save_dir: str | os.PathLike, overwrite: bool = False) -> None:
    """CheckpointError unless ``save_dir`` can take the converted model: a writable directory
    (or one that can be made) holding no checkpoint yet, whose ``latest`` would otherwise be
    pointed at the converted model, hiding the training run's own. ``overwrite`` also accepts a
    directory whose latest checkpoint is an earlier conversion (weights only, iteration 0),
    which the new one replaces; a training run's checkpoints are never replaced."""
    where = os.fspath(save_dir)
    check_output_dir(where, "--save-dir", CheckpointError)
    if not has_checkpoint(where):
        return
    if overwrite:
        _, info = read_info(where, fallback=False)
        if info.get("weights_only") and info.get("iteration") == 0:
            return
        raise CheckpointError(f"--save-dir={where}: holds a training run's checkpoint (iteration "
                              f"{info.get('iteration')}), which --overwrite never replaces (it "
                              f"replaces an earlier conversion only); choose a new directory")
    raise CheckpointError(f"--save-dir={where}: already holds a checkpoint ({LATEST_FILE}); "
                          f"choose a new directory for the converted model, or add --overwrite "
                          f"to replace an earlier conversion there")


def write_weights_checkpoint(save_dir: str | os.PathLike, config: ModelConfig,
                             state: dict[str, torch.Tensor], *, source: str = "",
                             overwrite: bool = False) -> str:
    """Write ``state`` (FQN -> full tensor) as a weights-only checkpoint of iteration 0 under
    ``save_dir``; returns the iteration directory. ``source`` is recorded for information.
    ``overwrite``: replace an earlier conversion there (:func:`check_new_checkpoint_dir`)."""
    save_dir = os.fspath(save_dir)
    check_new_checkpoint_dir(save_dir, overwrite)
    path = iteration_dir(save_dir, 0)
    if os.path.isdir(path):  # an earlier conversion (checked above): no stale file may remain
        shutil.rmtree(path)
    os.makedirs(path, exist_ok=True)
    tensors = {MODEL_PREFIX + k: v.detach().float().contiguous() for k, v in state.items()}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
        dcp.save(tensors, checkpoint_id=path)
    info: dict[str, Any] = {
        "format": FORMAT, "version": VERSION, "iteration": 0, "consumed_samples": 0,
        "skipped_iterations": 0, "weights_only": True, "converted_from": source,
        "world_size": 1, "plan": {}, "model": config.to_dict(),
        RECORD_KEY: describe_files(path)}  # the verification record a load checks
    atomic_write(os.path.join(path, INFO_FILE), json.dumps(info, indent=1) + "\n", durable=True)
    atomic_write(os.path.join(save_dir, LATEST_FILE), "0\n", durable=True)
    return path
