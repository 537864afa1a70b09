"""Session fixtures: helm and kubeconform as the setup step built them (tests/tools.py), or a loud skip without Go."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.chart import chart_tools
from tests.chart.rendering import Helm, Kubeconform
from tests.tools import Pinned, locate


def _tool(tool: Pinned, what: str) -> Path:
    try:
        return locate(tool)
    except chart_tools.ToolUnavailable as missing:
        pytest.skip(f"CHART TESTS NOT RUN: {what} needs {tool.name}, built with a Go toolchain ({missing})")


@pytest.fixture(scope="session")
def helm(tmp_path_factory: pytest.TempPathFactory) -> Helm:
    """The pinned helm, with empty config, cache and data folders of its own."""
    return Helm(binary=_tool(chart_tools.HELM, "rendering the chart"), home=tmp_path_factory.mktemp("helm"))


@pytest.fixture(scope="session")
def kubeconform() -> Kubeconform:
    """The pinned kubeconform with the Kubernetes and CRD schemas, all offline."""
    binary = _tool(chart_tools.KUBECONFORM, "schema validation")
    folders = [
        _tool(schemas, "schema validation") for schemas in (chart_tools.KUBERNETES_SCHEMAS, chart_tools.CRD_SCHEMAS)
    ]
    return Kubeconform(binary=binary, schema_locations=chart_tools.schema_locations(*folders))
