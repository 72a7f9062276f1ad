"""Any family's model profile: measured by the family's profiler, cached (``cache.py``).

A family registers its profiler (``families/``) as a :class:`FamilyProfiler`: how to measure a
config and the cache key of a measurement. :func:`lookup_or_measure` serves every family from
the same cache: the cached profile of this (device, precision, model, torch, settings), or a
fresh measurement stored there. ``--auto-parallel``, ``megatron-auto profile-model`` and the
benchmarks call it with any family's config.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..families.registry import family_of
from ..parallel.device import resolve_device
from ..planner.inputs.profiles import ModelProfile
from . import cache as profile_cache
from .measure import MEASUREMENT_VERSION, Barrier, ModelProfilerConfig, device_name

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class FamilyProfiler:
    """A family's profiler: ``measure(model_config, precision, device, *, config=settings,
    seed=1234, barrier=None) -> ModelProfile`` (no cache; one process; ``barrier`` starts every
    timing round, for ranks that measure at once) and ``cache_key(model_config, precision,
    device, settings) -> dict`` (everything that changes the measured numbers)."""

    measure: Callable[..., ModelProfile]
    cache_key: Callable[..., dict[str, Any]]


@dataclass(frozen=True)
class ProfileLookup:
    """What :func:`lookup_or_measure` found: the profile, and whether it was measured now
    (False: served from the cache)."""

    profile: ModelProfile
    measured: bool


def profiler_of(model_config: Any) -> FamilyProfiler:
    """The profiler of ``model_config``'s family; ``ValueError`` when the family has none."""
    family = family_of(model_config)
    profiler = family.resolve_profiler()
    if profiler is None:
        raise ValueError(f"model_type={family.name}: the family registers no profiler; plan "
                         f"with the analytic profile (no --model-profile)")
    return profiler


def has_profiler(model_config: Any) -> bool:
    """Whether ``model_config``'s family can be measured (else it is priced analytically)."""
    return family_of(model_config).profiler is not None


def config_cache_key(cfg: Any, precision: str, device: str | torch.device | None,
                     config: ModelProfilerConfig) -> dict[str, Any]:
    """Cache key of a family profiled from its whole config (T5, ViT, Swin; see cache.py)."""
    dev = resolve_device(device)
    return {"measurement": MEASUREMENT_VERSION, "device": device_name(dev),
            "precision": precision, "torch": torch.__version__, "model": cfg.to_dict(),
            "batch_sizes": list(config.sizes(dev)), "iters": config.iters,
            "warmup_iters": config.warmup_iters}


def cache_key(model_config: Any, precision: str, device: str | torch.device | None,
              config: ModelProfilerConfig = ModelProfilerConfig()) -> dict[str, Any]:
    """The cache key of ``model_config``'s measurement (its family's)."""
    return profiler_of(model_config).cache_key(model_config, precision, device, config)


def measure_model(model_config: Any, precision: str = "fp32",
                  device: str | torch.device | None = None, *,
                  config: ModelProfilerConfig = ModelProfilerConfig(), seed: int = 1234,
                  barrier: Barrier = None) -> ModelProfile:
    """Measure ``model_config`` with its family's profiler (no cache)."""
    return profiler_of(model_config).measure(model_config, precision, device, config=config,
                                             seed=seed, barrier=barrier)


def lookup_or_measure(model_config: Any, precision: str = "fp32",
                      device: str | torch.device | None = None, cache_dir: str | None = None, *,
                      config: ModelProfilerConfig = ModelProfilerConfig(),
                      force: bool = False, barrier: Barrier = None) -> ProfileLookup:
    """The cached profile of ``model_config`` on this device, or a fresh measurement stored in
    the cache with its key. ``force`` re-measures and overwrites; ``barrier`` as for
    :func:`measure_model`.

    What the key holds is the family's choice: GPT and BERT leave out the number of layers
    (layers of one shape cost the same, so a 24- and a 48-layer model of the same width share
    one profile).
    """
    profiler = profiler_of(model_config)
    key = profiler.cache_key(model_config, precision, device, config)
    if not force:
        cached = profile_cache.load_cached(key, cache_dir)
        if cached is not None:
            logger.info("reusing cached model profile %s", profile_cache.cache_path(key, cache_dir))
            return ProfileLookup(cached, measured=False)
    profile = profiler.measure(model_config, precision, device, config=config, barrier=barrier)
    profile = dataclasses.replace(profile, metadata={**profile.metadata,
                                                     profile_cache.KEY_FIELD: key})
    path = profile_cache.store(profile, key, cache_dir)
    logger.info("stored model profile %s", path)
    return ProfileLookup(profile, measured=True)


def get_or_create_model_profile(model_config: Any, precision: str = "fp32",
                                device: str | torch.device | None = None,
                                cache_dir: str | None = None, *,
                                config: ModelProfilerConfig = ModelProfilerConfig(),
                                force: bool = False, barrier: Barrier = None) -> ModelProfile:
    """:func:`lookup_or_measure`'s profile (cached, or measured and stored)."""
    return lookup_or_measure(model_config, precision, device, cache_dir, config=config,
                             force=force, barrier=barrier).profile
