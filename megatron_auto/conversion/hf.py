"""Export our checkpoints to Hugging Face ``transformers`` models and import them back.

``export_checkpoint``: the latest checkpoint of any plan (read whole through
torch.distributed.checkpoint, :mod:`.checkpoint_files`) -> a ``save_pretrained``-style directory
(``config.json`` written by the ``transformers`` config class, ``model.safetensors``) that
``AutoModelFor*.from_pretrained`` loads. ``import_checkpoint``: such a directory (any format
``from_pretrained`` reads) -> a weights-only checkpoint that ``--load`` reads under any plan.

The model flags given to the import (Megatron names, as for ``pretrain_gpt.py``) are checked
against the HF config: a flag that disagrees with it stops the import with one line naming the
flag, the config key and value, and the fix. Flags that do not change the weights
(``--seq-length``, dropout, ``--make-vocab-size-divisible-by``, ``--init-method-std``) are
taken as given. :func:`training_flags` lists the flags that train the imported model.

``transformers`` is an optional dependency: without it both directions stop with one line
saying how to install it (:func:`require_transformers`).
"""

from __future__ import annotations

import math
import os
from typing import Any, Mapping

import torch

from ..config import ModelConfig
from ..families.registry import families, family_of
from ..utils.jsonfile import read_json
from ..utils.output_paths import check_output_dir, refuse_non_empty_dir
from .checkpoint_files import (check_new_checkpoint_dir, read_model_checkpoint,
                               write_weights_checkpoint)
from .hf_mapping import (ARCHITECTURES, ConversionError, export_problem, from_hf_state,
                         hf_config_kwargs, model_fields_from_hf, pick_architecture, to_hf_state)

TRANSFORMERS_RANGE = ">=5.0,<6"
#: HF ``model_type`` -> our architecture name
HF_MODEL_TYPES = {"gpt2": "gpt2", "llama": "llama", "mixtral": "mixtral",
                  "megatron-bert": "megatron-bert"}
_CONFIG_CLASSES = {"gpt2": "GPT2Config", "llama": "LlamaConfig", "mixtral": "MixtralConfig",
                   "megatron-bert": "MegatronBertConfig"}

# Model flags (argparse destinations of ``arguments.add_model_args``) -> the ModelConfig field
# they set and how. Shape flags must agree with the HF config; SETTINGS are taken as given.
SHAPE_FLAGS: dict[str, tuple[str, Any]] = {
    "num_layers": ("num_layers", None), "hidden_size": ("hidden_size", None),
    "num_attention_heads": ("num_attention_heads", None),
    "ffn_hidden_size": ("ffn_hidden_size", None),
    "max_position_embeddings": ("max_position_embeddings", None),
    "vocab_size": ("vocab_size", None), "norm_epsilon": ("layernorm_epsilon", None),
    "position_embedding_type": ("position_embedding_type", None),
    "rotary_base": ("rotary_base", None),
    "swiglu": ("activation", lambda v: "swiglu" if v else "gelu"),
    "normalization": ("normalization", lambda v: str(v).lower()),
    "untie_embeddings_and_output_weights": ("untie_embeddings_and_output_weights", bool),
    "disable_bias_linear": ("add_bias_linear", lambda v: not v),
    "openai_gelu": ("openai_gelu", bool),
}
SETTINGS = {"seq_length": "seq_length", "make_vocab_size_divisible_by":
            "make_vocab_size_divisible_by", "hidden_dropout": "hidden_dropout",
            "attention_dropout": "attention_dropout", "init_method_std": "init_method_std"}


def require_transformers() -> Any:
    """The ``transformers`` module, or ConversionError saying how to install it."""
    try:
        import transformers  # noqa: PLC0415 - optional, heavy package
    except ImportError:
        raise ConversionError(
            f"Hugging Face conversion needs the `transformers` package, which is not installed; "
            f"pip install 'transformers{TRANSFORMERS_RANGE}' (or megatron_auto's [hf] extra)"
        ) from None
    transformers.utils.logging.disable_progress_bar()
    return transformers


