"""The package's import graph: every module in one room of docs/architecture.md, imports only downward, no cycles."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "gpuscaler"

# The rooms, lowest first, as docs/architecture.md draws them. A module may import from its own room and
# from any room below it; never from above. A prefix ending in "." stands for every module in that package.
ROOMS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "words",
        (
            "gpuscaler",
            "gpuscaler.errors",
            "gpuscaler.durations",
            "gpuscaler.logs",
            "gpuscaler.flags",
            "gpuscaler.aggregation",
            "gpuscaler.rates",
            "gpuscaler.shares",
            "gpuscaler.selectors",
            "gpuscaler.gpu_metrics",
            "gpuscaler.samples",
            "gpuscaler.pods",
            "gpuscaler.hpa",
            "gpuscaler.generated",
            "gpuscaler.generated.",
        ),
    ),
    (
        "read and keep",
        (
            "gpuscaler.collectors",
            "gpuscaler.collectors.",
            "gpuscaler.attribution",
            "gpuscaler.attribution.",
            "gpuscaler.source",
            "gpuscaler.history",
            "gpuscaler.last_reads",
            "gpuscaler.poller",
        ),
    ),
    (
        "ask and compute",
        (
            "gpuscaler.query",
            "gpuscaler.profiles",
            "gpuscaler.metadata",
            "gpuscaler.evaluation",
            "gpuscaler.energy",
            "gpuscaler.scale_targets",
            "gpuscaler.activation",
            "gpuscaler.engine",
        ),
    ),
    (
        "answer",
        (
            "gpuscaler.wire",
            "gpuscaler.telemetry",
            "gpuscaler.exposition",
            "gpuscaler.tls",
            "gpuscaler.client",
            "gpuscaler.server",
            "gpuscaler.server.",
        ),
    ),
    ("processes", ("gpuscaler.settings", "gpuscaler.agent", "gpuscaler.gateway", "gpuscaler.gateway.")),
    ("command line", ("gpuscaler.cli", "gpuscaler.report", "gpuscaler.__main__")),
)


def module_name(path: Path) -> str:
    """The dotted module name of a file of the package (a package's ``__init__`` is the package)."""
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    """Every module of the package but the generated code (which imports only betterproto2)."""
    return {module_name(path): path for path in PACKAGE.rglob("*.py") if "generated" not in path.parts}


def imports(path: Path) -> Iterator[str]:
    """The gpuscaler modules ``path`` imports, at its top or inside a function alike."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.startswith("gpuscaler"):
                yield node.module
        elif isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names if alias.name.startswith("gpuscaler"))


def room_of(module: str) -> int:
    """The index in ROOMS of the room ``module`` belongs to; fails if it is in none."""
    for index, (_, members) in enumerate(ROOMS):
        for member in members:
            if module == member or (member.endswith(".") and module.startswith(member)):
                return index
    raise AssertionError(f"{module} is in no room of tests/test_architecture.py (and docs/architecture.md)")


def graph() -> dict[str, set[str]]:
    """Each module of the package with the gpuscaler modules it imports."""
    return {name: set(imports(path)) for name, path in modules().items()}


def test_every_module_is_in_a_room() -> None:
    """A new module is placed in a room, so that the rule below covers it."""
    for name in modules():
        room_of(name)


def test_no_module_imports_from_a_room_above_its_own() -> None:
    """The data's way runs one way: lower rooms never import from higher ones."""
    upward = sorted(
        f"{module} ({ROOMS[room_of(module)][0]}) imports {target} ({ROOMS[room_of(target)][0]})"
        for module, targets in graph().items()
        for target in targets
        if room_of(target) > room_of(module)
    )
    assert not upward


def test_the_import_graph_has_no_cycle() -> None:
    """No two modules import each other, directly or through others."""
    imported = graph()
    edges = {module: {t for t in targets if t in imported} for module, targets in imported.items()}
    seen: set[str] = set()
    path: list[str] = []

    def visit(module: str) -> None:
        if module in path:
            raise AssertionError("import cycle: " + " -> ".join([*path[path.index(module) :], module]))
        if module in seen:
            return
        path.append(module)
        for target in sorted(edges.get(module, ())):
            visit(target)
        path.pop()
        seen.add(module)

    for module in sorted(edges):
        visit(module)


@pytest.mark.parametrize("room", [name for name, _ in ROOMS])
def test_the_architecture_doc_names_every_room(room: str) -> None:
    """docs/architecture.md describes each room by its name."""
    text = (PACKAGE.parent / "docs" / "architecture.md").read_text(encoding="utf-8")
    assert f"**{room}**" in text.lower()
