"""megatron_auto.planner: the pure-computation planner (numpy only; no torch.distributed).

Public API of the planner core (docs/planner.md, docs/cost_model.md):

- model description: :class:`LayerType`, :class:`ModelSpec`, :class:`TrainingSpec`;
- profiles: :class:`LayerTypeProfile`, :class:`EmbeddingProfile`, :class:`ModelProfile`,
  :func:`analytic_profile`;
- search and pricing: :class:`SearchOptions`, :func:`search`, :class:`SearchResult`,
  :func:`evaluate`, :class:`Estimate`, :class:`InfeasibleError`, :data:`BASELINE_SPACES`.

Sub-packages by concern: ``inputs/`` (model spec, profiles, clusters and presets), ``cost/``
(the cost model), ``search/`` (spaces, tasks, the exact search and its driver), ``interop/``
(Galvatron and Megatron-LM formats); ``report.py`` (plan reports) and ``calibrate.py`` (fitting the
cost model's terms to measured runs) sit at the top.
"""

from .cost.estimate import Estimate, StageEstimate
from .inputs.model_spec import LayerType, ModelSpec, SpecError, TrainingSpec
from .inputs.profile_records import EmbeddingProfile, LayerTypeProfile, ProfileError
from .inputs.profiles import ModelProfile, analytic_profile
from .search.driver import InfeasibleError, SearchOptions, SearchResult, evaluate, search
from .search.options import BASELINE_SPACES

__all__ = [
    "BASELINE_SPACES", "EmbeddingProfile", "Estimate", "InfeasibleError", "LayerType",
    "LayerTypeProfile", "ModelProfile", "ModelSpec", "ProfileError", "SearchOptions",
    "SearchResult", "SpecError", "StageEstimate", "TrainingSpec", "analytic_profile", "evaluate",
    "search",
]
