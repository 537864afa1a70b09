"""A real Prometheus scrapes a live gateway and two agents as the chart's ServiceMonitor says, and runs the shipped
alert rules: labels after relabelling, every rule's expression, and the alerts a lost GPU, a silent node and an
agent nobody hears fire, with the labels that name them.

The rules are charts/gpuscaler/files/rules.yaml with each ``for:`` cut to a few seconds (their expressions as
shipped): a pending alert that turns firing is the behaviour under test, not the minutes it waits.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from grpclib.client import Channel

from e2e.keda.control_plane import free_port
from e2e.monitoring.prometheus import Json, Prometheus, scrape_config, start, target
from e2e.support.process import Process, environment
from gpuscaler.generated import externalscaler as keda
from tests.chart import chart_tools
from tests.chart.rendering import CHART, NAMESPACE, RELEASE, Helm
from tests.tools import locate

CONSOLE_SCRIPT = Path(sys.executable).with_name("gpuscaler")
RULES = CHART / "files" / "rules.yaml"
FOR_SECONDS = 3
GATEWAY_NODE = "system-node-1"  # where the gateway's pod runs: no GPU there
NODES = ("gpu-node-1", "gpu-node-2")


@dataclass
class Stack:
    """Prometheus and what it scrapes."""

    prometheus: Prometheus
    agents: dict[str, Process]
    gateway: Process
    metrics: dict[str, int]  # process name -> its /metrics port
    unheard: str  # an agent address the gateway lists where nothing listens


def _started(process: Process, event: str) -> int:
    """The metrics port ``process`` logged in its started event."""
    (started,) = process.events(event)
    return int(str(started["metrics_port"]))


def _shortened_rules(folder: Path) -> Path:
    groups = yaml.safe_load(RULES.read_text())
    for group in groups["groups"]:
        for rule in group["rules"]:
            if "for" in rule:
                rule["for"] = f"{FOR_SECONDS}s"
    path = folder / "rules.yaml"
    path.write_text(yaml.safe_dump(groups))
    return path


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """Two agents (gpu-node-1, gpu-node-2), a gateway over them and one unreachable address, and Prometheus over
    all three as the chart's ServiceMonitor scrapes them, with the shipped rules."""
    folder = tmp_path_factory.mktemp("prometheus")
    helm = Helm(locate(chart_tools.HELM), folder / "helm")
    manifests = helm.template(sets=["serviceMonitor.enabled=true"])
    (monitor,) = [m for m in manifests if m["kind"] == "ServiceMonitor"]
    services = {m["metadata"]["labels"]["gpuscaler/service"]: m for m in manifests if m["kind"] == "Service"}
    agents: dict[str, Process] = {}
    processes: list[Process] = []
    prometheus: Prometheus | None = None
    try:
        for node in NODES:
            agents[node] = Process(
                [str(CONSOLE_SCRIPT), "serve", "--collector", "fake", "--fake-gpus", "2", "--poll-interval", "0.2",
                 "--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0", "--pod-resources-socket", "",
                 "--log-format", "json"],
                folder / f"agent-{node}.log", environment(node), "agent_started",
            ).start()  # fmt: skip
            processes.append(agents[node])
        unheard = f"127.0.0.1:{free_port()}"
        addresses = [f"127.0.0.1:{agents[node].port}" for node in NODES] + [unheard]
        gateway = Process(
            [str(CONSOLE_SCRIPT), "gateway", "--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0",
             "--agents", ",".join(addresses), "--log-format", "json"],
            folder / "gateway.log", environment(), "gateway_started",
        ).start()  # fmt: skip
        processes.append(gateway)
        metrics = {node: _started(agents[node], "agent_started") for node in NODES}
        metrics["gateway"] = _started(gateway, "gateway_started")
        targets = [
            target(f"127.0.0.1:{metrics[node]}", services["agents"], f"{RELEASE}-agent-{n}", node, "agent")
            for n, node in enumerate(NODES)
        ]
        targets.append(target(f"127.0.0.1:{metrics['gateway']}", services["scaler"], f"{RELEASE}-gateway-0",
                              GATEWAY_NODE, "gateway"))  # fmt: skip
        targets_file = folder / "targets.yaml"
        targets_file.write_text(yaml.safe_dump(targets))
        prometheus = start(
            locate(chart_tools.PROMETHEUS),
            folder,
            scrape_config(monitor, targets_file),
            [_shortened_rules(folder)],
            free_port(),
        )
        prometheus.wait(
            "every target up",
            lambda: (
                [t for t in prometheus.api("targets")["activeTargets"] if t["health"] == "up"]
                if len(prometheus.api("targets")["activeTargets"]) == 3
                and all(t["health"] == "up" for t in prometheus.api("targets")["activeTargets"])
                else None
            ),
        )
        yield Stack(prometheus, agents, gateway, metrics, unheard)
    finally:
        if prometheus is not None:
            prometheus.stop()
        for process in processes:
            process.kill()


