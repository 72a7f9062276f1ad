"""``--hf-config FILE_OR_DIR``: a Hugging Face ``config.json`` as the model flags.

A user who has a ``transformers`` model (a ``save_pretrained`` directory, or its
``config.json``) plans and trains it without retyping its architecture: the file's fields become
the values of our model flags (Megatron's names), and a flag typed next to ``--hf-config``
overrides the file's value. Which family reads the file is the registry's answer to its
``model_type`` (:attr:`Family.hf_model_types`); each family's :attr:`Family.hf_config` turns the
file into flag values (``families/<name>/hf_config.py``). No ``transformers`` import: the file is
JSON, so the planning commands stay fast and torch-free, and configs of transformers 4 and 5
read alike.

What a family cannot model is one line naming the field, its value and what is not supported
(``--hf-config=llama/config.json: rope_parameters.rope_type='llama3': rope scaling is not
implemented; ...``). Some fields change the numerics but not the costs (ReLU instead of GeLU,
T5's gated GeLU instead of SwiGLU, BERT's post-LayerNorm): :meth:`HFReader.cost_only` lets the
planning commands price the model with our equivalent and say so in one warning, while the
training scripts (``training=True``) refuse them, since they would train another model.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

from ..utils.flag_warnings import warn_flag
from ..utils.jsonfile import read_json
from .hf_reader import HFConfigError, HFReader, MergedCheck
from .registry import families, get_family

__all__ = ["HFConfigError", "HFFlags", "HFReader", "apply_hf_config", "hf_flags",
           "read_hf_config"]

def read_hf_config(path: str | os.PathLike) -> tuple[dict[str, Any], str]:
    """(the fields, the file) of ``path``: a ``config.json`` or a directory holding one."""
    where = os.fspath(path)
    file = os.path.join(where, "config.json") if os.path.isdir(where) else where
    if not os.path.isfile(file):
        raise HFConfigError(f"--hf-config={where}: no such file"
                            + (" (the directory has no config.json)" if os.path.isdir(where)
                               else "") + "; give a Hugging Face config.json or the directory "
                            "save_pretrained wrote")
    data = read_json(file, "--hf-config", HFConfigError,
                     syntax_fix="the file is damaged: copy or download it again")
    if not isinstance(data, dict) or not isinstance(data.get("model_type"), str):
        raise HFConfigError(f"--hf-config={where}: not a Hugging Face model config (no "
                            f"'model_type' key); give the config.json of a transformers model")
    return data, file


@dataclass(frozen=True)
class HFFlags:
    """The model flags a config file gives (:func:`hf_flags`)."""

    family: str
    hf_model_type: str
    values: Mapping[str, Any]
    keys: Mapping[str, str]
    notes: tuple[str, ...]
    checks: tuple[MergedCheck, ...]
    where: str
    optional: frozenset[str] = frozenset()
    features: Mapping[str, str] = field(default_factory=dict)


def hf_flags(path: str | os.PathLike, *, training: bool = False) -> HFFlags:
    """The model flags of the config at ``path``, read by the family its ``model_type``
    names (``training``: for a training script, see the module docstring)."""
    data, file = read_hf_config(path)
    model_type = data["model_type"]
    readers = [(f, f.hf_config) for f in families() if model_type in f.hf_model_types]
    if not readers or readers[0][1] is None:
        known = sorted(t for f in families() if f.hf_config for t in f.hf_model_types)
        raise HFConfigError(f"--hf-config={os.fspath(path)}: model_type={model_type!r} is not "
                            f"a model megatron_auto reads; known: {', '.join(known)}")
    family, read = readers[0]
    reader = HFReader(config=data, where=os.fspath(path), training=training)
    read(reader)
    return HFFlags(family=family.name, hf_model_type=model_type, values=dict(reader.values),
                   keys=dict(reader.keys), notes=tuple(reader.notes),
                   checks=tuple(reader.checks), where=os.fspath(path),
                   optional=frozenset(reader.optional), features=dict(reader.features))


def apply_hf_config(args: argparse.Namespace, given: frozenset[str], dests: frozenset[str], *,
                    training: bool = False, family_dest: str | None = None,
                    families_taken: tuple[str, ...] | None = None) -> HFFlags | None:
    """Fill ``args`` from ``args.hf_config`` (when given): every flag value the file gives,
    unless the command line typed that flag (``given``: the typed destinations; a typed flag
    wins). ``dests``: the destinations the parser has; a value for one it lacks is a model
    feature this command has no flag for, refused naming it. ``family_dest`` (the CLI's
    ``model_type``): set to the file's family, or checked against a typed one. Then the
    family's checks run on the merged flags and its notes warn once each. ``families_taken``
    (a training script's): a file of another family is refused naming its entry script."""
    path = getattr(args, "hf_config", None)
    if not path:
        return None
    flags = hf_flags(path, training=training)
    if families_taken is not None and flags.family not in families_taken:
        script = get_family(flags.family).entry_script or f"the {flags.family} entry script"
        raise HFConfigError(f"--hf-config={flags.where}: a {flags.hf_model_type} model "
                            f"({flags.family}); this script trains {' or '.join(families_taken)}"
                            f": use {script}")
    if family_dest is not None:
        typed = getattr(args, family_dest)
        if family_dest in given and typed != flags.family:
            raise HFConfigError(f"--{family_dest.replace('_', '-')}={typed}: --hf-config="
                                f"{flags.where} is a {flags.hf_model_type} model (model type "
                                f"{flags.family}); drop --{family_dest.replace('_', '-')}")
        setattr(args, family_dest, flags.family)
    for dest, value in flags.values.items():
        if dest not in dests:
            if dest in flags.optional:
                continue
            key = flags.keys.get(dest, dest)
            feature = flags.features.get(dest, f"--{dest.replace('_', '-')}")
            raise HFConfigError(f"--hf-config={flags.where}: {key}={value!r} needs {feature}, "
                                f"which megatron_auto does not have yet (no --"
                                f"{dest.replace('_', '-')} flag); plan a model without it")
        if dest not in given:
            setattr(args, dest, value)
            # families that tell a flag left alone by its value (T5's defaults) see it as set
            setattr(args, f"{dest}_given", True)
    for check in flags.checks:
        check(args)
    for note in flags.notes:
        warn_flag(f"--hf-config={flags.where}: {note}", stacklevel=2)
    return flags
