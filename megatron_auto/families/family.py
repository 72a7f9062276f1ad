"""What a model family gives the rest of the package: the :class:`Family` record.

A family is one kind of model (``gpt``, ``bert``, ``t5``, ``vit``, ``swin``, or one a user
registers). Its name is the ``model_type`` its configs carry, so any config, plan model record
or checkpoint record names its family. Everything outside ``families/`` that depends on the
kind of model asks the family (:mod:`.registry` finds it) instead of testing the config's type:

- the planner's view: :attr:`Family.model_spec` (config -> :class:`ModelSpec`, with as many
  layer types as the family has; new kinds of layer are new layer types of its spec, with no
  dispatch elsewhere);
- the command line: :attr:`Family.add_flags` (its own ``megatron-auto`` flags) and
  :attr:`Family.from_flags` (the parsed flags -> its config);
- the runtime: :attr:`Family.stage` (this rank's pipeline stage) and what the stage supports
  (:attr:`Family.sequence_parallel`, :attr:`Family.interleaved`);
- measuring: :attr:`Family.profiler`;
- checkpoints: :attr:`Family.checkpoint_fields` (the fields a checkpoint must agree on, each
  with the flag that sets it) and the config's ``to_dict`` / ``from_dict`` (what a checkpoint
  and a plan record of the model);
- Hugging Face conversion: :attr:`Family.hf_architectures`; Hugging Face configs
  (``--hf-config``): :attr:`Family.hf_model_types` and :attr:`Family.hf_config`;
- the experiment grid's ``--run``: :attr:`Family.entry_script` and :attr:`Family.script_flags`
  (the entry script's model flags of a config).

Torch stays out: the stage builder and the profiler live above the planner (in ``models/`` and
``profiler/``, which import torch), so a family names them by reference, a ``"module:attribute"``
string that :func:`resolve` imports on first use (:meth:`Family.build_stage`,
:meth:`Family.resolve_profiler`); a family defined outside the package (a test, a user's
module) may give the callable or object itself. Those references are the only edges from this
package to the layers above it: an import that runs when a stage is built or a model measured,
never when the registry is imported, so the planning commands stay torch-free.

The config class of a family must offer what the planner and runtime read of every model
(:class:`FamilyConfig`): ``model_type``, ``num_layers``, ``seq_length``, ``to_dict()`` and the
classmethod ``from_dict(record)`` (a plan's or checkpoint's record back into the config), and
``check_tensor_parallel(tp, what)`` / ``check_vocab_parallel(tp, what)`` (or per layer
``check_layer_tensor_parallel(layer, tp, what)``) raising ``ValueError`` for a TP degree the
model cannot take.
"""

from __future__ import annotations

import argparse
import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Protocol

from ..planner.inputs.model_spec import ModelSpec


class FamilyError(ValueError):
    """An unknown family, or a family record that cannot work; the message says which and why."""


class FamilyConfig(Protocol):
    """What the package reads of every family's config (see the module docstring)."""

    model_type: str
    num_layers: int
    seq_length: int

    def to_dict(self) -> dict[str, Any]: ...

    def check_tensor_parallel(self, tp: int, what: str = ...) -> None: ...

    def check_vocab_parallel(self, tp: int, what: str = ...) -> None: ...


#: ``(config, ctx, seed=...) -> nn.Module``: this rank's stage of ``config`` under the
#: ``ParallelContext`` ``ctx`` (only the stage's layers, named by the plan-independent scheme).
StageBuilder = Callable[..., Any]


def flags_of(config: Any, flags: Mapping[str, str]) -> list[str]:
    """``[flag, str(config.<field>), ...]`` for each ``flag: field`` of ``flags`` (a family's
    :attr:`Family.script_flags`)."""
    return [item for flag, name in flags.items() for item in (flag, str(getattr(config, name)))]


def resolve(ref: Any, what: str) -> Any:
    """``ref`` itself, or the attribute a ``"package.module:attribute"`` string names (imported
    now; the import is the point: it runs only when the part is used)."""
    if not isinstance(ref, str):
        return ref
    module, sep, attribute = ref.partition(":")
    if not sep or not module or not attribute:
        raise FamilyError(f"{what}={ref!r}: name it as 'package.module:attribute'")
    try:
        return getattr(importlib.import_module(module), attribute)
    except (ImportError, AttributeError) as err:
        raise FamilyError(f"{what}={ref!r}: cannot be imported ({err})") from None


