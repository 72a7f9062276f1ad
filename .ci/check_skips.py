"""Fail when a test run skipped anything that .ci/expected_skips.txt does not list.

    python .ci/check_skips.py JUNIT_XML [EXPECTED_FILE]

Reads pytest's ``--junitxml`` report, prints every skip with its reason, and exits 1 when a
skip matches no line of the expected list (``file::name | reason substring``; a name ending in
``*`` is a prefix, covering parametrised cases).
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def expected_rules(path: Path) -> list[tuple[str, str]]:
    rules = []
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        test, _, reason = line.partition("|")
        rules.append((test.strip(), reason.strip()))
    return rules


def _test_id(case: ET.Element) -> str:
    """``tests/test_x.py::name`` (``::Class::name`` inside a class) from a junit testcase."""
    parts = case.get("classname", "").split(".")
    for cut in range(len(parts), 0, -1):  # the longest dotted prefix that is a file
        path = "/".join(parts[:cut]) + ".py"
        if Path(path).is_file():
            return "::".join([path, *parts[cut:], case.get("name", "")])
    return "::".join([*parts, case.get("name", "")])


def _allowed(test_id: str, reason: str, rules: list[tuple[str, str]]) -> bool:
    for test, needle in rules:
        name_ok = (test_id.startswith(test[:-1]) if test.endswith("*") else test_id == test)
        if name_ok and needle in reason:
            return True
    return False


def main(argv: list[str]) -> int:
    report = Path(argv[1])
    rules = expected_rules(Path(argv[2]) if len(argv) > 2
                           else Path(__file__).with_name("expected_skips.txt"))
    unexpected = []
    for case in ET.parse(report).getroot().iter("testcase"):
        skipped = case.find("skipped")
        if skipped is None:
            continue
        test_id = _test_id(case)
        reason = skipped.get("message", "") or (skipped.text or "")
        ok = _allowed(test_id, reason, rules)
        print(f"ci: skipped {'(expected)' if ok else '(NOT EXPECTED)'} {test_id}: {reason}")
        if not ok:
            unexpected.append(test_id)
    if unexpected:
        print(f"ci: {len(unexpected)} skip(s) not in .ci/expected_skips.txt; fix the cause "
              f"(a missing extra, file or tool) or list the skip there with the reason",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
