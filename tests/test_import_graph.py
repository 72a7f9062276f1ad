"""The package's import graph: no cycle, every import runs down the layers (docs/design.md §2).

The graph is read from every module's AST, so imports inside functions count as much as those at
the top (a function-level import that closes a cycle is still a cycle; it only hides it until
run time). Layers, bottom to top (docs/architecture.md):

    base         plan, layout, schedule, config,    pure: no torch, import only each other
                 run_config, arguments,             (arguments: argparse -> RunConfig, which
                 run_flag_checks,                   the entry points and training.pretrain use)
                 utils.* (jsonfile, atomicfile,
                 plots, progress,
                 output_paths, flag_warnings),      (a family's config and flags: the models
                 families.*.config and .flags and   read the configs)
                 the families packages' __init__s
    planner      planner.*                          pure (numpy): base only
    families     families.registry, .family,        the model-family registry and each
                 families.*.family                  family's record: pure, on the planner
                                                    (stage and profiler by reference)
    parallel     parallel.*                         torch runtime: base only
    data         data.*                             datasets and tokenizers: base only
    plan_inputs  planning, plan_source              pure: the planner's inputs and the plan
                                                    from flags or file, on the planner
    models       models.*                           on parallel
    profiler     profiler.*                         on models, parallel and the planner
    auto         auto                               joins the profiler and the planner
    training     training.*                         the loop, on everything below
    conversion   conversion.*                       checkpoints <-> Hugging Face, on training
    entry        cli, console, __main__,            the console script, on top
                 the package

planner and parallel sit side by side and never import each other; nothing imports upward.
A lazy (function-level) import of a package module must load something the module's own
top-level imports do not already load, and say in a comment on its line which heavy import it
avoids. A subprocess checks that the pure modules really import without torch.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = pytest.mark.pure

PACKAGE = "megatron_auto"
ROOT = Path(__file__).resolve().parent.parent / PACKAGE

# Top-level modules by layer; a module of a subpackage takes its package's layer.
TOP_LEVEL_LAYERS = {
    "plan": "base", "plan_cp": "base", "layout": "base", "schedule": "base", "config": "base",
    "plan_experts": "base", "plan_recompute": "base", "plan_errors": "base",
    "plan_offload": "base", "plan_optimizer_offload": "base", "plan_layer": "base",
    "expert_layout": "base",
    "run_config": "base",
    "planning": "plan_inputs", "plan_source": "plan_inputs",
    "arguments": "base", "plan_flags": "base", "run_flag_checks": "base", "auto": "auto", "cli": "entry",
    "cli_checks": "entry",
    "console": "entry", "__main__": "entry", "": "entry",
}
PACKAGE_LAYERS = {"utils": "base", "families": "families", "planner": "planner",
                  "parallel": "parallel", "data": "data", "models": "models",
                  "profiler": "profiler", "training": "training", "reproduce": "reproduce",
                  "conversion": "conversion"}
# families/ spans two layers: a family's plain data (its config and flags modules, and the
# package __init__s, which import nothing) is base, read by the models; the registry and the
# family records, which build the planner's model specs, are the families layer.
FAMILY_DATA_MODULES = ("config", "flags")
BELOW = {  # layer -> the layers it may import (besides its own)
    "base": set(),
    "planner": {"base"},
    "parallel": {"base"},
    "data": {"base"},
    "families": {"base", "planner"},
    "plan_inputs": {"base", "planner", "families"},
    # The experiment grid searches and prices (torch-free); --run launches the entry scripts
    # as subprocesses, never imports them.
    "reproduce": {"base", "planner", "families", "plan_inputs"},
    "models": {"base", "parallel"},
    "profiler": {"base", "parallel", "models", "planner", "families"},
    "auto": {"base", "parallel", "models", "planner", "families", "plan_inputs", "profiler"},
    "training": {"base", "parallel", "data", "models", "planner", "families", "plan_inputs",
                 "profiler", "auto"},
    "conversion": {"base", "parallel", "data", "models", "planner", "families", "plan_inputs",
                   "profiler", "auto", "training"},
    "entry": {"base", "parallel", "data", "models", "planner", "families", "plan_inputs",
              "profiler", "auto", "training", "reproduce", "conversion"},
}
TORCH_FREE_LAYERS = ("base", "planner", "families", "plan_inputs", "reproduce")
# Not a layer of their own but promised torch-free at import: the profiler's subcommands are
# registered by `megatron-auto`, whose planning commands must not pay for torch.
TORCH_FREE_EXTRA = ("profiler.cli",)

@dataclass(frozen=True)
class Import:
    source: str  # importing module, relative to the package ("" = the package itself)
    targets: tuple[str, ...]  # package modules it loads (relative), most specific last
    lazy: bool  # inside a function or method
    line: int
    comment: str  # the comment on the import's lines, if any
    third_party: str  # the top-level name when it imports outside the package, else ""


def _modules() -> dict[str, Path]:
    mods = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


MODULES = _modules()


def _absolute(module: str, node: ast.ImportFrom) -> str:
    """The package-relative name an ``ImportFrom`` names ("" = the package)."""
    if not node.level:
        name = node.module or ""
        if name == PACKAGE:
            return ""
        return name[len(PACKAGE) + 1:] if name.startswith(PACKAGE + ".") else "\0" + name
    base = module.split(".") if module else []
    if not MODULES[module].name == "__init__.py":
        base = base[:-1]
    base = base[:len(base) - (node.level - 1)] if node.level > 1 else base
    return ".".join(base + ([node.module] if node.module else []))


def _comment(lines: list[str], node: ast.stmt) -> str:
    """The comments on the statement's lines and on a comment line right above it."""
    first = node.lineno
    if first >= 2 and lines[first - 2].strip().startswith("#"):
        first -= 1
    text = [lines[i - 1] for i in range(first, (node.end_lineno or node.lineno) + 1)]
    return " ".join(line.split("#", 1)[1].strip() for line in text if "#" in line)


