"""The Grafana dashboard of charts/gpuscaler/files/dashboard.json, written as data.

Run ``python -m monitoring.dashboard`` to regenerate the file and docs/dashboard.d2 (its layout, for docs/metrics.md),
``--check`` to fail when either is stale.

Plain dicts in Grafana's dashboard JSON model, so that the file is reviewable and needs no SDK. Every expression uses
the series agent and gateway export (docs/metrics.md), never a ``job`` label, and groups GPUs by their own ``node``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD_FILE = ROOT / "charts" / "gpuscaler" / "files" / "dashboard.json"
LAYOUT_FILE = ROOT / "docs" / "dashboard.d2"

UID = "gpuscaler"
# Grafana 11.0's model; newer versions migrate it on load, older ones may not read it.
SCHEMA_VERSION = 39
GRID_WIDTH = 24

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
WORKLOAD = 'namespace=~"$namespace", scaled_object=~"$scaled_object"'
NODE = 'node=~"$node"'
ANSWER = "namespace, scaled_object, metric_name"
ANSWER_LEGEND = "{{namespace}}/{{scaled_object}} {{metric_name}}"
GPU_LEGEND = "{{node}} GPU {{gpu}}"
STREAM_METHOD = 'method="/externalscaler.ExternalScaler/StreamIsActive"'
# The agent's own series (poll loop, NVML) carry no node label: this adds its GPUs' node, and filters on $node.
AGENT_NODE = f"+ on (instance) group_left (node) (0 * max by (instance, node) (gpuscaler_gpu_up{{{NODE}}}))"

Json = dict[str, Any]


@dataclass(frozen=True)
class Target:
    """One PromQL query of a panel and how its series are named in the legend."""

    expr: str
    legend: str = ""


@dataclass(frozen=True)
class Panel:
    """A time series panel (or a stat); ``dashed`` names the targets drawn as dashed lines (targets, limits)."""

    title: str
    description: str
    targets: Sequence[Target]
    unit: str = "short"
    width: int = 8
    height: int = 8
    dashed: Sequence[int] = ()
    maximum: float | None = None


@dataclass(frozen=True)
class Row:
    """A titled band of panels, laid out left to right."""

    title: str
    panels: Sequence[Panel] = field(default_factory=tuple)


def ratio_panel(title: str, description: str, series: str) -> Panel:
    """A 0-1 GPU reading per node and GPU."""
    return Panel(title, description, [Target(f"{series}{{{NODE}}}", GPU_LEGEND)], unit="percentunit", maximum=1)


def quantile(q: float, histogram: str, by: str, selector: str = "") -> str:
    """The ``q`` quantile of a histogram over the rate interval, keeping the labels ``by``."""
    grouping = f"le, {by}" if by else "le"
    return f"histogram_quantile({q}, sum by ({grouping}) (rate({histogram}_bucket{selector}[$__rate_interval])))"


ROWS: tuple[Row, ...] = (
    Row(
        "Workloads: what KEDA is told",
        (
            Panel(
                "Value KEDA gets, against its target",
                "Per ScaledObject and metric: the value gpuscaler last answered (GetMetrics, or a push stream's "
                "evaluation) and, dashed, the target GetMetricSpec gave. A gap is an error answer, never a 0.",
                [
                    Target(f"max by ({ANSWER}) (gpuscaler_scaler_metric_value{{{WORKLOAD}}})", ANSWER_LEGEND),
                    Target(
                        f"max by ({ANSWER}) (gpuscaler_scaler_metric_target{{{WORKLOAD}}})",
                        f"target {ANSWER_LEGEND}",
                    ),
                ],
                width=12,
                dashed=(1,),
            ),
            Panel(
                "Replica estimate (AverageValue)",
                "ceil(value / target): the replicas the HPA asks for with the default AverageValue metric type, "
                "before minReplicaCount, maxReplicaCount and its scaling behaviour.",
                [
                    Target(
                        f"ceil(max by ({ANSWER}) (gpuscaler_scaler_metric_value{{{WORKLOAD}}}) "
                        f"/ max by ({ANSWER}) (gpuscaler_scaler_metric_target{{{WORKLOAD}}}))",
                        ANSWER_LEGEND,
                    )
                ],
                width=12,
            ),
            Panel(
                "Value / target",
                "1 is on target: above it the HPA scales out, below it in.",
                [
                    Target(
                        f"max by ({ANSWER}) (gpuscaler_scaler_metric_value{{{WORKLOAD}}}) "
                        f"/ max by ({ANSWER}) (gpuscaler_scaler_metric_target{{{WORKLOAD}}})",
                        ANSWER_LEGEND,
                    )
                ],
                unit="percentunit",
            ),
            Panel(
                "Failed GetMetrics answers",
                "GetMetrics calls answered with an error, per ScaledObject: KEDA keeps the last good value, then "
                "falls back to its fallback replicas. The log's rpc_refused says why.",
                [
                    Target(
                        f"sum by ({ANSWER}) (rate(gpuscaler_scaler_metric_errors_total{{{WORKLOAD}}}"
                        "[$__rate_interval]))",
                        ANSWER_LEGEND,
                    )
                ],
                unit="reqps",
            ),
            Panel(
                "Idle GPU power by workload",
                "Energy while idle of each workload's GPUs, as watts: what scaling it to zero would save "
                "(docs/metrics.md, energy while idle). Needs the gateway's pod directory.",
                [
                    Target(
                        "max by (namespace, workload) (rate(gpuscaler_workload_idle_energy_joules_total"
                        '{namespace=~"$namespace"}[$__rate_interval]))',
                        "{{namespace}}/{{workload}}",
                    )
                ],
                unit="watt",
            ),
        ),
    ),
    Row(
        "GPUs by node",
        (
            ratio_panel(
                "Utilisation",
                "NVML's duty cycle: the share of time any kernel ran. One small kernel at a time reads near 100%.",
                "gpuscaler_gpu_utilization_ratio",
            ),
            ratio_panel(
                "SM active (GPM)",
                "The share of SMs busy: how much of the GPU works. Hopper and newer; no series elsewhere.",
                "gpuscaler_gpu_sm_active_ratio",
            ),
            ratio_panel(
                "Tensor active (GPM)",
                "The share of time tensor cores ran: the matrix math of training and prefill.",
                "gpuscaler_gpu_tensor_active_ratio",
            ),
            ratio_panel(
                "DRAM bandwidth (GPM)",
                "DRAM bandwidth used against the GPU's peak: what bounds LLM decoding.",
                "gpuscaler_gpu_dram_bandwidth_ratio",
            ),
            Panel(
                "Memory used",
                "VRAM in use against the GPU's total.",
                [
                    Target(
                        f"gpuscaler_gpu_memory_used_bytes{{{NODE}}} / gpuscaler_gpu_memory_total_bytes{{{NODE}}}",
                        GPU_LEGEND,
                    )
                ],
                unit="percentunit",
                maximum=1,
            ),
            Panel(
                "Temperature",
                "Die temperature.",
                [Target(f"gpuscaler_gpu_temperature_celsius{{{NODE}}}", GPU_LEGEND)],
                unit="celsius",
            ),
            Panel(
                "Power draw",
                "Board power and, dashed, the enforced power limit. No series on MIG instances.",
                [
                    Target(f"gpuscaler_gpu_power_draw_watts{{{NODE}}}", GPU_LEGEND),
                    Target(f"gpuscaler_gpu_power_limit_watts{{{NODE}}}", f"limit {GPU_LEGEND}"),
                ],
                unit="watt",
                dashed=(1,),
            ),
            Panel(
                "Energy and idle energy by node",
                "The rate of the energy counters, as watts: all the GPUs' energy and, dashed, the part spent while "
                "no kernel ran (docs/metrics.md, energy while idle).",
                [
                    Target(
                        f"sum by (node) (rate(gpuscaler_gpu_energy_joules_total{{{NODE}}}[$__rate_interval]))",
                        "{{node}}",
                    ),
                    Target(
                        f"sum by (node) (rate(gpuscaler_gpu_idle_energy_joules_total{{{NODE}}}[$__rate_interval]))",
                        "idle {{node}}",
                    ),
                ],
                unit="watt",
                dashed=(1,),
            ),
            Panel(
                "GPUs readable",
                "1 while the GPU's last read worked, 0 while NVML fails for the whole device (lost, hung).",
                [Target(f"gpuscaler_gpu_up{{{NODE}}}", GPU_LEGEND)],
                maximum=1,
            ),
            Panel(
                "PCIe traffic",
                "Bytes a second sent (tx) and received (rx) over PCIe: data loading and host copies.",
                [
                    Target(f"gpuscaler_gpu_pcie_tx_bytes_per_second{{{NODE}}}", f"tx {GPU_LEGEND}"),
                    Target(f"gpuscaler_gpu_pcie_rx_bytes_per_second{{{NODE}}}", f"rx {GPU_LEGEND}"),
                ],
                unit="Bps",
                width=12,
            ),
            Panel(
                "NVLink traffic",
                "Bytes a second over all NVLinks: the collectives of multi-GPU work. No series without NVLink.",
                [
                    Target(f"gpuscaler_gpu_nvlink_tx_bytes_per_second{{{NODE}}}", f"tx {GPU_LEGEND}"),
                    Target(f"gpuscaler_gpu_nvlink_rx_bytes_per_second{{{NODE}}}", f"rx {GPU_LEGEND}"),
                ],
                unit="Bps",
                width=12,
            ),
        ),
    ),
    Row(
        "Gateway: the cluster view",
        (
            Panel(
                "Agents by state",
                "The agents the gateways list: heard, silent (snapshots stopped), unheard, refused, replaced. "
                "The most any replica sees.",
                [Target("max by (state) (gpuscaler_gateway_agents)", "{{state}}")],
            ),
            Panel(
                "Node snapshot age",
                "Age of each node's newest snapshot on the gateway: the lag of its answers.",
                [Target(f"max by (node) (gpuscaler_gateway_node_snapshot_age_seconds{{{NODE}}})", "{{node}}")],
                unit="s",
            ),
            Panel(
                "GPUs in the view",
                "GPUs of the heard nodes, per gateway replica: a drop is a node gone quiet.",
                [Target("gpuscaler_gateway_gpus", "{{instance}}")],
            ),
            Panel(
                "Composition time",
                "One composition of the cluster view, the open streams' re-evaluation included: every push answer "
                "lags by it. Mean and, dashed, p99.",
                [
                    Target(
                        "sum by (instance) (rate(gpuscaler_gateway_compose_duration_seconds_sum[$__rate_interval])) "
                        "/ sum by (instance) (rate(gpuscaler_gateway_compose_duration_seconds_count"
                        "[$__rate_interval]))",
                        "mean {{instance}}",
                    ),
                    Target(
                        quantile(0.99, "gpuscaler_gateway_compose_duration_seconds", "instance"), "p99 {{instance}}"
                    ),
                ],
                unit="s",
                dashed=(1,),
            ),
            Panel(
                "Partial answers",
                "Answers that left out unreadable GPUs (within maxUnreadable) or nodes (within minNodes).",
                [
                    Target(
                        "sum by (left_out) (rate(gpuscaler_partial_answers_total[$__rate_interval]))",
                        "without {{left_out}}",
                    )
                ],
                unit="reqps",
            ),
            Panel(
                "Snapshot streams",
                "Snapshots received from each node's agent and, dashed, reconnects of the stream: a loop of "
                "reconnects is an agent that keeps dropping.",
                [
                    Target(
                        f"sum by (node) (rate(gpuscaler_gateway_agent_snapshots_total{{{NODE}}}[$__rate_interval]))",
                        "{{node}}",
                    ),
                    Target(
                        "sum by (agent) (rate(gpuscaler_gateway_agent_connects_total[$__rate_interval]))",
                        "reconnects {{agent}}",
                    ),
                ],
                unit="ops",
                dashed=(1,),
            ),
        ),
    ),
    Row(
        "RPCs and push streams",
        (
            Panel(
                "RPCs by method and code",
                "Finished RPCs of agents and gateways. CANCELLED is a client that hung up, not an error.",
                [
                    Target(
                        "sum by (method, code) (rate(gpuscaler_rpc_handled_total[$__rate_interval]))",
                        "{{method}} {{code}}",
                    )
                ],
                unit="reqps",
                width=12,
            ),
            Panel(
                "Unary latency",
                "p50 and, dashed, p99 of each unary method.",
                [
                    Target(quantile(0.5, "gpuscaler_rpc_duration_seconds", "method"), "p50 {{method}}"),
                    Target(quantile(0.99, "gpuscaler_rpc_duration_seconds", "method"), "p99 {{method}}"),
                ],
                unit="s",
                width=12,
                dashed=(1,),
            ),
            Panel(
                "Open push streams",
                "KEDA's StreamIsActive streams held open and, dashed, the distinct queries among them (each costs "
                "one evaluation per snapshot).",
                [
                    Target(f"sum by (instance) (gpuscaler_rpc_in_flight{{{STREAM_METHOD}}})", "{{instance}}"),
                    Target("sum by (instance) (gpuscaler_stream_distinct_queries)", "queries {{instance}}"),
                ],
                dashed=(1,),
            ),
            Panel(
                "Activation changes",
                "Queries turning active or inactive: KEDA scales from or to zero on these.",
                [
                    Target(
                        "sum by (direction) (increase(gpuscaler_activation_transitions_total[$__rate_interval]))",
                        "{{direction}}",
                    )
                ],
            ),
            Panel(
                "Connection limits acting",
                "Times a gRPC connection limit acted (docs/security.md): a client too slow, too greedy or misbehaving.",
                [Target("sum by (limit) (rate(gpuscaler_grpc_limited_total[$__rate_interval]))", "{{limit}}")],
                unit="ops",
            ),
        ),
    ),
    Row(
        "Engine signals",
        (
            Panel(
                "Engine pages readable",
                "1 while the newest read of an engine pod's metrics page worked, 0 while it fails: its workload's "
                "engine signals are UNAVAILABLE then.",
                [
                    Target(
                        'min by (namespace, pod) (gpuscaler_gateway_engine_up{namespace=~"$namespace"})',
                        "{{namespace}}/{{pod}}",
                    )
                ],
                maximum=1,
            ),
            Panel(
                "Engine page age",
                "Age of each pod's newest metrics page: it grows while the pod cannot be read.",
                [
                    Target(
                        'max by (namespace, pod) (gpuscaler_gateway_engine_page_age_seconds{namespace=~"$namespace"})',
                        "{{namespace}}/{{pod}}",
                    )
                ],
                unit="s",
            ),
            Panel(
                "Engine scrapes by outcome",
                "Reads of engine metrics pages: ok, timeout, error, status, too_large, malformed.",
                [
                    Target(
                        "sum by (outcome) (rate(gpuscaler_gateway_engine_scrapes_total[$__rate_interval]))",
                        "{{outcome}}",
                    )
                ],
                unit="ops",
            ),
            Panel(
                "Engine scrape time",
                "p50 and, dashed, p99 of one read of a pod's metrics page, the wait for a free slot included.",
                [
                    Target(quantile(0.5, "gpuscaler_gateway_engine_scrape_duration_seconds", ""), "p50"),
                    Target(quantile(0.99, "gpuscaler_gateway_engine_scrape_duration_seconds", ""), "p99"),
                ],
                unit="s",
                width=12,
                dashed=(1,),
            ),
            Panel(
                "Engine series read",
                "What the engine signals read from each pod's page, summed over its label sets.",
                [
                    Target(
                        'max by (namespace, pod, series) (gpuscaler_gateway_engine_series{namespace=~"$namespace"})',
                        "{{namespace}}/{{pod}} {{series}}",
                    )
                ],
                width=12,
            ),
        ),
    ),
    Row(
        "Agents: poll loop and NVML",
        (
            Panel(
                "Newest snapshot age",
                "Age of each agent's newest snapshot: over a few poll intervals its poll loop is stuck.",
                [Target(f"max by (instance) (gpuscaler_sample_age_seconds) {AGENT_NODE}", "{{node}}")],
                unit="s",
            ),
            Panel(
                "Poll time",
                "p99 of one tick reading every GPU of the node, and, dashed, how late the last tick started.",
                [
                    Target(f"{quantile(0.99, 'gpuscaler_poll_duration_seconds', 'instance')} {AGENT_NODE}", "{{node}}"),
                    Target(f"max by (instance) (gpuscaler_poll_lag_seconds) {AGENT_NODE}", "lag {{node}}"),
                ],
                unit="s",
                dashed=(1,),
            ),
            Panel(
                "NVML errors",
                "Failed NVML calls by call and NVML return code (3: not supported, a reading the GPU lacks; "
                "15: GPU lost).",
                [
                    Target(
                        f"sum by (instance, call, code) (rate(gpuscaler_nvml_errors_total[$__rate_interval])) "
                        f"{AGENT_NODE}",
                        "{{node}} {{call}} {{code}}",
                    )
                ],
                unit="ops",
            ),
        ),
    ),
)


def datasource_variable() -> Json:
    """The Prometheus data source every panel and variable reads: the dashboard names none of its own."""
    return {
        "name": "datasource",
        "label": "Data source",
        "type": "datasource",
        "query": "prometheus",
        "current": {},
        "hide": 0,
        "refresh": 1,
        "regex": "",
        "options": [],
    }


def query_variable(name: str, label: str, query: str) -> Json:
    """A multi-value variable from ``label_values``; All matches every value, missing labels included."""
    return {
        "name": name,
        "label": label,
        "type": "query",
        "datasource": DATASOURCE,
        "query": query,
        "definition": query,
        "current": {},
        "hide": 0,
        "includeAll": True,
        "allValue": ".*",
        "multi": True,
        "refresh": 2,
        "regex": "",
        "sort": 1,
        "options": [],
    }


VARIABLES: tuple[Json, ...] = (
    datasource_variable(),
    query_variable("namespace", "Namespace", "label_values(gpuscaler_scaler_metric_target, namespace)"),
    query_variable(
        "scaled_object",
        "ScaledObject",
        'label_values(gpuscaler_scaler_metric_target{namespace=~"$namespace"}, scaled_object)',
    ),
    query_variable("node", "Node", "label_values(gpuscaler_gpu_up, node)"),
)


def panel_json(panel: Panel, panel_id: int, x: int, y: int) -> Json:
    """Grafana's model of one time series panel at grid position (``x``, ``y``)."""
    overrides = [
        {
            "matcher": {"id": "byFrameRefID", "options": ref_id(index)},
            "properties": [{"id": "custom.lineStyle", "value": {"fill": "dash", "dash": [10, 10]}}],
        }
        for index in panel.dashed
    ]
    defaults: Json = {"unit": panel.unit, "min": 0, "custom": {"lineWidth": 1, "fillOpacity": 0, "spanNulls": False}}
    if panel.maximum is not None:
        defaults["max"] = panel.maximum
    return {
        "id": panel_id,
        "type": "timeseries",
        "title": panel.title,
        "description": panel.description,
        "datasource": DATASOURCE,
        "gridPos": {"h": panel.height, "w": panel.width, "x": x, "y": y},
        "fieldConfig": {"defaults": defaults, "overrides": overrides},
        "options": {
            "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
            "tooltip": {"mode": "multi", "sort": "desc"},
        },
        "targets": [
            {"refId": ref_id(index), "datasource": DATASOURCE, "expr": target.expr, "legendFormat": target.legend}
            for index, target in enumerate(panel.targets)
        ],
    }


