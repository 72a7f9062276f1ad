"""Hugging Face ViT and Swin configs (``model_type: vit``, ``swin``) as the image
classifier's flags (``--hf-config``; ``pretrain_vision_classify.py`` or ``--model-type
vit|swin``).

Both have GeLU, LayerNorm and biased projections, as ours. The class count is the config's
label count (``id2label``). Swin's stochastic depth (``drop_path_rate``) and an absolute
position table are not in our Swin: the planning commands price it without them (same cost up
to a table of weights), ``pretrain_vision_classify.py`` refuses them.
"""

from __future__ import annotations

from typing import Any

from ..hf_reader import HFReader

MODEL_TYPES = ("vit", "swin")


def _image(r: HFReader) -> None:
    size: Any = r.get("image_size")
    if isinstance(size, (list, tuple)):
        r.need(len(size) == 2, "image_size", size, "give one size or [height, width]")
        r.set("img_h", "image_size", int(size[0]))
        r.set("img_w", "image_size", int(size[1]))
    elif size is not None:
        r.take("img_h", "image_size")
        r.take("img_w", "image_size")
    patch = r.get("patch_size")
    if isinstance(patch, (list, tuple)):
        r.need(len(set(patch)) == 1, "patch_size", patch, "only square patches are modelled")
        patch = patch[0]
    if patch is not None:
        r.set("patch_dim", "patch_size", int(patch))
    r.take("num_channels", "num_channels")
    labels = r.get("id2label") or {}
    count = r.get("num_labels", len(labels) or None)
    if count:
        r.set("num_classes", "id2label", int(count))
    r.take("norm_epsilon", "layer_norm_eps", float)
    r.take("init_method_std", "initializer_range", float)
    r.take("hidden_dropout", "hidden_dropout_prob", float)
    r.take("attention_dropout", "attention_probs_dropout_prob", float)
    act = r.get("hidden_act", "gelu")
    r.cost_only(act == "gelu", "hidden_act", act, "GeLU")
    r.cost_only(bool(r.get("qkv_bias", True)), "qkv_bias", False, "biased query/key/value")
    # the vision script names the backbone with this flag; megatron-auto with --model-type
    r.set("vision_backbone_type", "model_type", r.config["model_type"], optional=True)


def read_vit(r: HFReader) -> None:
    _image(r)
    for dest, key in (("num_layers", "num_hidden_layers"), ("hidden_size", "hidden_size"),
                      ("num_attention_heads", "num_attention_heads"),
                      ("ffn_hidden_size", "intermediate_size")):
        r.take(dest, key)


def read_swin(r: HFReader) -> None:
    _image(r)
    r.take("swin_embed_dim", "embed_dim")
    for dest, key in (("swin_depths", "depths"), ("swin_num_heads", "num_heads")):
        value = r.get(key)
        if value is not None:
            r.need(isinstance(value, list) and all(isinstance(v, int) and v > 0 for v in value),
                   key, value, "must be a list of positive integers, one per stage")
            r.set(dest, key, tuple(value))
    r.take("swin_window_size", "window_size")
    ratio = r.get("mlp_ratio", 4.0)
    r.need(ratio == 4, "mlp_ratio", ratio, "our Swin MLP is 4x its width (no flag changes it)")
    r.cost_only(not r.get("drop_path_rate", 0.0), "drop_path_rate", r.get("drop_path_rate"),
                "a Swin without stochastic depth")
    r.cost_only(not r.get("use_absolute_embeddings", False), "use_absolute_embeddings", True,
                "a Swin without an absolute position table")