def _labels(series: list[Json]) -> list[dict[str, str]]:
    return [dict(item["metric"]) for item in series]


def test_series_keep_the_gpus_node_and_the_scraped_pods_node_is_kubernetes_node(stack: Stack) -> None:
    """After the ServiceMonitor's relabelling, an agent's GPU series and the gateway's per-agent series name the GPU's
    node in `node`; the node of the pod Prometheus scraped is `kubernetes_node`; nothing is renamed exported_*."""
    gpus = _labels(stack.prometheus.wait("GPU temperatures", lambda: stack.prometheus.query(
        "gpuscaler_gpu_temperature_celsius")))  # fmt: skip
    assert sorted((s["node"], s["uuid"]) for s in gpus) == [
        (node, f"GPU-fake-{node}-{i}") for node in NODES for i in range(2)
    ]
    assert all(s["kubernetes_node"] == s["node"] for s in gpus), gpus
    heard = _labels(stack.prometheus.query('gpuscaler_gateway_agent_heard{node!=""}'))
    assert sorted(s["node"] for s in heard) == list(NODES)
    assert {s["kubernetes_node"] for s in heard} == {GATEWAY_NODE}
    everything = _labels(stack.prometheus.query('{__name__=~"gpuscaler_.+"}'))
    assert not [s for s in everything if any(name.startswith("exported_") for name in s)]
    assert {s["namespace"] for s in everything} == {NAMESPACE}


