"""Regenerate the module index of docs/architecture.md from the modules' own docstrings.

Every module of the package opens with a docstring whose first sentence says what it holds;
this script lists them, package by package, between the index markers of
docs/architecture.md, so the map of the code is never edited by hand and never misses a module
(tests/test_module_index.py fails when the committed index differs from what this writes).

    python tools/module_index.py            # rewrite the index in docs/architecture.md
    python tools/module_index.py --check    # exit 1 if it is out of date
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "architecture.md"
BEGIN = "<!-- module-index:begin (tools/module_index.py writes this part) -->"
END = "<!-- module-index:end -->"
_MAX_CHARS = 180


def first_sentence(docstring: str | None) -> str:
    """The docstring's first sentence on one line (its first paragraph if no full stop ends
    a sentence there), cut at ``_MAX_CHARS`` and with table pipes escaped."""
    if not docstring:
        return ""
    paragraph = " ".join(docstring.strip().split("\n\n")[0].split())
    match = re.search(r"^(.+?[.])(\s|$)", paragraph)
    text = match.group(1) if match else paragraph
    if len(text) > _MAX_CHARS:
        text = text[:_MAX_CHARS - 1].rstrip() + "…"
    return text.replace("|", "\\|")


def module_rows(package: Path) -> dict[str, list[tuple[str, str]]]:
    """``{package path: [(module file, first sentence), ...]}`` for every package under
    ``package``, in path order; ``__init__.py`` only where it has a docstring."""
    rows: dict[str, list[tuple[str, str]]] = {}
    for path in sorted(package.rglob("*.py")):
        doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
        if path.name == "__init__.py" and not doc:
            continue
        folder = path.parent.relative_to(package.parent).as_posix()
        rows.setdefault(folder, []).append((path.name, first_sentence(doc)))
    return rows


def render(package: Path) -> str:
    """The index: one table per package folder."""
    out = [BEGIN, ""]
    for folder, entries in module_rows(package).items():
        out += [f"### `{folder}/`", "", "| module | what it holds |", "|---|---|"]
        out += [f"| `{name}` | {summary} |" for name, summary in entries]
        out.append("")
    out.append(END)
    return "\n".join(out)


def updated(doc_text: str, index: str) -> str:
    """``doc_text`` with its index replaced (appended under a heading if it has none)."""
    if BEGIN in doc_text and END in doc_text:
        head, rest = doc_text.split(BEGIN, 1)
        return head + index + rest.split(END, 1)[1]
    return doc_text.rstrip("\n") + "\n\n## Module index\n\n" + index + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="exit 1 (and change nothing) if the index is out of date")
    args = parser.parse_args(argv)
    text = DOC.read_text(encoding="utf-8")
    new = updated(text, render(ROOT / "megatron_auto"))
    if args.check:
        if new != text:
            print(f"{DOC.relative_to(ROOT)}: module index out of date; run "
                  f"python tools/module_index.py", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(new, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
