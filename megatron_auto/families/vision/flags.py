"""Flags of the image classifiers (``pretrain_vision_classify.py``) and their conversion.

Megatron-LM's names for the image and backbone (``--vision-backbone-type --img-h --img-w
--patch-dim --num-channels --num-classes``); ViT reuses the transformer shape flags
(``--num-layers --hidden-size --num-attention-heads --ffn-hidden-size``). Megatron has only Swin
presets; the shape flags ``--swin-embed-dim --swin-depths --swin-num-heads --swin-window-size``
are ours, and ``--swin-backbone-type tiny|small|base|large|huge`` fills the ones not given.
"""

from __future__ import annotations

import argparse

from ...config import ConfigError
from ...run_flag_checks import warn_ignored_model_flags
from ...utils.flag_warnings import warn_flag
from .config import BACKBONES, SWIN_PRESETS, VisionConfig

#: The Swin shape when neither a preset nor a shape flag says otherwise (small, CPU-friendly).
DEFAULT_SWIN = {"swin_embed_dim": 32, "swin_depths": (2, 2, 2), "swin_num_heads": (2, 4, 8),
                "swin_window_size": 4}
#: ViT defaults of the vision script (the embedded run): replaces the GPT's 256-wide defaults.
VIT_DEFAULTS = {"num_layers": 4, "hidden_size": 96, "num_attention_heads": 4,
                "hidden_dropout": 0.0, "attention_dropout": 0.0}


def _int_list(flag: str):
    def parse(text: str) -> tuple[int, ...]:
        try:
            values = tuple(int(v) for v in text.replace(" ", "").split(",") if v)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{flag}={text}: give comma-separated integers, e.g. 2,2,6,2") from None
        if not values:
            raise argparse.ArgumentTypeError(f"{flag}={text}: give at least one integer")
        return values
    return parse


def add_vision_args(parser: argparse.ArgumentParser, *, backbone_flag: bool = True,
                    script_defaults: bool = True) -> argparse.ArgumentParser:
    """Image, backbone and Swin shape flags.

    ``backbone_flag`` adds ``--vision-backbone-type`` (the CLI names the backbone with its
    ``--model-type`` instead); ``script_defaults`` replaces the transformer flags' GPT defaults
    by the vision script's (:data:`VIT_DEFAULTS`); the CLI, which serves GPT too, applies them
    in :func:`apply_vit_defaults` instead.
    """
    g = parser.add_argument_group("vision")
    if backbone_flag:
        g.add_argument("--vision-backbone-type", default="vit", choices=list(BACKBONES))
    g.add_argument("--img-h", type=int, default=32)
    g.add_argument("--img-w", type=int, default=32)
    g.add_argument("--patch-dim", type=int, default=4)
    g.add_argument("--num-channels", type=int, default=3)
    g.add_argument("--num-classes", type=int, default=10)
    g.add_argument("--swin-backbone-type", default=None, choices=list(SWIN_PRESETS),
                   help="Swin preset (embed dim, depths, heads; window 7); shape flags override")
    g.add_argument("--swin-embed-dim", type=int, default=None,
                   help=f"default: {DEFAULT_SWIN['swin_embed_dim']} (or the preset's)")
    g.add_argument("--swin-depths", type=_int_list("--swin-depths"), default=None,
                   help="blocks per stage, e.g. 2,2,6,2")
    g.add_argument("--swin-num-heads", type=_int_list("--swin-num-heads"), default=None,
                   help="heads per stage, e.g. 3,6,12,24")
    g.add_argument("--swin-window-size", type=int, default=None,
                   help=f"default: {DEFAULT_SWIN['swin_window_size']} (presets: 7)")
    if script_defaults:
        parser.set_defaults(**VIT_DEFAULTS)
    return parser


