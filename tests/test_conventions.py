"""House conventions that ruff cannot check: every noqa comment says why the rule does not apply there, and no
module of the package outgrows one job."""

from __future__ import annotations

import io
import re
import tokenize
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHECKED = ("gpuscaler", "tests", "e2e", "bench", "dev", "image", "monitoring")
SKIPPED = (ROOT / "gpuscaler" / "generated",)

# A module past this many lines has grown a second job: split it by job (docs/architecture.md names each module's).
MAX_MODULE_LINES = 450

# A suppression as ruff reads it (any case, a space after the hash or not): codes separated by commas or spaces,
# then, in the house form, the reason.
NOQA = re.compile(r"#\s*(?i:noqa)(?::\s*(?P<codes>[A-Z]+[0-9]+(?:[\s,]+[A-Z]+[0-9]+)*))?(?P<rest>.*)")


def python_files() -> Iterator[Path]:
    """Every .py file of the checked folders, the generated code left out."""
    for folder in CHECKED:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if not any(path.is_relative_to(skipped) for skipped in SKIPPED):
                yield path


def unexplained(source: str) -> list[int]:
    """Lines of ``source`` whose noqa comment lacks the house form ``# noqa: CODE - why`` (codes, then a reason)."""
    lines = []
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type != tokenize.COMMENT:
            continue
        for match in NOQA.finditer(token.string):
            if not match.group("codes") or not re.search(r"\w", match.group("rest")):
                lines.append(token.start[0])
    return lines


@pytest.mark.parametrize(
    ("comment", "explained"),
    [
        ("# noqa: S311 - jitter, not a secret", True),
        ("# noqa: ASYNC220, B023 - started once, before anything is measured", True),
        ("# type: ignore[attr-defined]  # noqa: BLE001 - a watch must not end", True),
        ("# noqa", False),
        ("#noqa: E501", False),
        ("# NOQA: S311, B023 -", False),
        ("# noqa - no codes named", False),
    ],
)
def test_a_noqa_needs_its_codes_and_a_reason(comment: str, explained: bool) -> None:
    """The check passes a noqa that names its codes and says why, and flags one missing either."""
    assert unexplained(f"x = 1  {comment}\ny = '# noqa'\n") == ([] if explained else [1])


def test_every_noqa_says_why() -> None:
    """Every noqa comment in the package, tests, e2e, bench and dev names its codes and gives a reason after them."""
    found = [
        f"{path.relative_to(ROOT)}:{line}"
        for path in python_files()
        for line in unexplained(path.read_text(encoding="utf-8"))
    ]
    assert not found, f"noqa without a reason (write `# noqa: CODE - why`): {', '.join(found)}"


def test_no_module_of_the_package_is_over_the_line_limit() -> None:
    """Every module of gpuscaler/ but the generated code has at most MAX_MODULE_LINES lines."""
    package = ROOT / "gpuscaler"
    lines = {
        path: len(path.read_text(encoding="utf-8").splitlines())
        for path in python_files()
        if path.is_relative_to(package)
    }
    assert lines, "no module found"
    over = sorted(f"{path.relative_to(ROOT)} ({count})" for path, count in lines.items() if count > MAX_MODULE_LINES)
    assert not over, f"modules over {MAX_MODULE_LINES} lines (split them by job): {', '.join(over)}"
