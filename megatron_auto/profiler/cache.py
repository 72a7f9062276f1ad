"""On-disk cache of measured model profiles, keyed by everything that changes the numbers.

A profile measured once for (device, precision, layer shape, sequence length, torch version,
profiler settings) is reused by every later run with the same key. The directory is
``cache_dir`` when given, else ``$MEGATRON_AUTO_CACHE``, else ``~/.cache/megatron_auto/profiles``.
Files are named ``<device>_<precision>_h<h>_a<heads>_s<seq>_<hash>.json`` (readable, and unique
through the hash of the full key); the key is stored in the profile's metadata and compared in
full on load, so a hash collision or a hand-edited file is never taken for a match.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any, Mapping

from ..planner.inputs.profile_records import ProfileError
from ..planner.inputs.profiles import ModelProfile

CACHE_ENV = "MEGATRON_AUTO_CACHE"
KEY_FIELD = "cache_key"


def default_cache_dir() -> Path:
    """``$MEGATRON_AUTO_CACHE`` or ``~/.cache/megatron_auto/profiles``."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "megatron_auto" / "profiles"


def _slug(text: Any) -> str:
    return re.sub(r"[^a-z0-9]+", "-", str(text).lower()).strip("-") or "x"


def cache_path(key: Mapping[str, Any], cache_dir: str | os.PathLike | None = None) -> Path:
    """Where the profile for ``key`` lives (the file may not exist yet)."""
    folder = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    digest = hashlib.sha256(json.dumps(dict(key), sort_keys=True).encode()).hexdigest()[:12]
    model = key.get("model", {})
    name = (f"{_slug(key.get('device', 'device'))}_{_slug(key.get('precision', ''))}"
            f"_h{model.get('hidden_size', 0)}_a{model.get('num_attention_heads', 0)}"
            f"_s{model.get('seq_length', 0)}_{digest}.json")
    return folder / name


def load_cached(key: Mapping[str, Any],
                cache_dir: str | os.PathLike | None = None) -> ModelProfile | None:
    """The cached profile for ``key``, or None (absent, unreadable or for another key).

    A damaged cache file is treated as a miss (it is re-measured and overwritten), never as
    an error: the cache is an optimisation.
    """
    path = cache_path(key, cache_dir)
    if not path.is_file():
        return None
    try:
        profile = ModelProfile.load(path)
    except ProfileError:
        return None
    stored = profile.metadata.get(KEY_FIELD)
    if json.dumps(stored, sort_keys=True) != json.dumps(dict(key), sort_keys=True):
        return None
    return profile


def store(profile: ModelProfile, key: Mapping[str, Any],
          cache_dir: str | os.PathLike | None = None) -> Path:
    """Write ``profile`` (its metadata must carry ``key``) atomically; returns the path.

    Atomic (temporary file + rename) so that ranks or jobs sharing a cache never read half a
    file.
    """
    if json.dumps(profile.metadata.get(KEY_FIELD), sort_keys=True) != \
            json.dumps(dict(key), sort_keys=True):
        raise ValueError("store: the profile's metadata['cache_key'] must equal the key it is "
                         "stored under")
    path = cache_path(key, cache_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    profile.save(path)  # ModelProfile.save writes atomically (jsonfile.write_json)
    return path
