"""The Grafana dashboard (charts/gpuscaler/files/dashboard.json): current with its generator, well formed, every
query valid PromQL under promtool and reading only series that agent and gateway export."""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from grpclib.client import Channel
from prometheus_client.parser import text_string_to_metric_families

from gpuscaler.agent.collectors.fake import FakeCollector
from gpuscaler.agent.process import Agent
from gpuscaler.gateway.process import Gateway
from gpuscaler.generated.externalscaler import ExternalScalerStub, GetMetricsRequest, ScaledObjectRef
from monitoring import dashboard
from tests.conftest import serve_settings
from tests.gateway.conftest import gateway_settings
from tests.monitoring.promql import exposition, promtool_or_skip, series_in
from tests.waiting import until

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
# What each Grafana variable stands for when an expression is checked as PromQL: a regex, as Grafana writes a
# multi-value selection, and the rate interval as a duration.
SUBSTITUTES = {
    "__rate_interval": "1m",
    "__interval": "1m",
    "namespace": "ml|batch",
    "scaled_object": "llm|.*",
    "node": "node-a|node-b",
}
_VARIABLE = re.compile(r"\$\{(\w+)\}|\$(\w+)")
_SELECTOR = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\{([^}]*)\}")
_LABEL_VALUES = re.compile(r"label_values\((.*),\s*(\w+)\)")


def load() -> dict[str, Any]:
    """The committed dashboard file."""
    loaded: dict[str, Any] = json.loads(dashboard.DASHBOARD_FILE.read_text(encoding="utf-8"))
    return loaded


