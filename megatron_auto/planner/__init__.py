"""megatron_auto.planner: the pure-computation planner (numpy only; no torch.distributed).

Public API of the planner core (docs/planner.md, docs/cost_model.md):

- model description: :class:`LayerType`, :class:`ModelSpec`, :class:`TrainingSpec`;
- profiles: :class:`LayerTypeProfile`, :class:`EmbeddingProfile`, :class:`ModelProfile`,
  :func:`analytic_profile`;
- search and pricing: :class:`SearchOptions`, :func:`search`, :class:`SearchResult`,
  :func:`evaluate`, :class:`Estimate`, :class:`InfeasibleError`, :data:`BASELINE_SPACES`.

Cluster descriptions (``hardware.py``, ``presets.py``) live beside it.
"""

from .cost_model import Estimate, StageEstimate
from .model_spec import LayerType, ModelSpec, SpecError, TrainingSpec
from .profiles import (EmbeddingProfile, LayerTypeProfile, ModelProfile, ProfileError,
                       analytic_profile)
from .search import InfeasibleError, SearchOptions, SearchResult, evaluate, search
from .spaces import BASELINE_SPACES

__all__ = [
    "BASELINE_SPACES", "EmbeddingProfile", "Estimate", "InfeasibleError", "LayerType",
    "LayerTypeProfile", "ModelProfile", "ModelSpec", "ProfileError", "SearchOptions",
    "SearchResult", "SpecError", "StageEstimate", "TrainingSpec", "analytic_profile", "evaluate",
    "search",
]