def test_every_rule_loads_and_evaluates_without_error(stack: Stack) -> None:
    """Prometheus loaded every shipped rule and evaluated each one without an error."""
    shipped = [r["alert"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]

    def evaluated() -> list[Json] | None:
        rules = [r for g in stack.prometheus.api("rules")["groups"] for r in g["rules"]]
        return rules if all(r.get("lastEvaluation", "").startswith("20") for r in rules) else None

    rules = stack.prometheus.wait("every rule evaluated", evaluated)
    assert sorted(r["name"] for r in rules) == sorted(shipped)
    assert [r for r in rules if r["health"] != "ok"] == []


def _alert(stack: Stack, name: str, state: str, **labels: str) -> list[Json]:
    return [
        a
        for a in stack.prometheus.alerts()
        if a["labels"]["alertname"] == name
        and a["state"] == state
        and all(a["labels"].get(k) == v for k, v in labels.items())
    ]


def test_an_agent_nobody_hears_fires_agent_unheard_naming_it(stack: Stack) -> None:
    """The gateway lists an address where no agent listens: GpuscalerAgentUnheard goes pending, then firing,
    with that address in `agent`; the heard agents raise nothing."""
    stack.prometheus.wait("AgentUnheard pending or firing", lambda: _alert(
        stack, "GpuscalerAgentUnheard", "pending", agent=stack.unheard) or _alert(
        stack, "GpuscalerAgentUnheard", "firing", agent=stack.unheard))  # fmt: skip
    (firing,) = stack.prometheus.wait(
        "AgentUnheard firing", lambda: _alert(stack, "GpuscalerAgentUnheard", "firing", agent=stack.unheard)
    )
    assert firing["labels"]["severity"] == "critical"
    assert stack.unheard in firing["annotations"]["summary"]
    others = [a for a in stack.prometheus.alerts() if a["labels"]["alertname"] == "GpuscalerAgentUnheard"]
    assert [a["labels"]["agent"] for a in others] == [stack.unheard]


def test_a_lost_gpu_fires_gpu_unreadable_naming_its_node_and_uuid(stack: Stack) -> None:
    """`gpuscaler fake fail --error lost` on gpu-node-1's GPU 1: GpuscalerGpuUnreadable fires for exactly that
    GPU, by node and UUID; its node is still heard (the other GPU reads), so no node alert."""
    node = NODES[0]
    _fake(stack.agents[node], "fail", "--gpu", "1", "--error", "lost")
    try:
        (alert,) = stack.prometheus.wait(
            "GpuUnreadable firing", lambda: _alert(stack, "GpuscalerGpuUnreadable", "firing")
        )
        assert (alert["labels"]["node"], alert["labels"]["uuid"]) == (node, f"GPU-fake-{node}-1")
        assert node in alert["annotations"]["summary"]
        assert not _alert(stack, "GpuscalerNodeUnavailable", "firing", node=node)
    finally:
        _fake(stack.agents[node], "heal", "--gpu", "all")
    stack.prometheus.wait("GpuUnreadable resolved", lambda: not _alert(stack, "GpuscalerGpuUnreadable", "firing"))


def test_a_silent_node_fires_node_unavailable_naming_the_gpus_node(stack: Stack) -> None:
    """SIGSTOP gpu-node-2's agent (a hung node: its sockets stay open): the gateway stops hearing it, and
    GpuscalerNodeUnavailable fires with node gpu-node-2, the GPU's node, not the gateway pod's."""
    node = NODES[1]
    agent = stack.agents[node].process
    assert agent is not None
    pid = agent.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        (alert,) = stack.prometheus.wait(
            "NodeUnavailable firing", lambda: _alert(stack, "GpuscalerNodeUnavailable", "firing", node=node), 90
        )
        assert alert["labels"]["severity"] == "critical"
        assert node in alert["annotations"]["summary"]
    finally:
        os.kill(pid, signal.SIGCONT)
    stack.prometheus.wait(
        "NodeUnavailable resolved", lambda: not _alert(stack, "GpuscalerNodeUnavailable", "firing", node=node), 90
    )


def test_both_metrics_pages_pass_promtool_check_metrics(stack: Stack) -> None:
    """promtool's linter on the live /metrics of an agent and of the gateway: no problem reported."""
    promtool = locate(chart_tools.PROMTOOL)
    for name in (NODES[0], "gateway"):
        with urllib.request.urlopen(f"http://127.0.0.1:{stack.metrics[name]}/metrics", timeout=10) as response:
            page = response.read()
        result = subprocess.run([str(promtool), "check", "metrics"], input=page, capture_output=True, timeout=60)
        assert result.returncode == 0, (name, result.stdout.decode() + result.stderr.decode())


def _fake(agent: Process, *words: str) -> None:
    command = [str(CONSOLE_SCRIPT), "fake", words[0], "--address", f"127.0.0.1:{agent.port}", *words[1:]]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


# The dashboard's variables as a user who selects everything sends them, and a rate window over the few seconds
# of data this stack has.
DASHBOARD_VARIABLES = {
    "__rate_interval": "10s",
    "__interval": "10s",
    "namespace": ".*",
    "scaled_object": ".*",
    "node": ".*",
}


# Panels this stack cannot feed, and why: everything else must draw something.
NO_DATA_HERE = {
    "Idle GPU power by workload": "needs a workload's pods on the kubelet; these agents read no pod resources",
    "Engine pages readable": "no engine pod is selected here (e2e/keda/test_engines.py reads engines)",
    "Engine page age": "no engine pod is selected here",
    "Engine series read": "no engine pod is selected here",
    "NVML errors": "the fake collector makes no NVML calls",
}


def test_every_dashboard_query_runs_and_the_workload_and_gpu_panels_have_data(stack: Stack) -> None:
    """Each panel's queries, as Grafana sends them with every node and workload selected, run in the real
    Prometheus without an error (a join that matches many-to-many, say, fails only here); after one KEDA-like
    GetMetrics (leaving the unheard node out), every panel has series but those ``NO_DATA_HERE`` names."""
    from tests.monitoring.test_dashboard import expressions, load

    # minNodes: the unheard agent is left out, as a partial answer, instead of making the value unknown. KEDA's own
    # calls, not `gpuscaler query`'s: a preview feeds none of the per-ScaledObject series the workload panels read.
    metadata = {"metric": "gpu_utilization", "targetValue": "70", "minNodes": "2"}
    asyncio.run(_ask_as_keda(stack.gateway.port, ("ml", "trainer"), metadata))
    # Rates over 10 s need that much data after the calls: wait for the panels, not for a fixed time.
    queries = [
        (where, re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: DASHBOARD_VARIABLES[m[1] or m[2]], expr))
        for where, expr in expressions(load())
    ]
    deadline = time.monotonic() + 60
    while True:
        empty = sorted(_title(where) for where, query in queries if not stack.prometheus.query(query))
        if empty == sorted(NO_DATA_HERE) or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert empty == sorted(NO_DATA_HERE), empty


def _title(where: str) -> str:
    """A panel's title, or a variable's name, from ``expressions``' description of where a query is."""
    return where.split("'")[1] if "'" in where else where


async def _ask_as_keda(port: int, scaled_object: tuple[str, str], metadata: dict[str, str]) -> None:
    """GetMetricSpec, GetMetrics with the name it gave, and StreamIsActive's first message, for ``scaled_object``
    (namespace, name), as KEDA asks."""
    namespace, name = scaled_object
    channel = Channel("127.0.0.1", port)
    try:
        scaler = keda.ExternalScalerStub(channel)
        ref = keda.ScaledObjectRef(name=name, namespace=namespace, scaler_metadata=metadata)
        spec = await scaler.get_metric_spec(ref, timeout=10)
        request = keda.GetMetricsRequest(scaled_object_ref=ref, metric_name=spec.metric_specs[0].metric_name)
        await scaler.get_metrics(request, timeout=10)
        # An external-push trigger's stream: its first message, as KEDA reads it, for the push-stream panels.
        async with asyncio.timeout(10):
            async for _ in scaler.stream_is_active(ref):
                break
    finally:
        channel.close()