def _imports(module: str) -> list[Import]:
    source = MODULES[module].read_text(encoding="utf-8")
    lines = source.splitlines()
    out: list[Import] = []

    def visit(node: ast.AST, lazy: bool) -> None:
        for child in ast.iter_child_nodes(node):
            # `if TYPE_CHECKING:` imports never run: lazy like a function's
            inner = lazy or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) \
                or (isinstance(child, ast.If) and isinstance(child.test, ast.Name)
                    and child.test.id == "TYPE_CHECKING")
            if isinstance(child, ast.Import):
                for alias in child.names:
                    name = alias.name
                    if name == PACKAGE or name.startswith(PACKAGE + "."):
                        rel = name[len(PACKAGE) + 1:] if name != PACKAGE else ""
                        out.append(Import(module, _chain(rel), lazy, child.lineno,
                                          _comment(lines, child), ""))
                    else:
                        out.append(Import(module, (), lazy, child.lineno, _comment(lines, child),
                                          name.split(".")[0]))
            elif isinstance(child, ast.ImportFrom):
                base = _absolute(module, child)
                if base.startswith("\0"):
                    out.append(Import(module, (), lazy, child.lineno, _comment(lines, child),
                                      base[1:].split(".")[0]))
                    continue
                targets = list(_chain(base))
                for alias in child.names:
                    sub = f"{base}.{alias.name}" if base else alias.name
                    if sub in MODULES:
                        targets.append(sub)
                out.append(Import(module, tuple(dict.fromkeys(targets)), lazy, child.lineno,
                                  _comment(lines, child), ""))
            visit(child, inner)

    visit(ast.parse(source), False)
    return out


def _chain(name: str) -> tuple[str, ...]:
    """Importing ``a.b.c`` runs the package, ``a``, ``a.b`` and ``a.b.c``: the existing ones."""
    parts = name.split(".") if name else []
    return tuple(m for m in ("", *(".".join(parts[:k]) for k in range(1, len(parts) + 1)))
                 if m in MODULES)


IMPORTS = {m: _imports(m) for m in MODULES}


def _edges(*, lazy: bool = True) -> dict[str, set[str]]:
    """module -> package modules it imports, without the packages its own name runs through."""
    own = {m: set(_chain(m)) for m in MODULES}
    return {m: {t for imp in IMPORTS[m] if lazy or not imp.lazy for t in imp.targets
                if t != m and t not in own[m]} for m in MODULES}


def layer_of(module: str) -> str:
    head = module.split(".")[0]
    if "." in module or head in PACKAGE_LAYERS:
        if head not in PACKAGE_LAYERS:
            raise AssertionError(f"{PACKAGE}.{module}: package {head!r} is in no layer; add it "
                                 f"to PACKAGE_LAYERS in {Path(__file__).name}")
        if head == "families" and (module.split(".")[-1] in FAMILY_DATA_MODULES
                                   or MODULES[module].name == "__init__.py"):
            return "base"
        return PACKAGE_LAYERS[head]
    if module not in TOP_LEVEL_LAYERS:
        raise AssertionError(f"{PACKAGE}.{module}: module in no layer; add it to "
                             f"TOP_LEVEL_LAYERS in {Path(__file__).name} (docs/design.md §2)")
    return TOP_LEVEL_LAYERS[module]


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    comp.append(top)
                    if top == node:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def _name(module: str) -> str:
    return f"{PACKAGE}.{module}" if module else PACKAGE


def upward_imports(edges: dict[str, set[str]]) -> list[str]:
    bad = []
    for m, targets in sorted(edges.items()):
        for t in sorted(targets):
            lm, lt = layer_of(m), layer_of(t)
            if lt != lm and lt not in BELOW[lm]:
                bad.append(f"{_name(m)} ({lm}) -> {_name(t)} ({lt})")
    return bad


# --------------------------------------------------------------------------------- the tests
def test_every_module_is_in_a_layer():
    assert len(MODULES) > 50  # the walk found the package
    for m in MODULES:
        assert layer_of(m) in BELOW


