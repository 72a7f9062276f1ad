"""The paper's experiment grid as data: models, clusters, memory budgets (docs/reproduce.md).

A *cell* is one (model, cluster, budget); every method of :mod:`.methods` is searched and priced
in every cell. The models are the workloads the Galvatron-BMW paper evaluates (BERT, T5, ViT,
Swin, GPT); each entry names where its shape comes from. What the paper does not state in the
material available to us (its global batch sizes, its exact T5 and ViT variants) is our choice,
stated in ``source`` and in docs/reproduce.md, and can be changed on the command line
(``--global-batch-size``, ``--search-batch-size``).

Pure (no torch): the simulated grid runs wherever the planner does.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from ..config import ModelConfig
from ..families.registry import family_of
from ..families.t5.config import T5Config
from ..families.vision.config import VisionConfig
from ..planner.inputs.model_spec import ModelSpec

#: Bumped whenever a cell's inputs or a record's meaning change: a results file written by
#: another version is refused instead of mixing incomparable numbers.
GRID_VERSION = 2

DEFAULT_CLUSTERS: tuple[str, ...] = ("a100-40g-1x8", "a100-40g-2x8")
#: GB (1e9 bytes) per device. 40 runs on the 40 GB clusters; 80 on a100-80g clusters only.
DEFAULT_BUDGETS: tuple[float, ...] = (8, 12, 16, 20, 40)
PAPER_BATCH = 128  # our choice where the paper's is not known (docs/reproduce.md)


class GridError(ValueError):
    """A bad grid selection (unknown model or cluster, non-positive budget): one line."""


@dataclass(frozen=True)
class GridModel:
    """One workload. ``config`` is the runtime's model description (a config of a registered
    model family: ``ModelConfig``, ``T5Config``, ``VisionConfig``), ``script`` the entry
    script that trains it (``--run``)."""

    name: str
    family: str  # bert | t5 | vit | swin | gpt
    source: str
    global_batch_size: int = PAPER_BATCH
    config: Any = None
    script: str = "pretrain_gpt.py"
    precision: str = "bf16"

    def spec(self) -> ModelSpec:
        assert self.config is not None  # every entry has one
        return family_of(self.config).model_spec(self.config)

    def flags(self) -> list[str]:
        """The entry script's model flags (Megatron's names) for this shape (its family's)."""
        script_flags = family_of(self.config).script_flags if self.config is not None else None
        if script_flags is None:
            raise GridError(f"model {self.name!r}: no training flags are known for it; it can "
                            f"be simulated but not run with --run")
        return script_flags(self.config)

    def cli_flags(self) -> list[str]:
        """The ``megatron-auto`` model flags for this shape (``--model-type`` first)."""
        self.flags()  # the same error when none are known
        return family_of(self.config).cli_flags(self.config)


def _gpt(name: str, layers: int, hidden: int, heads: int, source: str) -> GridModel:
    cfg = ModelConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                      seq_length=2048, vocab_size=50257, hidden_dropout=0.0,
                      attention_dropout=0.0)
    return GridModel(name=name, family="gpt", source=source + "; seq 2048, GPT-2 vocabulary",
                     config=cfg)


def _bert(layers: int) -> GridModel:
    cfg = dataclasses.replace(
        ModelConfig(num_layers=layers, hidden_size=1280, num_attention_heads=16, seq_length=512,
                    vocab_size=30522, hidden_dropout=0.0, attention_dropout=0.0),
        model_type="bert", num_tokentypes=2)
    return GridModel(name=f"bert-huge-{layers}", family="bert", script="pretrain_bert.py",
                     source="Galvatron-BMW paper: BERT-Huge, hidden 1280, 16 heads, seq 512; "
                            "vocabulary of BERT's uncased WordPiece (30522)", config=cfg)


def _vit(layers: int) -> GridModel:
    cfg = VisionConfig(model_type="vit", img_h=224, img_w=224, patch_dim=14, num_classes=1000,
                       num_layers=layers, hidden_size=1280, num_attention_heads=16)
    return GridModel(name=f"vit-huge-{layers}", family="vit", script="pretrain_vision_classify.py",
                     source="Galvatron-BMW paper: ViT-Huge, hidden 1280, 16 heads; patch 14 at "
                            "224x224 (ViT-H/14, Dosovitskiy et al. 2021), ImageNet's 1000 classes",
                     config=cfg)


def _swin(depth3: int) -> GridModel:
    depths = (2, 2, depth3, 2)
    cfg = VisionConfig(model_type="swin", img_h=224, img_w=224, patch_dim=4, num_classes=1000,
                       swin_embed_dim=320, swin_depths=depths, swin_num_heads=(10, 20, 40, 80),
                       swin_window_size=7)
    return GridModel(name=f"swin-huge-{sum(depths)}", family="swin",
                     script="pretrain_vision_classify.py",
                     source=f"Galvatron-BMW paper: Swin-Huge, embed 320, depths "
                            f"{'-'.join(map(str, depths))}, heads 10-20-40-80, window 7 "
                            f"(Galvatron 2.4's swin-huge-patch4-window7-224 has 2-2-42-2)",
                     config=cfg)


