"""tests/mutation_check.py stays runnable: each planted bug still finds its one snippet.

The mutation table quoted in test docstrings is re-measured by that script; a refactor that
moves or rewrites a snippet must update the mutation (this test names it) rather than leave a
check that silently no longer applies.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from mutation_check import MUTATIONS

pytestmark = pytest.mark.pure

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("mutation", MUTATIONS, ids=[m.name for m in MUTATIONS])
def test_snippet_occurs_once_and_tests_exist(mutation) -> None:
    text = (REPO / mutation.path).read_text(encoding="utf-8")
    assert text.count(mutation.old) == 1, f"{mutation.name}: snippet not unique in {mutation.path}"
    assert mutation.old != mutation.new
    assert (REPO / mutation.tests[0]).is_file(), mutation.tests[0]


def test_mutation_names_are_unique() -> None:
    names = [m.name for m in MUTATIONS]
    assert len(names) == len(set(names))