def apply_vit_defaults(args: argparse.Namespace, parser_defaults: dict) -> None:
    """Give every transformer flag left at ``parser_defaults`` (the GPT defaults) the vision
    script's default, so that the CLI describes the model the script would train."""
    for dest, value in VIT_DEFAULTS.items():
        if getattr(args, dest) == parser_defaults.get(dest):
            setattr(args, dest, value)


def _swin_shape(args: argparse.Namespace) -> dict:
    shape = dict(DEFAULT_SWIN)
    if args.swin_backbone_type is not None:
        embed, depths, heads = SWIN_PRESETS[args.swin_backbone_type]
        shape.update(swin_embed_dim=embed, swin_depths=depths, swin_num_heads=heads,
                     swin_window_size=7)
    for key in shape:
        if getattr(args, key, None) is not None:
            shape[key] = getattr(args, key)
    return shape


#: Shared model and data flags (destinations) an image classifier never reads: its sequence
#: is the patch grid, it has no vocabulary, tokenizer or text positions.
LANGUAGE_ONLY_FLAGS = ("seq_length", "max_position_embeddings", "vocab_size",
                       "make_vocab_size_divisible_by", "position_embedding_type", "rotary_base",
                       "swiglu", "normalization", "untie_embeddings_and_output_weights",
                       "disable_bias_linear", "openai_gelu", "group_query_attention",
                       "num_query_groups", "tokenizer_type", "tokenizer_model", "vocab_file",
                       "merge_file", "vocab_extra_ids", "eod_mask_loss", "split",
                       "data_cache_path")
#: ViT's shape flags, which a Swin backbone replaces by its own (``--swin-*``).
VIT_SHAPE_FLAGS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size")


def _warn_ignored(args: argparse.Namespace, backbone: str) -> None:
    """Warn once for the given flags this backbone does not read (``given_flags``: the
    destinations the command line typed, set by the entry points; unknown: no warning)."""
    given = getattr(args, "given_flags", None)
    swin_flags = [k for k in DEFAULT_SWIN if getattr(args, k, None) is not None]
    if backbone != "swin" and swin_flags:  # None is their default: typed when set
        warn_flag(" ".join(f"--{k.replace('_', '-')}={_text(getattr(args, k))}" for k in swin_flags)
                  + f": the Swin backbone's shape; ignored by the {backbone} backbone (add "
                  f"--vision-backbone-type swin, or drop them)", stacklevel=3)
    ignored = LANGUAGE_ONLY_FLAGS + (VIT_SHAPE_FLAGS if backbone == "swin" else ())
    why = ("its tokens are the image's patches: --img-h, --img-w and --patch-dim set the "
           "sequence" + ("; --swin-* flags set its shape" if backbone == "swin" else ""))
    warn_ignored_model_flags(given, ignored, args, backbone, why)


def _text(value: object) -> str:
    return ",".join(map(str, value)) if isinstance(value, tuple) else str(value)


def vision_config_from_args(args: argparse.Namespace) -> VisionConfig:
    """The :class:`VisionConfig` the flags describe; ``ConfigError`` names a bad flag."""
    backbone = getattr(args, "vision_backbone_type", None) or args.model_type
    if args.swin_backbone_type is not None and backbone != "swin":
        raise ConfigError(f"--swin-backbone-type={args.swin_backbone_type}: needs "
                          f"--vision-backbone-type swin (megatron-auto: --model-type swin); "
                          f"add it or drop the preset")
    _warn_ignored(args, backbone)
    return VisionConfig(
        model_type=backbone, img_h=args.img_h, img_w=args.img_w,
        patch_dim=args.patch_dim, num_channels=args.num_channels, num_classes=args.num_classes,
        num_layers=args.num_layers, hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads, ffn_hidden_size=args.ffn_hidden_size,
        hidden_dropout=args.hidden_dropout, attention_dropout=args.attention_dropout,
        layernorm_epsilon=args.norm_epsilon, init_method_std=args.init_method_std,
        **_swin_shape(args))
