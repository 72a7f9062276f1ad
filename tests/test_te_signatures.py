"""The stand-ins of tests/te_standins.py have the real packages' signatures, where both exist.

tests/test_transformer_engine.py tests our Transformer Engine and apex wiring through CPU
stand-ins. They are only worth what their signatures are worth: a stand-in that accepts an
argument the real module does not (or defaults it differently) would let a wrong call pass.
Where ``transformer_engine`` (or ``apex``) imports, every stand-in is compared with the real
class or function, parameter by parameter:

- every parameter of the stand-in exists in the real signature, of the same kind (positional
  or keyword), unless the real one takes ``**kwargs``; the positional parameters come in the
  same order;
- every real parameter without a default is in the stand-in (a call the stand-in accepts
  gives the real one what it requires);
- where both give a plain default (None, bool, number, string), the defaults are equal.

So every call our layers make to a stand-in (a keyword it does not know is a TypeError there)
is a call the real module accepts, with the same meaning for what it leaves to the defaults.

Without the package the tests skip, saying so; .ci/expected_skips.txt lists those skips (CI
has neither package: Transformer Engine needs CUDA, apex is not on PyPI in a usable form).
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any, Callable

import pytest

import te_standins

pytestmark = pytest.mark.single

PLAIN = (type(None), bool, int, float, str)
# stand-in name -> (real module, attribute)
TE_NAMES = {
    "LayerNormLinear": ("transformer_engine.pytorch", "LayerNormLinear"),
    "Linear": ("transformer_engine.pytorch", "Linear"),
    "DotProductAttention": ("transformer_engine.pytorch", "DotProductAttention"),
    "fp8_autocast": ("transformer_engine.pytorch", "fp8_autocast"),
    "DelayedScaling": ("transformer_engine.common.recipe", "DelayedScaling"),
}
APEX_NAMES = {
    "FusedLayerNorm": ("apex.normalization", "FusedLayerNorm"),
    "FusedRMSNorm": ("apex.normalization", "FusedRMSNorm"),
}


def _import(module: str, absent: str) -> Any:
    """The real module, or a skip with the reason ``absent`` and the import's error (TE's
    import can raise errors other than ImportError, e.g. without CUDA)."""
    try:
        return importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - any failure to import means "not here"
        pytest.skip(f"{absent} ({type(exc).__name__}: "
                    f"{str(exc).splitlines()[0] if str(exc) else ''})")


def _signature(obj: Any) -> inspect.Signature:
    target = obj.__init__ if inspect.isclass(obj) else obj
    target = inspect.unwrap(target)
    sig = inspect.signature(target)
    params = [p for name, p in sig.parameters.items() if name != "self"]
    return sig.replace(parameters=params)


def signature_mismatches(standin: Callable, real: Callable) -> list[str]:
    """What in ``standin``'s signature the ``real`` one does not match (empty: none)."""
    ours, theirs = _signature(standin).parameters, _signature(real).parameters
    var_kw = any(p.kind is p.VAR_KEYWORD for p in theirs.values())
    problems = []
    for name, p in ours.items():
        if p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL):
            continue
        q = theirs.get(name)
        if q is None:
            if not var_kw:
                problems.append(f"{name}: not a parameter of the real one")
            continue
        if (p.kind is p.KEYWORD_ONLY) != (q.kind is q.KEYWORD_ONLY):
            problems.append(f"{name}: {p.kind.description} here, {q.kind.description} there")
        if (p.default is not p.empty and q.default is not q.empty
                and isinstance(p.default, PLAIN) and isinstance(q.default, PLAIN)
                and p.default != q.default):
            problems.append(f"{name}: default {p.default!r} here, {q.default!r} there")
    positional = lambda ps: [n for n, p in ps.items()  # noqa: E731
                             if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    mine, real_order = positional(ours), positional(theirs)
    if real_order[:len(mine)] != mine and not var_kw:
        problems.append(f"positional order {mine} here, {real_order[:len(mine)]} there")
    for name, q in theirs.items():
        if (q.default is q.empty and q.kind not in (q.VAR_KEYWORD, q.VAR_POSITIONAL)
                and name not in ours):
            problems.append(f"{name}: required by the real one, missing here")
    return problems


def test_signature_check_sees_a_wrong_standin() -> None:
    """The comparison itself, on made-up signatures (runs everywhere)."""
    def real(in_features: int, out_features: int, bias: bool = True, *, device: Any = None
             ) -> None: ...

    def same(in_features: int, out_features: int, bias: bool = True, *, device: Any = None
             ) -> None: ...

    def wrong(out_features: int, in_features: int, bias: bool = False, extra: int = 0,
              device: Any = None) -> None: ...

    assert signature_mismatches(same, real) == []
    problems = signature_mismatches(wrong, real)
    assert any("bias: default False here, True there" in p for p in problems)
    assert any("extra: not a parameter" in p for p in problems)
    assert any("device: positional or keyword here, keyword-only there" in p for p in problems)
    assert any("positional order" in p for p in problems)


def _check(names: dict[str, tuple[str, str]], absent: str) -> None:
    problems = []
    for standin_name, (module, attr) in names.items():
        real = getattr(_import(module, absent), attr)
        problems += [f"{standin_name}: {p}"
                     for p in signature_mismatches(getattr(te_standins, standin_name), real)]
    assert problems == [], "\n".join(problems)


def test_standins_have_transformer_engines_signatures() -> None:
    _check(TE_NAMES, "Transformer Engine does not import here")


def test_standins_have_apex_signatures() -> None:
    _check(APEX_NAMES, "apex does not import here")

