"""What a family's Hugging Face config reader fills (``--hf-config``; families/hf_config.py).

:class:`HFReader` holds the file's fields and collects the flag values a family's
``hf_config`` function derives from them, the notes of cost-only substitutions and the checks
that need the merged flags. Here so that the family records can import it without the
registry (``hf_config.py`` looks the families up).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from ..config import ConfigError

#: A check on the merged flags (the file's values with the typed flags over them), for what
#: depends on both (a sliding window against the sequence length the run chooses).
MergedCheck = Callable[[argparse.Namespace], None]


class HFConfigError(ConfigError):
    """A config file that cannot be read, or a model we do not model; names the field."""


@dataclass
class HFReader:
    """What a family's ``hf_config`` function reads the file with: the file's fields, where it
    came from and what the values are for (``training``: a training script, which refuses the
    cost-only substitutions). The function fills :attr:`values` (argparse destination ->
    value), :attr:`keys` (destination -> the file's key, for messages), :attr:`notes` and
    :attr:`checks`."""

    config: Mapping[str, Any]
    where: str
    training: bool = False
    values: dict[str, Any] = field(default_factory=dict)
    keys: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    checks: list[MergedCheck] = field(default_factory=list)
    # destinations that only some entry points have (the vision script's backbone flag):
    # skipped where absent instead of refused
    optional: set[str] = field(default_factory=set)
    # destination -> the model feature it needs, for the message where no flag takes it
    features: dict[str, str] = field(default_factory=dict)

    def get(self, key: str, default: Any = None) -> Any:
        value = self.config.get(key, default)
        return default if value is None else value

    def set(self, dest: str, key: str, value: Any, *, optional: bool = False,
            feature: str | None = None) -> None:
        """Flag ``dest`` takes ``value``, read from the file's ``key`` (``optional``: only where
        the entry point has the flag; ``feature``: what a command without the flag lacks)."""
        self.values[dest] = value
        self.keys[dest] = key
        if optional:
            self.optional.add(dest)
        if feature:
            self.features[dest] = feature

    def take(self, dest: str, key: str, kind: type = int) -> None:
        """Flag ``dest`` takes the file's ``key`` when present: an integer (``kind=int``), a
        number (``float``) or a ``bool``."""
        value = self.config.get(key)
        if value is None:
            return
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if kind is bool:
            self.need(isinstance(value, bool), key, value, "must be true or false")
        elif kind is float:
            self.need(number, key, value, "must be a number")
            value = float(value)
        else:
            self.need(number and float(value).is_integer() and value > 0, key, value,
                      "must be a positive integer")
            value = int(value)
        self.set(dest, key, value)

    def error(self, key: str, value: Any, why: str) -> HFConfigError:
        return HFConfigError(f"--hf-config={self.where}: {key}={value!r}: {why}")

    def need(self, ok: bool, key: str, value: Any, why: str) -> None:
        """Refuse the file unless ``ok``: ``key=value`` is something we do not model."""
        if not ok:
            raise self.error(key, value, why)

    def cost_only(self, ok: bool, key: str, value: Any, ours: str) -> None:
        """Unless ``ok``, ``key=value`` differs from our model only in numerics priced the same
        (``ours`` says what we price instead): noted for planning, refused for training."""
        if ok:
            return
        if self.training:
            raise self.error(key, value, f"not in our models ({ours} is the closest, which "
                                         f"would train another model); change the config or "
                                         f"plan it with megatron-auto, which prices it as that")
        self.notes.append(f"{key}={value!r}: priced as {ours} (same cost; megatron_auto's "
                          f"models do not train it)")