# ------------------------------------------------------------------------------- export
def export_checkpoint(load_dir: str | os.PathLike, save_dir: str | os.PathLike,
                      architecture: str = "auto", model_type: str | None = None, *,
                      overwrite: bool = False) -> tuple[str, ModelConfig]:
    """Write the latest checkpoint under ``load_dir`` as an HF model into ``save_dir``.

    ``architecture``: ``gpt2``, ``llama``, ``megatron-bert`` or ``auto`` (BERT -> Megatron-BERT,
    RoPE -> LLaMA, else GPT-2). ``model_type`` (``gpt`` / ``bert``), when given, must be the
    checkpoint's. ``save_dir`` must be writable and empty (or absent) unless ``overwrite``,
    which writes ``config.json`` and ``model.safetensors`` over what is there and leaves its
    other files (a tokenizer, say). Both are checked before anything is read. Returns
    (architecture, the model's config).
    """
    transformers = require_transformers()
    from safetensors.torch import save_file  # noqa: PLC0415 - a dependency of transformers

    if architecture not in ARCHITECTURES + ("auto",):
        raise ConversionError(f"--hf-architecture={architecture}: choose auto or one of "
                              f"{', '.join(ARCHITECTURES)}")
    out = check_output_dir(save_dir, "--save-dir", ConversionError)
    refuse_non_empty_dir(out, "--save-dir", overwrite, ConversionError)
    config, state = read_model_checkpoint(load_dir)
    if model_type is not None and model_type != config.model_type:
        raise ConversionError(f"--model-type={model_type.upper()}: {os.fspath(load_dir)} holds "
                              f"a {config.model_type.upper()} model; pass --model-type "
                              f"{config.model_type.upper()}")
    arch = pick_architecture(config) if architecture == "auto" else architecture
    problem = export_problem(config, arch)
    if problem is not None:
        raise ConversionError(f"--hf-architecture={arch}: the checkpoint's model has {problem}")
    hf_config = getattr(transformers, _CONFIG_CLASSES[arch])(**hf_config_kwargs(config, arch))
    tensors = to_hf_state(config, state, arch)
    try:
        os.makedirs(out, exist_ok=True)
        hf_config.save_pretrained(out)
        save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    except OSError as err:  # checked writable above: a full disk, or the path changed since
        raise ConversionError(f"--save-dir={out}: writing the model failed "
                              f"({err.strerror or err}); free space or choose another "
                              f"directory") from None
    return arch, config


# ------------------------------------------------------------------------------- import
def _model_class(transformers: Any, arch: str, hf_config: Any) -> Any:
    if arch == "gpt2":
        return transformers.GPT2LMHeadModel
    if arch == "llama":
        return transformers.LlamaForCausalLM
    if arch == "mixtral":
        return transformers.MixtralForCausalLM
    heads = getattr(hf_config, "architectures", None) or []
    if "MegatronBertForMaskedLM" in heads:
        return transformers.MegatronBertForMaskedLM
    return transformers.MegatronBertForPreTraining


def _mismatch(flag: str, value: Any, key: str, theirs: Any, where: str) -> ConversionError:
    return ConversionError(
        f"--{flag.replace('_', '-')}={value}: the Hugging Face checkpoint {where} has {key}="
        f"{theirs!r}; drop the flag or set it to match the checkpoint")


def config_from_hf(hf_config: Any, arch: str, flags: Mapping[str, Any], where: str) -> ModelConfig:
    """Our ModelConfig of an HF config, checked against the model ``flags`` the user gave
    (argparse destination -> value, only the flags given)."""
    fields, names = model_fields_from_hf(hf_config, arch)
    for dest, value in flags.items():
        if dest in SETTINGS:
            fields[SETTINGS[dest]] = value
            continue
        if dest in ("group_query_attention", "num_query_groups"):
            continue  # below, together
        if dest not in SHAPE_FLAGS:
            continue
        field, convert = SHAPE_FLAGS[dest]
        ours = convert(value) if convert is not None else value
        default = ModelConfig.__dataclass_fields__[field].default
        theirs = fields.get(field, default)
        same = (math.isclose(ours, theirs, rel_tol=1e-9) if isinstance(ours, float)
                else ours == theirs)
        if not same:
            raise _mismatch(dest, value, names.get(field, field), _hf_value(hf_config, names,
                                                                             field, theirs), where)
    if flags.get("num_query_groups") is not None and not flags.get("group_query_attention"):
        raise ConversionError(f"--num-query-groups={flags['num_query_groups']}: needs "
                              f"--group-query-attention; add that flag or drop --num-query-groups")
    if flags.get("group_query_attention"):  # Megatron's default: one key/value head
        want = flags.get("num_query_groups") or 1
        theirs = fields.get("num_query_groups") or fields["num_attention_heads"]
        if want != theirs:
            key = names.get("num_query_groups") or names.get("num_attention_heads",
                                                             "num_attention_heads")
            raise _mismatch("num_query_groups", want, key, theirs, where)
    # the positions the checkpoint has are the longest sequence it trains; --seq-length shortens
    fields.setdefault("seq_length", fields["max_position_embeddings"])
    if fields["seq_length"] > fields["max_position_embeddings"]:
        key = names.get("max_position_embeddings", "max_position_embeddings")
        raise ConversionError(
            f"--seq-length={fields['seq_length']}: the Hugging Face checkpoint {where} has "
            f"{key}={fields['max_position_embeddings']} (its position table, which the model "
            f"cannot exceed); give --seq-length {fields['max_position_embeddings']} or less")
    return ModelConfig(**fields)


def _hf_value(hf_config: Any, names: Mapping[str, str], field: str, ours: Any) -> Any:
    """What the HF config itself says for ``field`` (for the message)."""
    key = names.get(field)
    return getattr(hf_config, key, ours) if key else ours


