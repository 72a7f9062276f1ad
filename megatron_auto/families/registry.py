"""The one registry of model families: which families exist and how to find a model's family.

Built in: ``gpt``, ``bert`` (``families/gpt/``), ``vit`` and ``swin`` (``families/vision/``),
``t5`` (``families/t5/``). A new family is one :class:`~.family.Family` record handed to
:func:`register_family` (docs/families.md): the CLI's ``--model-type`` choices, the planner's
model spec, ``--auto-parallel``'s profiling, checkpoints and the experiment grid all find it
here. Lookups go by name, the ``model_type`` every config and every recorded model carries:
:func:`get_family` (a name), :func:`family_of` (a config), :func:`config_from_record` (a plan's
``model`` or a checkpoint's record).

Importing this module imports no torch: a family's stage builder and profiler are references
resolved on use (``family.py``). Registration is process-wide and lasts until
:func:`unregister_family`; forked workers inherit it.
"""

from __future__ import annotations

from typing import Any, Mapping

from ..planner.inputs.model_spec import ModelSpec
from .family import Family, FamilyError
from .gpt.family import FAMILIES as _GPT_FAMILIES
from .t5.family import FAMILIES as _T5_FAMILIES
from .vision.family import FAMILIES as _VISION_FAMILIES

#: The family of a record that names none: ``ModelConfig``'s default ``model_type``.
DEFAULT_FAMILY = "gpt"

_FAMILIES: dict[str, Family] = {}


def register_family(family: Family, *, replace: bool = False) -> Family:
    """Add ``family`` (``replace``: in place of one of the same name); returns it."""
    if not isinstance(family, Family):
        raise FamilyError(f"register_family: got a {type(family).__name__}; pass a "
                          f"megatron_auto.families.family.Family")
    if family.name in _FAMILIES and not replace:
        raise FamilyError(f"family {family.name!r} is registered already; choose another name "
                          f"or pass replace=True")
    _FAMILIES[family.name] = family
    return family


def unregister_family(name: str) -> None:
    """Remove the family ``name`` (a test's own family, say); the built-ins stay removable too."""
    _FAMILIES.pop(name, None)


def family_names() -> tuple[str, ...]:
    """Registered family names, in registration order (built-ins first)."""
    return tuple(_FAMILIES)


def families() -> tuple[Family, ...]:
    return tuple(_FAMILIES.values())


def get_family(name: str) -> Family:
    """The family ``name``; ``FamilyError`` naming the registered ones otherwise."""
    try:
        return _FAMILIES[name]
    except (KeyError, TypeError):
        raise FamilyError(f"model_type={name!r}: no such model family; registered: "
                          f"{', '.join(_FAMILIES)}") from None


def family_of(config: Any) -> Family:
    """The family of ``config`` (by its ``model_type``), which must be of its config class."""
    family = get_family(str(getattr(config, "model_type", None)))
    if not isinstance(config, family.config_class):
        raise FamilyError(f"model_type={config.model_type!r}: family {family.name} takes a "
                          f"{family.config_class.__name__}, not a {type(config).__name__}")
    return family


def family_of_record(record: Mapping[str, Any]) -> Family:
    """The family a recorded model (plan ``model``, checkpoint ``model``) names."""
    return get_family(record.get("model_type", DEFAULT_FAMILY))


def config_from_record(record: Mapping[str, Any]) -> Any:
    """The config a recorded model describes, read by its family's config class."""
    return family_of_record(record).config_from_dict(record)


def model_spec(config: Any) -> ModelSpec:
    """The planner's :class:`ModelSpec` of ``config`` (its family's builder)."""
    return family_of(config).model_spec(config)


def spec_of_record(record: Mapping[str, Any]) -> ModelSpec:
    """The :class:`ModelSpec` of a recorded model (what ``calibrate`` prices plans with)."""
    return model_spec(config_from_record(record))


# The order of --model-type's choices and of the families' flag groups in --help (the vision
# flags, then T5's, as before the registry).
for _family in (*_GPT_FAMILIES, *_VISION_FAMILIES, *_T5_FAMILIES):
    register_family(_family)
del _family
