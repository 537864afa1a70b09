"""Session fixtures: helm and kubeconform built once per machine (tests/chart/chart_tools.py), or a loud skip."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.chart import chart_tools
from tests.chart.rendering import Helm, Kubeconform


def _tool(build: Callable[[], Path], what: str) -> Path:
    try:
        return build()
    except chart_tools.ToolUnavailable as missing:
        pytest.skip(f"CHART TESTS NOT RUN: {what} needs helm/kubeconform or a Go toolchain to build them ({missing})")


@pytest.fixture(scope="session")
def helm(tmp_path_factory: pytest.TempPathFactory) -> Helm:
    """The pinned helm, with empty config, cache and data folders of its own."""
    return Helm(binary=_tool(chart_tools.helm, "rendering the chart"), home=tmp_path_factory.mktemp("helm"))


@pytest.fixture(scope="session")
def kubeconform() -> Kubeconform:
    """The pinned kubeconform with the Kubernetes and CRD schemas, all offline."""
    binary = _tool(chart_tools.kubeconform, "schema validation")
    locations = _tool_list(chart_tools.schema_locations)
    return Kubeconform(binary=binary, schema_locations=locations)


def _tool_list(build: Callable[[], list[str]]) -> list[str]:
    try:
        return build()
    except chart_tools.ToolUnavailable as missing:
        pytest.skip(f"CHART TESTS NOT RUN: the API schemas come from Go modules, and there is no Go ({missing})")
