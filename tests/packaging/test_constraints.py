"""constraints.txt pins every package, and agrees with the pins in pyproject.toml."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def pins(lines: list[str]) -> dict[str, str]:
    """Each ``name==version`` pin among ``lines``, by normalised name (extras and markers dropped)."""
    found = {}
    for line in lines:
        match = re.fullmatch(r"([A-Za-z0-9_.\-]+)(?:\[[^\]]*\])?==([^\s;]+)", line.strip())
        if match:
            found[re.sub(r"[-_.]+", "-", match.group(1)).lower()] = match.group(2)
    return found


def test_constraints_agree_with_pyproject() -> None:
    """Each dependency pyproject.toml pins has the same version in constraints.txt, so `make lock` was run."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = pins([*project["dependencies"], *project["optional-dependencies"]["dev"]])
    locked = pins((ROOT / "constraints.txt").read_text().splitlines())
    mismatched = {name: (pin, locked.get(name)) for name, pin in declared.items() if locked.get(name) != pin}
    assert not mismatched, f"pyproject pin -> constraints.txt pin: {mismatched}; run make lock"


def test_constraints_pin_exact_versions_only() -> None:
    """Every non-comment line of constraints.txt is NAME==VERSION."""
    lines = [line for line in (ROOT / "constraints.txt").read_text().splitlines() if line and not line.startswith("#")]
    assert lines
    assert len(pins(lines)) == len(lines)
