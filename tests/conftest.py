"""Test tiers (pytest.ini registers the markers; README "Development" shows the commands).

Every test carries exactly one tier marker, ``pure``, ``single`` or ``multirank`` (a module's
``pytestmark`` or a marker on the test), so that ``pytest -m "pure and not exhaustive"`` runs
the torch-free tests in seconds and nothing is left out of a tier by accident. ``exhaustive``
comes on top of ``pure`` for the whole-search enumerations.
"""

from __future__ import annotations

import pytest

TIERS = ("pure", "single", "multirank")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    wrong = []
    for item in items:
        tiers = sorted({m.name for m in item.iter_markers() if m.name in TIERS})
        if len(tiers) != 1:
            wrong.append(f"{item.nodeid}: {tiers or 'no tier'}")
    if wrong:
        raise pytest.UsageError(
            "every test needs exactly one tier marker (pure, single or multirank; see "
            "tests/conftest.py):\n  " + "\n  ".join(wrong))


@pytest.fixture(scope="session", autouse=True)
def _cache_inside_the_session(tmp_path_factory: pytest.TempPathFactory):
    """Point the package's cache (profiles, the embedded corpus, dataset indices) at a directory
    of this session, so that no test reads or writes the user's ``~/.cache/megatron_auto`` or
    another run's cache: a fresh clone and a developer's checkout run the same tests. Forked
    ranks and subprocesses inherit it; a test that needs its own cache sets it itself."""
    import os

    saved = os.environ.get("MEGATRON_AUTO_CACHE")
    os.environ["MEGATRON_AUTO_CACHE"] = str(tmp_path_factory.mktemp("megatron_auto_cache"))
    yield
    if saved is None:
        os.environ.pop("MEGATRON_AUTO_CACHE", None)
    else:
        os.environ["MEGATRON_AUTO_CACHE"] = saved


@pytest.fixture(autouse=True)
def _package_logger_restored():
    """Put the package logger back as it was after each test.

    ``setup_logging`` (called by every entry point a test runs in-process) attaches a handler
    to the stream that is ``sys.stdout`` at that moment, which under pytest is the test's own
    capture; a later test logging through it writes to a closed stream and gets a logging error
    on its stderr instead of its own output."""
    import logging

    logger = logging.getLogger("megatron_auto")
    saved = (list(logger.handlers), logger.level, logger.propagate)
    yield
    logger.handlers[:] = saved[0]
    logger.setLevel(saved[1])
    logger.propagate = saved[2]