@dataclass(frozen=True)
class Family:
    """One model family (module docstring). Frozen: register a new record to change one.

    ``name`` is the ``model_type`` of its configs; ``config_class`` the class of those configs
    (several families may share one, e.g. GPT and BERT share ``ModelConfig``: their checkpoints
    then load into each other's runs up to the ``checkpoint_fields``). ``model_spec`` turns a
    config into the planner's :class:`ModelSpec`, whose ``config`` is the plan's ``model``
    record (the fields that decide the costs). ``from_flags(args, defaults)`` builds a config
    from the ``megatron-auto`` flags (``defaults``: every model flag's parser default, to tell
    a flag left alone from one given). ``stage``: the :data:`StageBuilder` or its reference.
    ``profiler``: an object with ``measure(config, precision, device, *, config=settings,
    seed=..., barrier=None)`` and ``cache_key(config, precision, device, settings)`` (the
    profiler's ``FamilyProfiler``), or its reference; ``None``: the model is priced with the
    analytic profile only. ``noun`` names the model in messages ("a vit classifier").
    ``script_flags(config)``: the model flags of ``entry_script`` that build ``config``;
    ``script_only_flags``: those of them (each with one value) that ``megatron-auto`` does not
    take, since it names the family with ``--model-type`` instead. ``hf_model_types``: the
    Hugging Face ``model_type`` values of the configs this family reads for ``--hf-config``,
    with ``hf_config(reader)`` filling a ``families.hf_config.HFReader`` with the flag values.
    """

    name: str
    config_class: type
    model_spec: Callable[[Any], ModelSpec]
    from_flags: Callable[[argparse.Namespace, Mapping[str, Any]], Any]
    stage: StageBuilder | str
    profiler: Any = None
    add_flags: Callable[[argparse.ArgumentParser], None] | None = None
    help: str = ""
    noun: str = ""
    checkpoint_fields: Mapping[str, str] = field(default_factory=dict)
    sequence_parallel: bool = False
    interleaved: bool = False
    hf_architectures: tuple[str, ...] = ()
    entry_script: str | None = None
    script_flags: Callable[[Any], list[str]] | None = None
    script_only_flags: tuple[str, ...] = ()
    hf_model_types: tuple[str, ...] = ()
    hf_config: Callable[[Any], None] | None = None

    def __post_init__(self) -> None:
        if not self.name or not self.name.isidentifier():
            raise FamilyError(f"family name={self.name!r}: use a short identifier (it is the "
                              f"configs' model_type and the value of --model-type)")
        if not callable(getattr(self.config_class, "from_dict", None)):
            raise FamilyError(f"family {self.name}: config_class {self.config_class.__name__} "
                              f"has no from_dict; plans and checkpoints need it to read the "
                              f"model back")

    @property
    def label(self) -> str:
        """How messages name a model of this family."""
        return self.noun or self.name

    def config_from_dict(self, record: Mapping[str, Any]) -> Any:
        """The family's config from a plan's or checkpoint's model record."""
        return getattr(self.config_class, "from_dict")(record)  # checked in __post_init__

    def build_stage(self, config: Any, ctx: Any, seed: int = 1234) -> Any:
        """This rank's stage of ``config`` (a training script's model provider)."""
        return resolve(self.stage, f"family {self.name}: stage")(config, ctx, seed=seed)

    def cli_flags(self, config: Any) -> list[str]:
        """The ``megatron-auto`` model flags of ``config`` (``--model-type`` first)."""
        if self.script_flags is None:
            raise FamilyError(f"family {self.name}: no script_flags, so no command line is known "
                              f"for its configs")
        flags, out = self.script_flags(config), ["--model-type", self.name]
        i = 0
        while i < len(flags):
            if flags[i] in self.script_only_flags:
                i += 2
                continue
            out.append(flags[i])
            i += 1
        return out

    def resolve_profiler(self) -> Any:
        """The family's profiler, or ``None`` when it has none (analytic profiles only)."""
        if self.profiler is None:
            return None
        return resolve(self.profiler, f"family {self.name}: profiler")