def test_no_cycle():
    found = cycles(_edges())
    assert not found, "import cycles: " + "; ".join(" <-> ".join(map(_name, c)) for c in found)


def test_no_import_runs_against_the_layers():
    bad = upward_imports(_edges())
    assert not bad, "imports against the layers (docs/design.md §2):\n" + "\n".join(bad)


def test_the_planner_knows_no_model_family():
    # The family configs are base modules, but the planner plans ModelSpecs only: each family
    # builds its own (docs/families.md), so no planner module imports anything of families/.
    bad = [f"{_name(m)} -> {_name(t)}" for m, targets in sorted(_edges().items())
           if m.split(".")[0] == "planner" for t in sorted(targets)
           if t.split(".")[0] == "families"]
    assert not bad, "the planner imports model families: " + ", ".join(bad)


def test_the_checks_catch_a_cycle_and_an_upward_import():
    edges = {"plan": {"config"}, "config": {"planner.search"}, "planner.search": {"plan"},
             "parallel.context": {"planner.search"}}
    assert cycles(edges) == [["config", "plan", "planner.search"]]
    assert upward_imports(edges) == [
        f"{PACKAGE}.config (base) -> {PACKAGE}.planner.search (planner)",
        f"{PACKAGE}.parallel.context (parallel) -> {PACKAGE}.planner.search (planner)"]


def test_the_walk_sees_function_level_and_relative_imports():
    # profiler.cli imports the hardware profiler only inside a handler, relatively.
    lazy = {t for imp in IMPORTS["profiler.cli"] if imp.lazy for t in imp.targets}
    assert "profiler.hardware_profiler" in lazy
    assert "profiler.hardware_profiler" not in _edges(lazy=False)["profiler.cli"]
    assert "profiler.hardware_profiler" in _edges()["profiler.cli"]


def test_pure_layers_never_import_torch():
    # The pure layers not even in a function; the extras not at import time.
    bad = [f"{_name(m)} line {imp.line}" for m in MODULES for imp in IMPORTS[m]
           if imp.third_party == "torch"
           and (layer_of(m) in TORCH_FREE_LAYERS or (m in TORCH_FREE_EXTRA and not imp.lazy))]
    assert not bad, "torch imported by a pure module: " + ", ".join(bad)


def _closure(start: str, edges: dict[str, set[str]]) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        m = todo.pop()
        for t in edges.get(m, ()):
            for loaded in _chain(t):
                if loaded not in seen:
                    seen.add(loaded)
                    todo.append(loaded)
    return seen


def _lazy_import_problems(modules: list[str]) -> list[str]:
    top = _edges(lazy=False)
    problems = []
    for m in modules:
        loaded = _closure(m, top) | set(_chain(m))
        for imp in IMPORTS[m]:
            if not imp.lazy:
                continue
            where = f"{MODULES[m].relative_to(ROOT.parent)}:{imp.line}"
            if imp.targets and set(imp.targets) <= loaded:
                problems.append(f"{where}: loads nothing new ({_name(imp.targets[-1])} is "
                                f"loaded by the module's top-level imports already)")
            elif not re.sub(r"noqa(:\s*[A-Z0-9, ]+)?", "", imp.comment).strip(" -:"):
                problems.append(f"{where}: function-level import without a comment saying "
                                f"which heavy import it avoids")
    return problems


def test_lazy_imports_load_something_new_and_say_what():
    problems = _lazy_import_problems(sorted(MODULES))
    assert not problems, "\n".join(problems)


def test_pure_modules_import_without_torch():
    pure = sorted(_name(m) for m in MODULES
                  if layer_of(m) in TORCH_FREE_LAYERS or m in TORCH_FREE_EXTRA)
    script = (
        "import importlib, json, sys\n"
        "bad = []\n"
        f"for name in {pure!r}:\n"
        "    importlib.import_module(name)\n"
        "    if 'torch' in sys.modules and not bad:\n"
        "        bad.append(name)\n"
        "print(json.dumps(bad))\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            cwd=ROOT.parent, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    first = json.loads(result.stdout.strip().splitlines()[-1])
    assert first == [], f"importing {first[0]} loads torch (the pure layers must not)"
    assert len(pure) > 20


def test_entry_scripts_stay_thin():
    # pretrain_*.py: model provider, forward step, datasets, then pretrain(). Flags are parsed
    # by arguments.py and the parallel runtime is the framework's: neither belongs here.
    scripts = sorted(ROOT.parent.glob("pretrain_*.py"))
    assert scripts
    for script in scripts:
        tree = ast.parse(script.read_text(encoding="utf-8"))
        names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
        for name in names:
            assert name != "argparse", f"{script.name} parses flags itself (arguments.py does)"
            assert not name.startswith(("torch.distributed", f"{PACKAGE}.parallel")), \
                f"{script.name} imports {name}: the runtime belongs in the package"
