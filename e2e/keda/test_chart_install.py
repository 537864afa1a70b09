"""`helm install` of the chart against the real API server: what its output says comes from the cluster's objects.

NOTES.txt reads the nodes, the release namespace and the RuntimeClass with helm's ``lookup``; the chart tests render
that part from made-up objects (tests/chart/test_chart_nodes.py). Here helm reads real ones, created in the loopback
API server: the test fails if the lookups' shape is not what the template reads. ``--dry-run=server`` sends every
manifest through the API server's admission without creating it (there is no kubelet to run the pods).
"""

from __future__ import annotations

import asyncio
import os
import secrets
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from e2e.keda.control_plane import Json, namespace
from e2e.keda.scenario import Scenario
from tests.chart import chart_tools
from tests.tools import locate

CHART = Path(__file__).resolve().parents[2] / "charts" / "gpuscaler"


def _node(name: str, labels: dict[str, str], taints: list[dict[str, str]] | None = None) -> Json:
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": labels},
        "spec": {"taints": taints or []},
    }


@pytest.fixture
async def nodes(scenario: Scenario) -> AsyncIterator[dict[str, str]]:
    """A GPU node labelled by GPU feature discovery, one by GKE with a taint the agent does not tolerate, and a node
    without a GPU; deleted afterwards (Nodes are cluster-wide)."""
    suffix = secrets.token_hex(3)
    names = {role: f"{role}-{suffix}" for role in ("gfd", "gke-tainted", "cpu")}
    created = [
        _node(names["gfd"], {"nvidia.com/gpu.present": "true"}),
        _node(
            names["gke-tainted"],
            {"cloud.google.com/gke-accelerator": "nvidia-l4"},
            [{"key": "sku", "value": "gpu", "effect": "NoSchedule"}],
        ),
        _node(names["cpu"], {"kubernetes.io/arch": "amd64"}),
    ]
    kube = scenario.plane.kube
    for document in created:
        await asyncio.to_thread(kube.request, "POST", "/api/v1/nodes", document)
    yield names
    for name in names.values():
        await asyncio.to_thread(kube.request, "DELETE", f"/api/v1/nodes/{name}")


async def _install(scenario: Scenario, *sets: str) -> subprocess.CompletedProcess[str]:
    kubeconfig = scenario.plane.kubeconfig
    assert kubeconfig is not None
    helm = locate(chart_tools.HELM)
    home = scenario.directory / "helm"
    environment = dict(os.environ) | {
        name: str(home / name) for name in ("HELM_CACHE_HOME", "HELM_CONFIG_HOME", "HELM_DATA_HOME")
    }
    command = [str(helm), "install", "gpuscaler", str(CHART), "-n", scenario.namespace, "--kubeconfig", str(kubeconfig)]
    command += ["--dry-run=server", *(arg for value in sets for arg in ("--set", value))]
    return await asyncio.to_thread(
        subprocess.run, command, capture_output=True, text=True, env=environment, timeout=120
    )


async def test_install_output_names_the_nodes_taints_and_pod_security_it_finds(
    scenario: Scenario, nodes: dict[str, str]
) -> None:
    """The output lists the GPU nodes (not the CPU node), names the taint that keeps the agent off one, warns that a
    namespace at "baseline" refuses the agents, and that RuntimeClass nvidia does not exist; the API server admits
    every manifest."""
    labelled = namespace(scenario.namespace)
    labelled["metadata"]["labels"] = {"pod-security.kubernetes.io/enforce": "baseline"}
    await scenario.apply(labelled)
    result = await _install(scenario)
    assert result.returncode == 0, result.stderr
    notes = result.stdout.split("NOTES:", 1)[1]
    matching = next(line for line in notes.splitlines() if line.startswith("Nodes that match now"))
    assert nodes["gfd"] in matching
    assert nodes["gke-tainted"] in matching
    assert nodes["cpu"] not in matching
    assert f"{nodes['gke-tainted']} (sku=gpu:NoSchedule)" in notes
    assert f'Namespace {scenario.namespace} enforces Pod Security "baseline"' in notes
    assert 'RuntimeClass "nvidia" does not exist' in notes


async def test_without_a_matching_node_the_output_warns(scenario: Scenario, nodes: dict[str, str]) -> None:
    """With node labels no node has, the output says NO NODE MATCHES; with agent.clusterCheck false it says nothing
    about nodes."""
    result = await _install(
        scenario, "agent.gpuNodeLabels[0].key=example.com/none", "agent.gpuNodeLabels[0].operator=Exists"
    )
    assert result.returncode == 0, result.stderr
    assert "WARNING: NO NODE MATCHES" in result.stdout.split("NOTES:", 1)[1]
    unchecked = await _install(scenario, "agent.clusterCheck=false")
    assert unchecked.returncode == 0, unchecked.stderr
    assert "Nodes that match now" not in unchecked.stdout
    assert "NO NODE MATCHES" not in unchecked.stdout