MODELS: dict[str, GridModel] = {m.name: m for m in [
    _bert(32), _bert(48),
    GridModel(name="t5-large", family="t5", script="pretrain_t5.py",
              source="Galvatron-BMW paper: T5-Large class; T5-Large's shape (Raffel et al. 2020): "
                     "24+24 layers, d_model 1024, 16 heads, d_ff 4096, vocabulary 32128; "
                     "encoder 512 / decoder 128 tokens as Megatron-LM's T5 example",
              config=T5Config(encoder_num_layers=24, decoder_num_layers=24, hidden_size=1024,
                              num_attention_heads=16, ffn_hidden_size=4096, seq_length=512,
                              decoder_seq_length=128, vocab_size=32128, hidden_dropout=0.0,
                              attention_dropout=0.0)),
    _vit(32), _vit(48), _swin(26), _swin(42),
    _gpt("gpt3-1.3b", 24, 2048, 16, "GPT-3 paper (Brown et al. 2020), Table 2.1: GPT-3 XL"),
    _gpt("gpt3-2.7b", 32, 2560, 32, "GPT-3 paper, Table 2.1: GPT-3 2.7B"),
    _gpt("gpt3-6.7b", 32, 4096, 32, "GPT-3 paper, Table 2.1: GPT-3 6.7B"),
    _gpt("gpt3-13b", 40, 5120, 40, "GPT-3 paper, Table 2.1: GPT-3 13B; d_model 5120 as Megatron-LM "
         "uses it (the paper's 5140 is not divisible by its 40 heads)"),
    _gpt("gpt3-175b", 96, 12288, 96, "GPT-3 paper, Table 2.1: GPT-3 175B"),
]}

#: Scaled-down models of the same families for the CPU smoke test of ``--run``.
TINY_MODELS: dict[str, GridModel] = {
    "gpt-tiny": GridModel(name="gpt-tiny", family="gpt", global_batch_size=8, precision="fp32",
                          source="ours: a 4-layer GPT small enough for 2 CPU ranks",
                          config=ModelConfig(num_layers=4, hidden_size=64, num_attention_heads=4,
                                             seq_length=32, vocab_size=512)),
    "bert-tiny": GridModel(name="bert-tiny", family="bert", global_batch_size=8,
                           precision="fp32", script="pretrain_bert.py",
                           source="ours: a 2-layer BERT small enough for 2 CPU ranks",
                           config=dataclasses.replace(
                               ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4,
                                           seq_length=32, vocab_size=512),
                               model_type="bert", num_tokentypes=2)),
}
ALL_MODELS: dict[str, GridModel] = {**MODELS, **TINY_MODELS}


@dataclass(frozen=True)
class Cell:
    model: str
    cluster: str
    budget_gb: float

    @property
    def key(self) -> str:
        return f"{self.model}@{self.cluster}@{self.budget_gb:g}GB"

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "cluster": self.cluster, "budget_gb": self.budget_gb}


def _names(text: str | Sequence[str] | None) -> list[str]:
    if text is None:
        return []
    items = text.split(",") if isinstance(text, str) else list(text)
    return [x.strip() for x in items if x.strip()]


def select_models(names: str | Sequence[str] | None) -> list[GridModel]:
    """Models by name (comma-separated); ``None`` = the paper's grid (not the tiny ones)."""
    chosen = _names(names)
    if not chosen:
        return list(MODELS.values())
    unknown = [n for n in chosen if n not in ALL_MODELS]
    if unknown:
        raise GridError(f"--models {','.join(unknown)}: unknown model; choose from "
                        f"{', '.join(ALL_MODELS)}")
    return [ALL_MODELS[n] for n in chosen]


def select_budgets(values: str | Sequence[float] | None) -> list[float]:
    """Budgets in GB; each must be a positive finite number."""
    if values is None:
        return list(DEFAULT_BUDGETS)
    out = []
    for item in _names([str(v) for v in values] if not isinstance(values, str) else values):
        try:
            value = float(item)
        except ValueError:
            raise GridError(f"--budgets {item!r}: not a number; give GB per device, e.g. "
                            f"--budgets 8,16") from None
        if not (value > 0 and value != float("inf")):
            raise GridError(f"--budgets {item}: must be a positive number of GB per device")
        out.append(value)
    if not out:
        raise GridError("--budgets: empty; give GB per device, e.g. --budgets 8,16")
    return out


def cells(models: Sequence[GridModel], clusters: Sequence[str], budgets: Sequence[float],
          device_memory_gb: Callable[[str], float]) -> list[Cell]:
    """Every (model, cluster, budget) with the budget within the cluster's device memory."""
    return [Cell(m.name, c, b) for m in models for c in clusters for b in budgets
            if b <= device_memory_gb(c) + 1e-9]
