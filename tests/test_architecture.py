"""The package's import graph: every module in one room of docs/architecture.md, imports only downward, no cycles."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "gpuscaler"

# The rooms, lowest first, as docs/architecture.md draws them: each is a package (or the top-level helpers). A module
# may import from its own room and from rooms on lower levels; rooms on one level (the agent, the gateway) never import
# each other. A name ending in "." stands for every module under that package.
LEVELS: tuple[tuple[tuple[str, tuple[str, ...]], ...], ...] = (
    (("model", ("gpuscaler", "gpuscaler.model", "gpuscaler.model.", "gpuscaler.generated", "gpuscaler.generated.")),),
    (("helpers", ("gpuscaler.logs", "gpuscaler.flags", "gpuscaler.tls")),),
    (("query", ("gpuscaler.query", "gpuscaler.query.")),),
    (("signals", ("gpuscaler.signals", "gpuscaler.signals.")),),
    (("server", ("gpuscaler.server", "gpuscaler.server.")),),
    (("agent", ("gpuscaler.agent", "gpuscaler.agent.")), ("gateway", ("gpuscaler.gateway", "gpuscaler.gateway."))),
    (("client", ("gpuscaler.client", "gpuscaler.client.")),),
    (("entry points", ("gpuscaler.cli", "gpuscaler.__main__")),),
)
ROOMS = tuple(room for level in LEVELS for room in level)

# Inside the two processes, the same rule between tiers, lowest first: a tier imports only from its own or lower ones.
TIERS: dict[str, tuple[tuple[str, ...], ...]] = {
    "gpuscaler.agent.": (
        ("collectors", "collectors.", "attribution", "attribution.", "last_reads", "rates", "history"),
        ("poller", "fake_control", "telemetry"),
        ("settings",),
        ("process",),
    ),
    "gpuscaler.gateway.": (
        ("directory", "directory.", "engines", "engines.", "window_asks"),
        ("decoding", "view", "discovery"),
        ("subscriber", "idle_energy", "settings"),
        ("telemetry",),
        ("process",),
    ),
}


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


def _matches(module: str, member: str) -> bool:
    return module == member or (member.endswith(".") and module.startswith(member))


def room_of(module: str) -> int:
    """The index in ROOMS of the room ``module`` belongs to; fails if it is in none."""
    for index, (_, members) in enumerate(ROOMS):
        if any(_matches(module, member) for member in members):
            return index
    raise AssertionError(f"{module} is in no room of tests/test_architecture.py (and docs/architecture.md)")


def level_of(module: str) -> int:
    """The index in LEVELS of the level of ``module``'s room."""
    name = ROOMS[room_of(module)][0]
    return next(index for index, level in enumerate(LEVELS) if any(room == name for room, _ in level))


def tier_of(package: str, module: str) -> int:
    """The index in TIERS[package] of the tier ``module`` (a module of ``package``) belongs to."""
    relative = module.removeprefix(package)
    for index, members in enumerate(TIERS[package]):
        if any(_matches(relative, member) for member in members):
            return index
    raise AssertionError(f"{module} is in no tier of TIERS[{package!r}] in tests/test_architecture.py")


def graph() -> dict[str, set[str]]:
    """Each module of the package with the gpuscaler modules it imports."""
    return {name: set(imports(path)) for name, path in modules().items()}


def test_every_module_is_in_a_room() -> None:
    """A new module is placed in a room (and, in a process, a tier), so that the rules below cover it."""
    for name in modules():
        room_of(name)
        for package in TIERS:
            if name.startswith(package):
                tier_of(package, name)


def test_no_module_imports_from_a_room_above_its_own() -> None:
    """The data's way runs one way: lower rooms never import from higher ones, nor the agent and gateway each other."""
    wrong = sorted(
        f"{module} ({ROOMS[room_of(module)][0]}) imports {target} ({ROOMS[room_of(target)][0]})"
        for module, targets in graph().items()
        for target in targets
        if level_of(target) > level_of(module)
        or (level_of(target) == level_of(module) and room_of(target) != room_of(module))
    )
    assert not wrong


@pytest.mark.parametrize("package", sorted(TIERS))
def test_inside_a_process_no_module_imports_from_a_tier_above_its_own(package: str) -> None:
    """Within the agent and the gateway too, each module imports only what lies below it on the data's way."""
    upward = sorted(
        f"{module} imports {target}"
        for module, targets in graph().items()
        if module.startswith(package)
        for target in targets
        if target.startswith(package) and tier_of(package, target) > tier_of(package, module)
    )
    assert not upward


def test_a_shared_room_holds_no_module_only_one_process_uses() -> None:
    """A module of a room both processes stand on (model, query, signals, server) that only the agent, only the
    gateway or only the client imports belongs in that room: as the HPA's arithmetic (client/hpa.py) and a
    counter's rate (agent/rates.py) moved there."""
    imported = graph()
    users: dict[str, set[str]] = {}
    for module, targets in imported.items():
        for target in targets:
            if target in imported and target != module:
                users.setdefault(target, set()).add(ROOMS[room_of(module)][0])
    shared, processes = {"model", "query", "signals", "server"}, {"agent", "gateway", "client"}
    misplaced = {
        module: sorted(rooms)
        for module, rooms in users.items()
        if ROOMS[room_of(module)][0] in shared and len(rooms) == 1 and rooms <= processes
    }
    assert not misplaced, f"used by one process's room only, so move them there: {misplaced}"


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