def ref_id(index: int) -> str:
    """Grafana's name of a panel's ``index``-th query: A, B, ..."""
    return chr(ord("A") + index)


def layout(rows: Sequence[Row]) -> list[Json]:
    """Rows and their panels on Grafana's 24-column grid: panels fill a line left to right, then wrap."""
    panels: list[Json] = []
    y = 0
    next_id = 1
    for row in rows:
        panels.append(
            {
                "id": next_id,
                "type": "row",
                "title": row.title,
                "collapsed": False,
                "gridPos": {"h": 1, "w": GRID_WIDTH, "x": 0, "y": y},
                "panels": [],
            }
        )
        next_id += 1
        y += 1
        x = 0
        line_height = 0
        for panel in row.panels:
            if x + panel.width > GRID_WIDTH:
                x, y, line_height = 0, y + line_height, 0
            panels.append(panel_json(panel, next_id, x, y))
            next_id += 1
            x += panel.width
            line_height = max(line_height, panel.height)
        y += line_height
    return panels


def dashboard() -> Json:
    """The whole dashboard, as Grafana's import and the kube-prometheus-stack sidecar read it."""
    return {
        "uid": UID,
        "title": "gpuscaler",
        "description": "What KEDA is told about each workload, the GPUs behind it, and the agents and gateways "
        "that answer (docs/metrics.md, Dashboard).",
        "tags": ["gpuscaler", "keda", "gpu"],
        "schemaVersion": SCHEMA_VERSION,
        "version": 1,
        "editable": True,
        "graphTooltip": 1,
        "time": {"from": "now-6h", "to": "now"},
        "refresh": "30s",
        "timezone": "",
        "annotations": {"list": []},
        "links": [],
        "templating": {"list": list(VARIABLES)},
        "panels": layout(ROWS),
    }