#: The weight files ``from_pretrained`` reads, in the order it prefers them (one of them must be
#: there; the sharded forms through their index).
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _read_hf_config(transformers: Any, where: str) -> Any:
    """The HF config of ``where``; a missing, empty or malformed ``config.json`` is one
    ConversionError naming the file and the fix (transformers would raise its own errors)."""
    path = os.path.join(where, "config.json")
    if not os.path.isfile(path):
        raise ConversionError(f"--load-dir={where}: no config.json there; give a directory "
                              f"written by save_pretrained (a Hugging Face model)")
    data = read_json(path, f"--load-dir={where}:", ConversionError,
                     read_fix="give a readable Hugging Face model directory",
                     syntax_fix="the file is damaged or truncated: copy or download it again")
    if not isinstance(data, dict) or "model_type" not in data:
        raise ConversionError(f"--load-dir={where}: {path}: not a Hugging Face model config (no "
                              f"'model_type' key); give a directory written by save_pretrained")
    try:
        return transformers.AutoConfig.from_pretrained(where)
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ConversionError(f"--load-dir={where}: {path}: transformers cannot read it "
                              f"({_first_line(err)}); fix or replace the file") from None


def import_checkpoint(hf_dir: str | os.PathLike, save_dir: str | os.PathLike,
                      flags: Mapping[str, Any] | None = None,
                      model_type: str | None = None, *,
                      overwrite: bool = False) -> tuple[str, ModelConfig]:
    """Convert the HF model in ``hf_dir`` into a weights-only checkpoint under ``save_dir``.

    ``flags``: the model flags the user gave (argparse destination -> value); each must agree
    with the HF config. ``model_type`` (``gpt`` / ``bert``), when given, must be the HF model's
    kind. ``save_dir`` must be writable and hold no checkpoint (``overwrite``: or an earlier
    conversion, which is replaced); checked before the weights are read. A config or weight
    file that cannot be read is a ConversionError naming it. Returns (architecture, the
    model's config).
    """
    transformers = require_transformers()
    where = os.fspath(hf_dir)
    hf_config = _read_hf_config(transformers, where)
    arch = HF_MODEL_TYPES.get(hf_config.model_type)
    if arch is None:
        raise ConversionError(f"--load-dir={where}: a {hf_config.model_type!r} model; only "
                              f"{', '.join(HF_MODEL_TYPES)} convert")
    kind = next(f.name for f in families() if arch in f.hf_architectures)  # gpt or bert
    if model_type is not None and model_type != kind:
        raise ConversionError(f"--model-type={model_type.upper()}: {where} holds a "
                              f"{hf_config.model_type} model ({kind.upper()}); pass "
                              f"--model-type {kind.upper()}")
    config = config_from_hf(hf_config, arch, flags or {}, where)
    check_new_checkpoint_dir(save_dir, overwrite)
    weights = next((name for name in WEIGHT_FILES if os.path.isfile(os.path.join(where, name))),
                   None)
    if weights is None:
        raise ConversionError(f"--load-dir={where}: config.json but no weights there (none of "
                              f"{', '.join(WEIGHT_FILES)}); give the complete directory written "
                              f"by save_pretrained")
    try:
        model, info = _model_class(transformers, arch, hf_config).from_pretrained(
            where, dtype=torch.float32, output_loading_info=True)
    except Exception as err:  # noqa: BLE001 - safetensors, pickle, zip and OS errors alike
        # A damaged file fails in the reader of its format (SafetensorError, UnpicklingError,
        # RuntimeError of torch's zip reader, OSError): all the same mistake to the user.
        raise ConversionError(f"--load-dir={where}: cannot read the weights {weights} "
                              f"({type(err).__name__}: {_first_line(err)}); the file is damaged "
                              f"or truncated: copy or download it again") from None
    missing = sorted(info.get("missing_keys") or ())
    if missing:
        raise ConversionError(f"--load-dir={where}: the checkpoint lacks {missing[0]} (and "
                              f"{len(missing) - 1} more) that its config implies; convert a "
                              f"complete checkpoint")
    state = from_hf_state(config, model.state_dict(), arch)
    write_weights_checkpoint(save_dir, config, state, source=f"{hf_config.model_type}:{where}",
                             overwrite=overwrite)
    return arch, config


# ------------------------------------------------------------------------------- flags
def training_flags(config: ModelConfig) -> list[str]:
    """The ``pretrain_gpt.py`` / ``pretrain_bert.py`` model flags that build ``config`` (its
    family's entry-script flags)."""
    script_flags = family_of(config).script_flags
    assert script_flags is not None  # GPT's and BERT's (the families that convert) have them
    return script_flags(config)


def describe(config: ModelConfig) -> str:
    """One line: the model's size and shape."""
    return (f"{config.model_type}: {config.num_layers} layers, hidden {config.hidden_size}, "
            f"{config.num_attention_heads} heads ({config.query_groups} key/value), ffn "
            f"{config.ffn_hidden_size}, vocabulary {config.vocab_size} (padded "
            f"{config.padded_vocab_size}), {config.num_parameters():,} parameters")
