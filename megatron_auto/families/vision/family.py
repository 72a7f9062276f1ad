"""The image classifier families ``vit`` and ``swin``: one ``VisionConfig``, two backbones,
``pretrain_vision_classify.py`` (``--vision-backbone-type``).

ViT has one layer type; Swin one per stage and one per patch-merging block, of different width,
heads and sequence length. Neither stage runs sequence parallelism or the interleaved schedule.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Mapping

from ...config import filled
from ...planner.inputs.model_spec import LayerType, ModelSpec
from ..family import Family, flags_of
from .hf_config import read_swin, read_vit
from ..gpt.family import plan_record
from .config import VisionConfig
from .flags import add_vision_args, apply_vit_defaults, vision_config_from_args

VISION_PLAN_RECORD_KEYS = (
    "model_type", "num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
    "img_h", "img_w", "patch_dim", "num_channels", "num_classes",
    "swin_embed_dim", "swin_depths", "swin_num_heads", "swin_window_size")

#: The shape fields of a checkpoint of an image classifier, with the flag that sets each.
VISION_CHECKPOINT_FIELDS = {
    "model_type": "--vision-backbone-type", "img_h": "--img-h", "img_w": "--img-w",
    "patch_dim": "--patch-dim", "num_channels": "--num-channels", "num_classes": "--num-classes",
    "num_layers": "--num-layers / --swin-depths", "hidden_size": "--hidden-size",
    "num_attention_heads": "--num-attention-heads", "ffn_hidden_size": "--ffn-hidden-size",
    "swin_embed_dim": "--swin-embed-dim", "swin_depths": "--swin-depths",
    "swin_num_heads": "--swin-num-heads", "swin_window_size": "--swin-window-size",
}
_SWIN_ONLY = ("swin_embed_dim", "swin_depths", "swin_num_heads", "swin_window_size")
_VIT_ONLY = ("hidden_size", "num_attention_heads", "ffn_hidden_size")


def model_spec(cfg: VisionConfig) -> ModelSpec:
    """ViT: one layer type ``vit``. Swin: per stage ``swin<k>`` for its blocks, and
    ``swin<k>_merge`` for the first block of every stage after the first (patch merging
    belongs to it). ``vocab_size`` is the class count (the head's rows)."""
    h_emb = cfg.embedding_hidden_size
    if cfg.model_type == "vit":
        types = [(LayerType(name="vit", hidden_size=cfg.hidden_size,
                            num_attention_heads=cfg.num_attention_heads,
                            ffn_hidden_size=filled(cfg.ffn_hidden_size),
                            seq_length=cfg.seq_length, count=cfg.num_layers, causal=False), cfg.num_layers)]
        embedding = cfg.patch_size_flat * h_emb + h_emb + h_emb + cfg.seq_length * h_emb
    else:
        types = []
        for st in cfg.swin_stages():
            block = LayerType(name=f"swin{st.index + 1}", hidden_size=st.hidden_size,
                              num_attention_heads=st.num_heads,
                              ffn_hidden_size=cfg.swin_mlp_ratio * st.hidden_size,
                              seq_length=st.seq_length, count=1, causal=False,
                              window_size=st.window)
            plain = st.depth
            if st.index > 0:
                types.append((dataclasses.replace(block, name=f"{block.name}_merge",
                                                  merge_input_hidden=st.hidden_size // 2), 1))
                plain -= 1
            if plain:
                types.append((dataclasses.replace(block, count=plain), plain))
        embedding = cfg.patch_size_flat * h_emb + h_emb + 2 * h_emb
    stacked = ModelSpec.stacked(types, vocab_size=cfg.num_classes, embedding_hidden_size=h_emb,
                                seq_length=cfg.seq_length, name=cfg.model_type)
    h_out = cfg.final_hidden_size
    return dataclasses.replace(
        stacked, tied_embeddings=False, config=plan_record(cfg, VISION_PLAN_RECORD_KEYS),
        embedding_parameter_count=embedding,
        head_parameter_count=2 * h_out + h_out * cfg.num_classes + cfg.num_classes,
        head_tokens=1, head_hidden_size=h_out)


def add_flags(parser: argparse.ArgumentParser) -> None:
    """The image and backbone flags on ``megatron-auto`` (``--model-type`` names the backbone;
    the shared transformer flags keep the GPT defaults)."""
    add_vision_args(parser, backbone_flag=False, script_defaults=False)


def from_flags(args: argparse.Namespace, defaults: Mapping[str, Any]) -> VisionConfig:
    """The vision script's conversion, with its defaults for the transformer flags left alone."""
    vision = argparse.Namespace(**vars(args))
    apply_vit_defaults(vision, dict(defaults))
    return vision_config_from_args(vision)


def model_flags(cfg: VisionConfig) -> list[str]:
    """The ``pretrain_vision_classify.py`` model flags of ``cfg``."""
    out = flags_of(cfg, {"--vision-backbone-type": "model_type", "--img-h": "img_h",
                         "--img-w": "img_w", "--patch-dim": "patch_dim",
                         "--num-channels": "num_channels", "--num-classes": "num_classes"})
    if cfg.model_type == "vit":
        return out + flags_of(cfg, {"--num-layers": "num_layers", "--hidden-size": "hidden_size",
                                    "--num-attention-heads": "num_attention_heads",
                                    "--ffn-hidden-size": "ffn_hidden_size"})
    return out + ["--swin-embed-dim", str(cfg.swin_embed_dim),
                  "--swin-depths", ",".join(map(str, cfg.swin_depths)),
                  "--swin-num-heads", ",".join(map(str, cfg.swin_num_heads)),
                  "--swin-window-size", str(cfg.swin_window_size)]


def _backbone(name: str, stage: str, unused: tuple[str, ...]) -> Family:
    return Family(
        name=name, config_class=VisionConfig, model_spec=model_spec, from_flags=from_flags,
        stage=stage, profiler="megatron_auto.profiler.vision_profiler:VISION_PROFILER",
        add_flags=add_flags, noun=f"{name} classifier",
        help=f"{name} (image classifier, with pretrain_vision_classify.py's flags)",
        checkpoint_fields={k: v for k, v in VISION_CHECKPOINT_FIELDS.items() if k not in unused},
        entry_script="pretrain_vision_classify.py", script_flags=model_flags,
        script_only_flags=("--vision-backbone-type",), hf_model_types=(name,),
        hf_config=read_vit if name == "vit" else read_swin)


FAMILIES = (
    _backbone("vit", "megatron_auto.models.vit:ViTStage", _SWIN_ONLY),
    _backbone("swin", "megatron_auto.models.swin:SwinStage", _VIT_ONLY),
)
