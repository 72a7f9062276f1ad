"""Shape and numerics of an image classifier: a ViT or a Swin backbone (pure data, no torch).

The runtime (``models/vit.py``, ``models/swin.py``), the planner (``planner/inputs/model_spec.py``) and
the entry script ``pretrain_vision_classify.py`` read the same :class:`VisionConfig`.

Shapes (``g_h x g_w = img_h/patch_dim x img_w/patch_dim`` patch grid):

- ViT: ``num_layers`` identical encoder layers of width ``hidden_size`` over
  ``g_h * g_w + 1`` tokens (the class token first).
- Swin: four (or ``len(swin_depths)``) stages; stage ``s`` has ``swin_depths[s]`` blocks of width
  ``swin_embed_dim * 2**s`` with ``swin_num_heads[s]`` heads over ``(g_h/2**s) x (g_w/2**s)``
  tokens, attending inside windows of ``w_s x w_s`` tokens, ``w_s = swin_window_size`` unless the
  feature map is not larger than that (then one window covers it and windows are not shifted,
  as in the Swin paper's last stage). Every odd block of a stage shifts its windows by
  ``w_s // 2``. Patch merging (2x2 neighbours -> ``4C`` -> norm -> ``2C``) runs at the start of
  the first block of every stage after the first: that block is global layer
  ``sum(swin_depths[:s])``.

Errors are :class:`~megatron_auto.config.ConfigError` naming the flag, the value and the fix.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar, Mapping

from ...config import ConfigError, filled
from ...utils.jsonfile import unknown_fields

BACKBONES = ("vit", "swin")

#: ``--swin-backbone-type`` presets: (embed dim, depths, heads); window 7, patch 4 (224 images).
#: ``huge`` is Galvatron's ``swin-huge-patch4-window7-224``.
SWIN_PRESETS: dict[str, tuple[int, tuple[int, ...], tuple[int, ...]]] = {
    "tiny": (96, (2, 2, 6, 2), (3, 6, 12, 24)),
    "small": (96, (2, 2, 18, 2), (3, 6, 12, 24)),
    "base": (128, (2, 2, 18, 2), (4, 8, 16, 32)),
    "large": (192, (2, 2, 18, 2), (6, 12, 24, 48)),
    "huge": (320, (2, 2, 42, 2), (10, 20, 40, 80)),
}


def _need(cond: bool, flag: str, value: Any, fix: str) -> None:
    if not cond:
        raise ConfigError(f"{flag}={value}: {fix}")


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


@dataclass(frozen=True)
class SwinStageShape:
    """One Swin stage: its blocks' width, heads, token grid and window."""

    index: int
    depth: int
    hidden_size: int
    num_heads: int
    grid_h: int
    grid_w: int
    window: int
    shift: int  # shift of the odd blocks (0 when one window covers the feature map)
    first_layer: int  # global index of its first block

    @property
    def seq_length(self) -> int:
        return self.grid_h * self.grid_w

    @property
    def num_windows(self) -> int:
        return (self.grid_h // self.window) * (self.grid_w // self.window)


@dataclass(frozen=True)
class VisionConfig:
    """An image classifier. ``model_type`` is the backbone (``vit`` or ``swin``)."""

    runs_sequence_parallel: ClassVar[bool] = False  # the vision stages refuse SP plans
    runs_context_parallel: ClassVar[bool] = False  # and CP plans
    runs_module_recompute: ClassVar[bool] = False  # whole-layer recompute only

    model_type: str = "vit"
    img_h: int = 32
    img_w: int = 32
    patch_dim: int = 4
    num_channels: int = 3
    num_classes: int = 10
    # ViT encoder
    num_layers: int = 4
    hidden_size: int = 64
    num_attention_heads: int = 4
    ffn_hidden_size: int | None = None  # default 4 * hidden_size
    # Swin backbone
    swin_embed_dim: int = 32
    swin_depths: tuple[int, ...] = (2, 2, 2, 2)
    swin_num_heads: tuple[int, ...] = (2, 4, 8, 16)
    swin_window_size: int = 4
    swin_mlp_ratio: int = 4
    # numerics
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    layernorm_epsilon: float = 1e-5
    init_method_std: float = 0.02

    def __post_init__(self) -> None:
        object.__setattr__(self, "swin_depths", tuple(self.swin_depths))
        object.__setattr__(self, "swin_num_heads", tuple(self.swin_num_heads))
        if self.ffn_hidden_size is None:
            object.__setattr__(self, "ffn_hidden_size", 4 * self.hidden_size)
        if self.model_type == "swin":
            object.__setattr__(self, "num_layers", sum(self.swin_depths))
        self.validate()

    # ------------------------------------------------------------------ shapes
    @property
    def grid(self) -> tuple[int, int]:
        """Patch grid (rows, columns) of the patch embedding."""
        return self.img_h // self.patch_dim, self.img_w // self.patch_dim

    @property
    def num_patches(self) -> int:
        return self.grid[0] * self.grid[1]

    @property
    def patch_size_flat(self) -> int:
        """Inputs of the patch projection: channels x patch x patch."""
        return self.num_channels * self.patch_dim * self.patch_dim

    @property
    def class_token(self) -> bool:
        """ViT prepends a class token (with a learned position table) and pools it; Swin has
        neither and pools the mean token."""
        return self.model_type == "vit"

    @property
    def embedding_hidden_size(self) -> int:
        return self.hidden_size if self.model_type == "vit" else self.swin_embed_dim

    @property
    def final_hidden_size(self) -> int:
        """Width of the representation the classification head reads."""
        if self.model_type == "vit":
            return self.hidden_size
        return self.swin_embed_dim * 2 ** (len(self.swin_depths) - 1)

    @property
    def seq_length(self) -> int:
        """Tokens per image at the embedding (ViT: patches + class token)."""
        return self.num_patches + (1 if self.class_token else 0)

    def swin_stages(self) -> tuple[SwinStageShape, ...]:
        """The Swin stages' shapes (empty for ViT)."""
        if self.model_type != "swin":
            return ()
        out = []
        gh, gw = self.grid
        first = 0
        for s, (depth, heads) in enumerate(zip(self.swin_depths, self.swin_num_heads)):
            window = self.swin_window_size
            if min(gh, gw) <= window:
                window, shift = min(gh, gw), 0
            else:
                shift = window // 2
            out.append(SwinStageShape(s, depth, self.swin_embed_dim * 2 ** s, heads, gh, gw,
                                      window, shift, first))
            first += depth
            gh, gw = gh // 2, gw // 2
        return tuple(out)

    def swin_stage_of_layer(self, layer: int) -> SwinStageShape:
        for stage in self.swin_stages():
            if layer < stage.first_layer + stage.depth:
                return stage
        raise IndexError(f"layer {layer} out of range for {self.num_layers} Swin blocks")

    def layer_shape(self, layer: int) -> tuple[int, int, int, int]:
        """(seq_length, hidden_size, num_heads, ffn_hidden_size) of layer ``layer``'s blocks."""
        if self.model_type == "vit":
            return (self.seq_length, self.hidden_size, self.num_attention_heads,
                    filled(self.ffn_hidden_size))
        st = self.swin_stage_of_layer(layer)
        return st.seq_length, st.hidden_size, st.num_heads, self.swin_mlp_ratio * st.hidden_size

    def layer_input_shape(self, layer: int) -> tuple[int, int]:
        """(tokens, width) that layer ``layer`` receives (before a Swin patch merging)."""
        if layer == 0:
            return self.seq_length, self.embedding_hidden_size
        return self.layer_output_shape(layer - 1)

    def layer_output_shape(self, layer: int) -> tuple[int, int]:
        """(tokens, width) that layer ``layer`` produces."""
        seq, hidden, _, _ = self.layer_shape(layer)
        return seq, hidden

    def has_patch_merging(self, layer: int) -> bool:
        """Whether layer ``layer`` starts with a patch merging (first block of a Swin stage > 0)."""
        return self.model_type == "swin" and layer > 0 and any(
            st.first_layer == layer for st in self.swin_stages())

    # ------------------------------------------------------------- validation
    def validate(self) -> None:
        _need(self.model_type in BACKBONES, "--vision-backbone-type", self.model_type,
              f"choose one of {', '.join(BACKBONES)}")
        for name in ("img_h", "img_w", "patch_dim", "num_channels", "num_classes"):
            value = getattr(self, name)
            _need(isinstance(value, int) and value > 0, f"--{name.replace('_', '-')}", value,
                  "must be a positive integer")
        for name in ("img_h", "img_w"):
            value = getattr(self, name)
            nearest = max(self.patch_dim, value // self.patch_dim * self.patch_dim)
            _need(value % self.patch_dim == 0, f"--{name.replace('_', '-')}", value,
                  f"must be divisible by --patch-dim={self.patch_dim}; use an image size that is "
                  f"a multiple of the patch size (e.g. {nearest}) or a patch size that divides "
                  f"it ({_divisors(value)})")
        _need(0.0 <= self.hidden_dropout < 1.0, "--hidden-dropout", self.hidden_dropout,
              "must be in [0, 1)")
        _need(0.0 <= self.attention_dropout < 1.0, "--attention-dropout", self.attention_dropout,
              "must be in [0, 1)")
        if self.model_type == "vit":
            self._validate_vit()
        else:
            self._validate_swin()

    def _validate_vit(self) -> None:
        for name in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size"):
            _need(getattr(self, name) > 0, f"--{name.replace('_', '-')}", getattr(self, name),
                  "must be a positive integer")
        _need(self.hidden_size % self.num_attention_heads == 0, "--hidden-size", self.hidden_size,
              f"must be divisible by --num-attention-heads={self.num_attention_heads}")

    def _validate_swin(self) -> None:
        depths, heads = self.swin_depths, self.swin_num_heads
        _need(len(depths) >= 1 and all(isinstance(d, int) and d > 0 for d in depths),
              "--swin-depths", ",".join(map(str, depths)), "give positive block counts, e.g. 2,2,6,2")
        _need(len(heads) == len(depths), "--swin-num-heads", ",".join(map(str, heads)),
              f"give one head count per stage ({len(depths)} stages in --swin-depths)")
        _need(self.swin_embed_dim > 0, "--swin-embed-dim", self.swin_embed_dim,
              "must be a positive integer")
        _need(self.swin_window_size > 0, "--swin-window-size", self.swin_window_size,
              "must be a positive integer")
        _need(self.swin_mlp_ratio > 0, "swin_mlp_ratio", self.swin_mlp_ratio,
              "must be a positive integer")
        gh, gw = self.grid
        for s in range(len(depths)):
            width = self.swin_embed_dim * 2 ** s
            _need(heads[s] > 0 and width % heads[s] == 0, "--swin-num-heads",
                  ",".join(map(str, heads)),
                  f"stage {s + 1} has width {width} (--swin-embed-dim x 2^{s}), which its "
                  f"{heads[s]} heads must divide; choose a head count that divides {width}")
            if s < len(depths) - 1:
                _need(gh % 2 == 0 and gw % 2 == 0, "--img-h", self.img_h,
                      f"stage {s + 1}'s {gh}x{gw} feature map cannot be patch-merged (odd side); "
                      f"use --img-h/--img-w divisible by --patch-dim x 2^{len(depths) - 1}")
            window = self.swin_window_size
            if min(gh, gw) > window:
                _need(gh % window == 0 and gw % window == 0, "--swin-window-size", window,
                      f"must divide stage {s + 1}'s {gh}x{gw} feature map (--img-h {self.img_h} "
                      f"x --img-w {self.img_w} / --patch-dim {self.patch_dim} / 2^{s}); choose "
                      f"one of {_divisors(_gcd(gh, gw))} or change the image size")
            else:
                small, large = min(gh, gw), max(gh, gw)
                _need(large % small == 0, "--swin-window-size", window,
                      f"covers stage {s + 1}'s {gh}x{gw} feature map, whose sides must then be "
                      f"multiples of each other; use a square image or a smaller window")
            gh, gw = gh // 2, gw // 2

    def check_layer_tensor_parallel(self, layer: int, tp: int, what: str) -> None:
        """Raise ``ConfigError`` unless TP degree ``tp`` splits layer ``layer`` (heads, FFN)."""
        _, _, heads, ffn = self.layer_shape(layer)
        if tp < 1 or heads % tp or ffn % tp:
            flag = "--num-attention-heads" if self.model_type == "vit" else "--swin-num-heads"
            raise ConfigError(f"{what}={tp}: must divide layer {layer}'s {heads} heads ({flag}) "
                              f"and FFN size {ffn}; use a TP degree that divides both")

    def check_tensor_parallel(self, tp: int, what: str = "--tensor-model-parallel-size") -> None:
        """Raise ``ConfigError`` unless ``tp`` splits every layer (a uniform plan)."""
        for layer in range(self.num_layers):
            self.check_layer_tensor_parallel(layer, tp, what)

    def check_vocab_parallel(self, tp: int, what: str = "vocab tp") -> None:
        """Patch embedding and head are replicated over the vocab TP group: any degree works."""
        if tp < 1:
            raise ConfigError(f"{what}={tp}: must be a positive integer")

    # ------------------------------------------------------------- counts
    def num_parameters(self) -> int:
        """All parameters (weights, biases, norms, class token, position table)."""
        emb = self.patch_size_flat * self.embedding_hidden_size + self.embedding_hidden_size
        if self.model_type == "vit":
            emb += self.hidden_size + self.seq_length * self.hidden_size
        else:
            emb += 2 * self.embedding_hidden_size  # patch norm
        layers = 0
        for i in range(self.num_layers):
            _, h, heads, f = self.layer_shape(i)
            layers += 4 * h * h + 4 * h + 2 * h * f + f + h + 4 * h
            if self.model_type == "swin":
                st = self.swin_stage_of_layer(i)
                layers += (2 * st.window - 1) ** 2 * heads
            if self.has_patch_merging(i):
                c = h // 2
                layers += 4 * c * 2 * c + 2 * 4 * c
        h = self.final_hidden_size
        return emb + layers + 2 * h + h * self.num_classes + self.num_classes

    def model_flops_per_token(self) -> float:
        """Forward + backward model FLOPs per embedded token (``seq_length`` tokens per image)."""
        return 3.0 * self.forward_flops_per_sample() / self.seq_length

    def forward_flops_per_sample(self) -> float:
        """Matrix-multiply FLOPs of one image's forward (window attention counted per window)."""
        total = 2.0 * self.num_patches * self.patch_size_flat * self.embedding_hidden_size
        for i in range(self.num_layers):
            seq, h, _, f = self.layer_shape(i)
            attended = seq
            if self.model_type == "swin":
                st = self.swin_stage_of_layer(i)
                attended = st.window * st.window
                if self.has_patch_merging(i):
                    total += 2.0 * seq * (2 * h) * h
            total += 2.0 * seq * (4 * h * h + 2 * h * f) + 4.0 * seq * attended * h
        return total + 2.0 * self.final_hidden_size * self.num_classes

    # ----------------------------------------------------------------- JSON
    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["swin_depths"] = list(self.swin_depths)
        out["swin_num_heads"] = list(self.swin_num_heads)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "VisionConfig":
        unknown, known = unknown_fields(cls, data)
        if unknown:
            raise ConfigError(f"vision model config: unknown field(s) {unknown}; known fields "
                              f"are {known}")
        return cls(**dict(data))


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a
