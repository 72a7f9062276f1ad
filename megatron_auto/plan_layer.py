"""One layer's and the vocabulary's strategy in a plan (``layers[i]`` and ``vocab``), with their
JSON form; ``plan.Plan`` validates them against each other and the world."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from .plan_errors import PlanError
from .plan_errors import need as _need
from .plan_offload import OffloadValue, normalize_offload, offload_parts
from .plan_recompute import RecomputeValue, normalize_recompute, recompute_parts

# The keys of a ``layers[i]`` entry.
LAYER_KEYS = ("tp", "dp_mode", "tp_consecutive", "recompute", "sequence_parallel", "cp",
              "cp_mode", "ep", "expert_tp", "expert_dp_mode", "offload")


def int_field(data: Mapping[str, Any], key: str, where: str) -> int:
    if key not in data:
        raise PlanError(f"plan field {where}{key} is missing: add it (an integer)")
    value = data[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise PlanError(f"plan field {where}{key}={value!r}: must be an integer")
    return value


@dataclass(frozen=True)
class LayerStrategy:
    """How one transformer layer is parallelised inside its pipeline stage."""

    tp: int = 1
    dp_mode: str = "ddp"
    tp_consecutive: bool = True
    # bool (whole layer or nothing), "selective" or a tuple of RECOMPUTE_MODULES: always the
    # canonical form of normalize_recompute (the constructor converts).
    recompute: RecomputeValue = False
    # Megatron-SP over this layer's TP group (needs tp > 1): norms, dropout and residuals keep
    # the activation split along the sequence.
    sequence_parallel: bool = False
    # Context parallelism: the sequence split over ``cp`` ranks (one degree per plan) and the
    # attention's communication (CP_MODES; may differ per layer).
    cp: int = 1
    cp_mode: str = "ring"
    # MoE layers only (docs/design.md §4): the experts split over ``ep`` ranks of the layer's
    # DP group, each expert TP-split over ``expert_tp`` ranks of its TP group, the expert
    # parameters' DP flavour over the expert-DP group (dp / ep ranks); None: ``dp_mode``.
    ep: int = 1
    expert_tp: int = 1
    expert_dp_mode: str | None = None
    # Activation offload (plan_offload.py): False, True (all saved activations) or a tuple of
    # OFFLOAD_MODULES; always canonical (the constructor converts).
    offload: OffloadValue = False

    @property
    def experts_dp_mode(self) -> str:
        """The expert parameters' DP flavour (``expert_dp_mode``, default the layer's)."""
        return self.dp_mode if self.expert_dp_mode is None else self.expert_dp_mode

    def __post_init__(self) -> None:
        if self.recompute is not True and self.recompute is not False:
            object.__setattr__(self, "recompute", normalize_recompute(self.recompute))
        if self.offload is not True and self.offload is not False:
            object.__setattr__(self, "offload", normalize_offload(self.offload))

    @property
    def full_recompute(self) -> bool:
        """The whole layer re-runs in backward (keeps only its input)."""
        return self.recompute is True

    @property
    def recompute_modules(self) -> frozenset[str]:
        """The modules recomputed on their own (empty for none and for full)."""
        return recompute_parts(self.recompute)[1]

    @property
    def offload_modules(self) -> frozenset[str]:
        """The modules whose saved activations are offloaded on their own (empty for none and
        for the whole layer)."""
        return offload_parts(self.offload)[1]

    def to_dict(self) -> dict[str, Any]:
        recompute = self.recompute if not isinstance(self.recompute, tuple) \
            else list(self.recompute)
        out: dict[str, Any] = {"tp": self.tp, "dp_mode": self.dp_mode,
                               "tp_consecutive": self.tp_consecutive, "recompute": recompute}
        if self.sequence_parallel:  # absent = false: files without SP stay as they were
            out["sequence_parallel"] = True
        if self.cp != 1:  # absent = 1 / "ring": files without CP stay as they were
            out["cp"] = self.cp
        if self.cp_mode != "ring":
            out["cp_mode"] = self.cp_mode
        if self.ep != 1:  # the expert fields likewise: absent at their defaults
            out["ep"] = self.ep
        if self.expert_tp != 1:
            out["expert_tp"] = self.expert_tp
        if self.expert_dp_mode is not None:
            out["expert_dp_mode"] = self.expert_dp_mode
        if self.offload is not False:  # absent = false: files without offload stay as they were
            out["offload"] = self.offload if self.offload is True else list(self.offload)
        return out

    @classmethod
    def from_dict(cls, data: Any, where: str = "layers[?].") -> "LayerStrategy":
        if not isinstance(data, Mapping):
            raise PlanError(f"plan field {where[:-1]}={data!r}: must be an object like "
                            '{"tp": 1, "dp_mode": "ddp", "tp_consecutive": true, "recompute": false}')
        unknown = sorted(set(data) - set(LAYER_KEYS))
        _need(not unknown, where + "<keys>", unknown,
              f"unknown key(s); allowed: {', '.join(LAYER_KEYS)}")
        tp = int_field(data, "tp", where) if "tp" in data else 1
        dp_mode = data.get("dp_mode", "ddp")
        consec = data.get("tp_consecutive", True)
        recompute = normalize_recompute(data.get("recompute", False), where + "recompute")
        sp = data.get("sequence_parallel", False)
        _need(isinstance(consec, bool), where + "tp_consecutive", consec, "must be true or false")
        _need(isinstance(sp, bool), where + "sequence_parallel", sp, "must be true or false")
        cp = int_field(data, "cp", where) if "cp" in data else 1
        cp_mode = data.get("cp_mode", "ring")
        ep = int_field(data, "ep", where) if "ep" in data else 1
        expert_tp = int_field(data, "expert_tp", where) if "expert_tp" in data else 1
        return cls(tp=tp, dp_mode=dp_mode, tp_consecutive=consec, recompute=recompute,
                   sequence_parallel=sp, cp=cp, cp_mode=cp_mode, ep=ep, expert_tp=expert_tp,
                   expert_dp_mode=data.get("expert_dp_mode"), offload=normalize_offload(data.get("offload", False), where + "offload"))


@dataclass(frozen=True)
class VocabStrategy:
    """Layout of the embedding and LM head (first and last stage)."""

    tp: int = 1
    dp_mode: str = "ddp"

    def to_dict(self) -> dict[str, Any]:
        return {"tp": self.tp, "dp_mode": self.dp_mode}

    @classmethod
    def from_dict(cls, data: Any) -> "VocabStrategy":
        _need(isinstance(data, Mapping), "vocab", data, 'must be an object like {"tp": 1, "dp_mode": "ddp"}')
        unknown = sorted(set(data) - {"tp", "dp_mode"})
        _need(not unknown, "vocab.<keys>", unknown, "unknown key(s); allowed: tp, dp_mode")
        tp = int_field(data, "tp", "vocab.") if "tp" in data else 1
        return cls(tp=tp, dp_mode=data.get("dp_mode", "ddp"))