def panels(board: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel that draws something: rows (and a collapsed row's panels) unpacked."""
    for panel in board["panels"]:
        if panel["type"] == "row":
            yield from panel.get("panels", [])
        else:
            yield panel


def expressions(board: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(where, PromQL) for each panel query and each variable's label_values selector."""
    for panel in panels(board):
        for target in panel["targets"]:
            yield f"panel {panel['id']} {panel['title']!r} query {target['refId']}", target["expr"]
    for variable in board["templating"]["list"]:
        if variable["type"] == "query":
            match = _LABEL_VALUES.fullmatch(variable["query"])
            assert match is not None, variable["query"]
            yield f"variable {variable['name']}", match[1]


def substituted(expr: str) -> str:
    """``expr`` as Prometheus receives it from Grafana; a variable the dashboard does not define fails."""

    def value(match: re.Match[str]) -> str:
        name = match[1] or match[2]
        assert name in SUBSTITUTES, f"{expr!r} uses ${name}, which the dashboard does not define"
        return SUBSTITUTES[name]

    return _VARIABLE.sub(value, expr)


def matched_labels(expr: str) -> Iterator[tuple[str, str]]:
    """(series, label) for each label matcher written on a series."""
    for match in _SELECTOR.finditer(expr):
        for matcher in match[2].split(","):
            if matcher.strip():
                yield match[1], re.split(r"[=!~]", matcher.strip(), maxsplit=1)[0].strip()


def test_the_committed_file_is_what_the_generator_makes() -> None:
    """charts/gpuscaler/files/dashboard.json is exactly `python -m monitoring.dashboard`'s output: edit the
    generator, then regenerate."""
    assert dashboard.DASHBOARD_FILE.read_text(encoding="utf-8") == dashboard.render()
    assert dashboard.main(["--check"]) == 0


def test_the_dashboard_chooses_its_data_source_and_workloads() -> None:
    """A Prometheus data source variable, and namespace, ScaledObject and node variables over that data source."""
    board = load()
    assert board["schemaVersion"] >= 39
    assert board["uid"] == "gpuscaler"
    variables = {variable["name"]: variable for variable in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for name in ("namespace", "scaled_object", "node"):
        assert variables[name]["type"] == "query", name
        assert variables[name]["datasource"] == DATASOURCE, name
        assert variables[name]["multi"], name
        assert variables[name]["includeAll"], name
    assert sorted(variables) == sorted(["datasource", *(name for name in SUBSTITUTES if not name.startswith("__"))])


def test_every_panel_has_a_title_the_variable_data_source_and_queries() -> None:
    """Each panel is titled and described, reads the chosen data source, and has queries with an expression;
    ids are unique and no two panels overlap on the grid."""
    board = load()
    drawn = list(panels(board))
    assert len(drawn) >= 20
    for panel in drawn:
        where = f"panel {panel.get('id')} {panel.get('title')!r}"
        assert panel.get("title"), where
        assert panel.get("description"), where
        assert panel.get("datasource") == DATASOURCE, where
        assert panel.get("targets"), where
        for target in panel["targets"]:
            assert target.get("expr", "").strip(), where
            assert target.get("datasource") == DATASOURCE, where
    ids = [panel["id"] for panel in board["panels"]] + [panel["id"] for panel in drawn if panel not in board["panels"]]
    assert len(ids) == len(set(ids))
    cells: dict[tuple[int, int], str] = {}
    for panel in board["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= dashboard.GRID_WIDTH, panel["title"]
        for x in range(grid["x"], grid["x"] + grid["w"]):
            for y in range(grid["y"], grid["y"] + grid["h"]):
                assert (x, y) not in cells, f"{panel['title']!r} overlaps {cells[(x, y)]!r}"
                cells[(x, y)] = panel["title"]


def test_no_query_reads_the_job_label() -> None:
    """A query that matched on `job` would depend on how whoever scrapes us names the job."""
    for where, expr in expressions(load()):
        assert "job" not in re.findall(r"[a-z_]+", expr), where


@pytest.fixture(scope="module")
def promtool() -> Path:
    """The pinned promtool, or a loud skip."""
    return promtool_or_skip("DASHBOARD QUERY CHECK")


def check_as_rules(promtool: Path, queries: list[tuple[str, str]], folder: Path) -> subprocess.CompletedProcess[str]:
    """promtool's verdict on each query as a recording rule, one group per query named for where it is."""
    groups = [
        {"name": where, "rules": [{"record": f"dashboard:query_{index}", "expr": substituted(expr)}]}
        for index, (where, expr) in enumerate(queries)
    ]
    rules = folder / "dashboard_rules.yaml"
    rules.write_text(yaml.safe_dump({"groups": groups}, sort_keys=False), encoding="utf-8")
    return subprocess.run(
        [str(promtool), "check", "rules", str(rules)], capture_output=True, text=True, timeout=60, check=False
    )


def test_every_query_is_valid_promql(promtool: Path, tmp_path: Path) -> None:
    """promtool parses every panel query and variable selector, with Grafana's variables filled in as Grafana
    would; a failure names the panel."""
    queries = list(expressions(load()))
    result = check_as_rules(promtool, queries, tmp_path)
    assert result.returncode == 0, f"promtool check rules:\n{result.stdout}{result.stderr}"
    assert f"{len(queries)} rules found" in result.stdout


def test_promtool_names_the_panel_whose_query_is_broken(promtool: Path, tmp_path: Path) -> None:
    """The check above can fail, and says where: an unbalanced query is refused, its panel named."""
    broken = ("panel 7 'Broken'", "sum by (node) (rate(x_total[$__rate_interval])")
    result = check_as_rules(promtool, [broken], tmp_path)
    assert result.returncode != 0
    assert "panel 7 'Broken'" in result.stdout + result.stderr


def test_series_in_reads_names_not_functions_or_labels() -> None:
    """The name finder the next test relies on keeps series names and drops functions, labels and keywords."""
    expr = dashboard.AGENT_NODE.join(["max by (instance) (a_seconds)", ""]) + ' / b_bucket{le="0.25"}'
    assert series_in(substituted(expr)) == {"a_seconds", "gpuscaler_gpu_up", "b_bucket"}
    assert list(matched_labels('x{node=~"$node", gpu!="1"}')) == [("x", "node"), ("x", "gpu")]


async def ask(port: int) -> None:
    """One GetMetrics, as KEDA polls: the per-ScaledObject series then have a sample with their labels."""
    channel = Channel("127.0.0.1", port)
    try:
        ref = ScaledObjectRef(name="llm", namespace="ml", scaler_metadata={})
        await ExternalScalerStub(channel).get_metrics(GetMetricsRequest(ref, "gpuscaler-gpu_utilization-sum"))
    finally:
        channel.close()


@pytest.fixture
async def exported() -> dict[str, set[str]]:
    """Every series name an agent and a gateway that hears it export (counters with _total, histograms with their
    _bucket, _sum and _count), each with the labels its samples carry."""
    agent = await Agent.start(serve_settings("--fake-gpus", "2"), FakeCollector(node="node-a", gpu_count=2))
    gateway = None
    try:
        gateway = await Gateway.start(gateway_settings("--agents", f"127.0.0.1:{agent.port}"), directory=None)
        view = gateway.view
        await until(lambda: view.latest is not None and len(view.latest.nodes) == 1, timeout=10)
        await ask(agent.port)
        await ask(gateway.port)
        assert agent.frontend.metrics is not None
        assert gateway.frontend.metrics is not None
        pages = [await exposition(agent.frontend.metrics.port), await exposition(gateway.frontend.metrics.port)]
    finally:
        if gateway is not None:
            await gateway.stop()
        await agent.stop()
    names: dict[str, set[str]] = {}
    for page in pages:
        for family in text_string_to_metric_families(page):
            suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum")}.get(family.type, ("",))
            for suffix in suffixes:
                names.setdefault(family.name + suffix, set())
            for sample in family.samples:
                names.setdefault(sample.name, set()).update(sample.labels)
    return names


async def test_every_series_a_query_reads_is_exported(exported: dict[str, set[str]]) -> None:
    """No panel waits on a series agent and gateway never export (a typo would draw nothing), and each label it
    matches on is one that series carries."""
    assert {"node", "gpu"} <= exported["gpuscaler_gpu_utilization_ratio"]
    assert {"namespace", "scaled_object", "metric_name"} <= exported["gpuscaler_scaler_metric_value"]
    read: set[str] = set()
    for where, expr in expressions(load()):
        names = series_in(substituted(expr))
        assert names, where
        assert names <= set(exported), (where, sorted(names - set(exported)))
        read |= names
        for series, label in matched_labels(expr):
            if exported[series]:  # a family without samples here (no engine pods read) shows no labels
                assert label in exported[series], (where, series, label)
    for series in ("gpuscaler_scaler_metric_target", "gpuscaler_gateway_engine_up", "gpuscaler_gpu_power_draw_watts"):
        assert series in read, f"no panel shows {series}"
