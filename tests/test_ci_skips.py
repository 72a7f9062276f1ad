""".ci/check_skips.py: a skip not in .ci/expected_skips.txt fails CI; the list stays valid."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.pure

REPO = Path(__file__).resolve().parents[1]


def _checker():
    spec = importlib.util.spec_from_file_location("check_skips", REPO / ".ci" / "check_skips.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _junit(tmp_path: Path, cases: list[tuple[str, str, str | None]]) -> Path:
    body = "".join(
        f'<testcase classname="{cls}" name="{name}">'
        + (f'<skipped type="pytest.skip" message="{reason}"/>' if reason else "")
        + "</testcase>" for cls, name, reason in cases)
    path = tmp_path / "junit.xml"
    path.write_text(f'<testsuites><testsuite name="pytest">{body}</testsuite></testsuites>')
    return path


def test_expected_skip_passes_and_any_other_fails(tmp_path, monkeypatch, capsys):
    check = _checker()
    monkeypatch.chdir(REPO)  # test ids are rebuilt from the files under the repository root
    cuda = ("tests.test_memory_meter", "test_cuda_peak_counts_what_the_iteration_allocates",
            "needs a CUDA device")
    assert check.main(["x", str(_junit(tmp_path, [cuda, ("tests.test_cli", "test_a", None)]))]) == 0
    # the same test skipped for another reason, or another test skipped, fails
    other_reason = cuda[:2] + ("tensorboard not installed",)
    assert check.main(["x", str(_junit(tmp_path, [other_reason]))]) == 1
    assert check.main(["x", str(_junit(tmp_path, [("tests.test_cli", "test_b", "no files")]))]) == 1
    out = capsys.readouterr()
    assert "(NOT EXPECTED) tests/test_cli.py::test_b: no files" in out.out
    assert "not in .ci/expected_skips.txt" in out.err


def test_every_expected_skip_names_an_existing_test():
    check = _checker()
    rules = check.expected_rules(REPO / ".ci" / "expected_skips.txt")
    assert rules
    for test, reason in rules:
        path, _, name = test.partition("::")
        source = (REPO / path).read_text(encoding="utf-8")
        assert re.search(rf"def {re.escape(name.rstrip('*'))}", source), test
        assert reason and reason in source, (test, reason)  # the skip's own reason text