def render() -> str:
    """The file's text: stable key order and indentation, so a change to the generator is a readable diff."""
    return json.dumps(dashboard(), indent=2, ensure_ascii=False) + "\n"


def lines(row: Row) -> list[list[Panel]]:
    """A row's panels, grouped into the grid lines ``layout`` puts them on."""
    grouped: list[list[Panel]] = [[]]
    width = 0
    for panel in row.panels:
        if width + panel.width > GRID_WIDTH:
            grouped.append([])
            width = 0
        grouped[-1].append(panel)
        width += panel.width
    return grouped


def render_layout() -> str:
    """The dashboard's rows and panels as a d2 grid: a picture of the layout, made from the same ``ROWS``."""
    out = [
        "# The layout of charts/gpuscaler/files/dashboard.json, written by `python -m monitoring.dashboard`.",
        "# Render: d2 --layout dagre docs/dashboard.d2 docs/dashboard.svg (the d2 of `make docs`).",
        "grid-columns: 1",
        "grid-gap: 12",
    ]
    for row_index, row in enumerate(ROWS):
        out += [f"row{row_index}: {json.dumps(row.title)} {{", "  grid-columns: 1", "  grid-gap: 6"]
        for line_index, line in enumerate(lines(row)):
            out += [f'  line{line_index}: "" {{', f"    grid-columns: {len(line)}", "    grid-gap: 6"]
            out += ["    style.stroke-width: 0", "    style.fill: transparent"]
            for panel_index, panel in enumerate(line):
                size = f"width: {panel.width * 12}"
                out.append(f"    p{panel_index}: {json.dumps(panel.title)} {{{size}; style.border-radius: 4}}")
            out.append("  }")
        out.append("}")
    return "\n".join(out) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    """Write the dashboard file, or with ``--check`` only compare it; the exit status says whether it was current."""
    parser = argparse.ArgumentParser(prog="python -m monitoring.dashboard", description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail when the committed file differs; write nothing")
    args = parser.parse_args(argv)
    outputs = {DASHBOARD_FILE: render(), LAYOUT_FILE: render_layout()}
    if args.check:
        stale = [path for path, text in outputs.items() if path.read_text(encoding="utf-8") != text]
        for path in stale:
            print(f"{path.relative_to(ROOT)} is stale: run 'python -m monitoring.dashboard'", file=sys.stderr)
        return 1 if stale else 0
    for path, text in outputs.items():
        path.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
