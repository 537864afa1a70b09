"""Which nodes the agents run on, and what the install output says about the cluster it reads.

A DaemonSet whose node selection matches no node starts no pod and reports no error, so the chart ORs the labels
that every common GPU labeller sets, and NOTES.txt reads the cluster's nodes, namespace and RuntimeClass (helm's
``lookup``) to warn when the agents would not run. ``helm template`` never reads a cluster, so the part of NOTES.txt
that does is a named template, rendered here with made-up clusters through a parent chart.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped]  # no stubs in the dev dependencies
import pytest
import yaml

from tests.chart.rendering import (
    CHART,
    CI_VALUES,
    NAMESPACE,
    RELEASE,
    Helm,
    Manifest,
    find,
    pod_spec,
    selects,
)

CI = {path.name.removesuffix("-values.yaml"): path for path in CI_VALUES}
VALUES = yaml.safe_load((CHART / "values.yaml").read_text())
SCHEMA = json.loads((CHART / "values.schema.json").read_text())
# One node per labeller the defaults name, labelled as that labeller labels a GPU node.
LABELLED_GPU_NODES = {
    "gfd": {"nvidia.com/gpu.present": "true"},
    "nfd": {"feature.node.kubernetes.io/pci-10de.present": "true"},
    "gke": {"cloud.google.com/gke-accelerator": "nvidia-l4"},
    "aks": {"kubernetes.azure.com/accelerator": "nvidia"},
    "karpenter": {"karpenter.k8s.aws/instance-gpu-manufacturer": "nvidia"},
    "eks-auto": {"eks.amazonaws.com/instance-gpu-manufacturer": "nvidia"},
}
PROBE_TEMPLATE = """\
{{- $root := dict "Values" .Values.gpuscaler "Release" .Release }}
{{- $cluster := dict "nodes" .Values.nodes "namespace" .Values.namespace "runtimeClass" .Values.runtimeClass }}
notes: {{ include "gpuscaler.clusterNotes" (merge (dict "root" $root) $cluster) | toJson }}
"""


def node(name: str, labels: dict[str, str] | None = None, taints: Sequence[dict[str, str]] = ()) -> Manifest:
    """A Node as the API lists it, with only what the check reads."""
    return {"metadata": {"name": name, "labels": labels or {}}, "spec": {"taints": list(taints)}}


@dataclass(frozen=True)
class Probe:
    """A parent chart holding this chart, whose one template renders "gpuscaler.clusterNotes" for a made-up cluster."""

    helm: Helm
    chart: Path

    def notes(
        self,
        nodes: Sequence[Manifest] | None,
        *,
        namespace_labels: dict[str, str] | None = None,
        runtime_class: bool = True,
        sets: Sequence[str] = (),
    ) -> str:
        """What NOTES.txt says about a cluster with these nodes (None: helm read no cluster)."""
        cluster: dict[str, Any] = {
            "nodes": {} if nodes is None else {"items": list(nodes)},
            "namespace": {"metadata": {"name": NAMESPACE, "labels": namespace_labels or {}}},
            "runtimeClass": {"metadata": {"name": "nvidia"}} if runtime_class else {},
        }
        values = self.chart / f"cluster-{len(list(self.chart.glob('cluster-*')))}.yaml"
        values.write_text(yaml.safe_dump(cluster))
        args = ["template", RELEASE, str(self.chart), "-n", NAMESPACE, "--show-only", "templates/probe.yaml"]
        args += ["--values", str(values)]
        for assignment in sets:
            args += ["--set", f"gpuscaler.{assignment}"]
        result = self.helm.run(*args)
        assert result.returncode == 0, result.stderr
        notes: str = yaml.safe_load(result.stdout.split("---", 1)[1])["notes"]
        return notes


@pytest.fixture(scope="module")
def probe(helm: Helm, tmp_path_factory: pytest.TempPathFactory) -> Probe:
    """The parent chart, with a copy of charts/gpuscaler as its subchart."""
    chart = tmp_path_factory.mktemp("probe-chart")
    (chart / "Chart.yaml").write_text("apiVersion: v2\nname: probe\nversion: 0.0.1\n")
    (chart / "templates").mkdir()
    (chart / "templates" / "probe.yaml").write_text(PROBE_TEMPLATE)
    shutil.copytree(CHART, chart / "charts" / "gpuscaler")
    return Probe(helm, chart)


def required_terms(spec: Manifest) -> list[dict[str, Any]]:
    """The required node affinity's terms of a pod spec (Kubernetes ORs them)."""
    terms: list[dict[str, Any]] = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ]
    return terms


def test_each_gpu_node_label_is_a_term_of_its_own(helm: Helm) -> None:
    """Every entry of agent.gpuNodeLabels is one term of the required node affinity, so any one label suffices."""
    spec = pod_spec(find(helm.template(CI["defaults"]), "DaemonSet"))
    assert required_terms(spec) == [{"matchExpressions": [entry]} for entry in VALUES["agent"]["gpuNodeLabels"]]
    keys = {expression["key"] for term in required_terms(spec) for expression in term["matchExpressions"]}
    assert keys == {key for labels in LABELLED_GPU_NODES.values() for key in labels}


def test_an_empty_label_list_runs_the_agent_on_every_node(helm: Helm) -> None:
    """agent.gpuNodeLabels [] (the fake-GPU scenario) renders no node affinity and no node selector."""
    for manifests in (
        helm.template(CI["fake"]),
        helm.template(CI["defaults"], extra=["--set-json", "agent.gpuNodeLabels=[]"]),
    ):
        spec = pod_spec(find(manifests, "DaemonSet"))
        assert "affinity" not in spec
        assert "nodeSelector" not in spec


def test_an_own_required_node_affinity_replaces_the_labels_and_the_rest_is_kept(helm: Helm) -> None:
    """A required node affinity in agent.affinity replaces the GPU labels' (two ORed lists cannot be ANDed); a
    preferred one and pod affinity are kept beside the GPU labels' terms."""
    own = {"nodeSelectorTerms": [{"matchExpressions": [{"key": "pool", "operator": "In", "values": ["a100"]}]}]}
    replaced = helm.template(
        CI["defaults"],
        extra=[
            "--set-json",
            f"agent.affinity={json.dumps({'nodeAffinity': {'requiredDuringSchedulingIgnoredDuringExecution': own}})}",
        ],
    )
    assert pod_spec(find(replaced, "DaemonSet"))["affinity"]["nodeAffinity"] == {
        "requiredDuringSchedulingIgnoredDuringExecution": own
    }
    preferred = [{"weight": 1, "preference": {"matchExpressions": [{"key": "zone", "operator": "Exists"}]}}]
    added = helm.template(
        CI["defaults"],
        extra=[
            "--set-json",
            "agent.affinity="
            + json.dumps({"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": preferred}}),
        ],
    )
    spec = pod_spec(find(added, "DaemonSet"))
    assert spec["affinity"]["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"] == preferred
    assert len(required_terms(spec)) == len(VALUES["agent"]["gpuNodeLabels"])


def test_node_selector_adds_labels_every_agent_node_must_have(helm: Helm) -> None:
    """agent.nodeSelector is rendered beside the affinity, so Kubernetes ANDs it with the GPU labels."""
    spec = pod_spec(find(helm.template(CI["defaults"], sets=["agent.nodeSelector.pool=train"]), "DaemonSet"))
    assert spec["nodeSelector"] == {"pool": "train"}
    assert len(required_terms(spec)) == len(VALUES["agent"]["gpuNodeLabels"])


@pytest.mark.parametrize(
    "entry",
    [
        {"key": "a", "operator": "Exists", "values": ["x"]},
        {"key": "a", "operator": "In"},
        {"key": "a", "operator": "In", "values": []},
        {"key": "a", "operator": "Equals", "values": ["x"]},
        {"key": "a", "operator": "In", "value": "x"},
        {"operator": "Exists"},
    ],
)
def test_the_schema_refuses_a_label_entry_kubernetes_would(entry: dict[str, Any]) -> None:
    """values.schema.json refuses what the API server would refuse in a NodeSelectorRequirement, and typos."""
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    values["agent"]["gpuNodeLabels"] = [entry]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(values, SCHEMA)


def test_a_node_labelled_by_any_labeller_gets_an_agent_and_a_plain_node_does_not(probe: Probe) -> None:
    """The install output lists the nodes the DaemonSet matches: one per labeller, not the node without a GPU."""
    nodes = [node(name, labels) for name, labels in LABELLED_GPU_NODES.items()]
    notes = probe.notes([*nodes, node("cpu-1", {"kubernetes.io/arch": "amd64"})])
    assert f"Nodes that match now (6 of 7): {', '.join(LABELLED_GPU_NODES)}" in notes
    assert "WARNING" not in notes


def test_no_matching_node_is_a_warning(probe: Probe) -> None:
    """A cluster none of whose nodes has a GPU label gets a warning that names the fix, not silence."""
    notes = probe.notes([node("cpu-1"), node("gpu-1", {"nvidia.com/gpu.present": "false"})])
    assert "WARNING: NO NODE MATCHES. None of the cluster's 2 node(s) has any of agent.gpuNodeLabels" in notes
    assert "kubectl label node NODE" in notes
    assert '"The DaemonSet runs no agent"' in notes
    assert "Nodes that match now" not in notes
    assert "NO NODE MATCHES" in probe.notes([])


def test_node_selector_and_architectures_narrow_the_match(probe: Probe) -> None:
    """agent.nodeSelector must hold too, and with agent.nvmlHostMounts only the listed architectures match."""
    gpu = {"nvidia.com/gpu.present": "true"}
    nodes = [node("a", gpu | {"kubernetes.io/arch": "amd64"}), node("b", gpu | {"kubernetes.io/arch": "s390x"})]
    assert "(1 of 2): a" in probe.notes(nodes, sets=["agent.nvmlHostMounts.enabled=true"])
    assert "(2 of 2)" in probe.notes(nodes)
    assert "NO NODE MATCHES" in probe.notes(nodes, sets=["agent.nodeSelector.pool=train"])


def test_taints_the_agent_does_not_tolerate_are_named(probe: Probe) -> None:
    """A matching node with a NoSchedule or NoExecute taint outside agent.tolerations is named with the taint; the
    GPU taint (tolerated by default), PreferNoSchedule and the DaemonSet controller's own tolerations (by key and
    effect: not-ready NoExecute, not not-ready NoSchedule) are not."""
    gpu = {"nvidia.com/gpu.present": "true"}
    nodes = [
        node("tainted", gpu, [{"key": "sku", "value": "gpu", "effect": "NoSchedule"}]),
        node("gpu-taint", gpu, [{"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}]),
        node("soft", gpu, [{"key": "spot", "effect": "PreferNoSchedule"}]),
        node("cordoned", gpu, [{"key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule"}]),
        node("lost", gpu, [{"key": "node.kubernetes.io/unreachable", "effect": "NoExecute"}]),
        node("not-ready", gpu, [{"key": "node.kubernetes.io/not-ready", "effect": "NoSchedule"}]),
        node("dedicated", gpu, [{"key": "dedicated", "effect": "NoExecute"}]),
        node("cpu", {}, [{"key": "other", "effect": "NoSchedule"}]),
    ]
    blocked = "not-ready (node.kubernetes.io/not-ready:NoSchedule), dedicated (dedicated:NoExecute)."
    notes = probe.notes(nodes)
    assert f"WARNING: TAINTS KEEP THE AGENT OFF 3 MATCHING NODE(S): tainted (sku=gpu:NoSchedule), {blocked}" in notes
    tolerated = probe.notes(nodes, sets=["agent.tolerations[0].key=sku", "agent.tolerations[0].operator=Exists"])
    # agent.tolerations replaces the list: sku is tolerated now, and the GPU taint no longer is.
    assert f"OFF 3 MATCHING NODE(S): gpu-taint (nvidia.com/gpu=present:NoSchedule), {blocked}" in tolerated


def test_a_namespace_that_enforces_a_stricter_level_is_a_warning(probe: Probe) -> None:
    """Where the namespace enforces "baseline" or "restricted", the output says the agents' pods will be refused
    and why; without podResources (and host mounts, processes) the agents pass "restricted" and nothing is said."""
    gpu = [node("a", {"nvidia.com/gpu.present": "true"})]
    for level in ("baseline", "restricted"):
        notes = probe.notes(gpu, namespace_labels={"pod-security.kubernetes.io/enforce": level})
        assert (
            f'WARNING: THE AGENTS\' PODS WILL BE REFUSED. Namespace {NAMESPACE} enforces Pod Security "{level}"'
            in notes
        )
        assert "a hostPath of /var/lib/kubelet/pod-resources (agent.podResources)" in notes
        assert f"kubectl label namespace {NAMESPACE} pod-security.kubernetes.io/enforce=privileged --overwrite" in notes
    privileged = probe.notes(gpu, namespace_labels={"pod-security.kubernetes.io/enforce": "privileged"})
    assert "WILL BE REFUSED" not in privileged
    assert 'the agents need the "privileged" level' in privileged
    restricted = {"pod-security.kubernetes.io/enforce": "restricted"}
    quiet = probe.notes(gpu, namespace_labels=restricted, sets=["agent.podResources.enabled=false"])
    assert "Pod Security" not in quiet
    assert "hostPID (agent.processes)" in probe.notes(
        gpu, namespace_labels=restricted, sets=["agent.processes.enabled=true"]
    )


def test_a_missing_runtime_class_is_a_warning(probe: Probe) -> None:
    """agent.runtimeClassName naming a RuntimeClass the cluster lacks is a warning; none is said when it exists, when
    the name is empty, or when helm read no cluster."""
    gpu = [node("a", {"nvidia.com/gpu.present": "true"})]
    assert 'WARNING: RuntimeClass "nvidia" does not exist' in probe.notes(gpu, runtime_class=False)
    assert "RuntimeClass" not in probe.notes(gpu)
    assert "RuntimeClass" not in probe.notes(gpu, runtime_class=False, sets=["agent.runtimeClassName="])
    assert "RuntimeClass" not in probe.notes(None, runtime_class=False)


def test_without_a_cluster_nothing_is_claimed_about_nodes(probe: Probe) -> None:
    """When helm did not read the cluster (helm template, --dry-run=client, agent.clusterCheck false), the output
    neither lists nodes nor warns about them."""
    notes = probe.notes(None)
    assert "Nodes that match" not in notes
    assert "NO NODE MATCHES" not in notes


def test_a_non_root_agent_with_pod_resources_is_a_warning(probe: Probe) -> None:
    """A user that keeps podResources on but sets a non-root user is told that the agent cannot open the socket."""
    warning = "WARNING: agent.podResources is on but the agent does not run as uid 0"
    assert warning in probe.notes(None, sets=["agent.podSecurityContext.runAsUser=65532"])
    assert warning not in probe.notes(None)
    assert warning not in probe.notes(None, sets=["agent.podResources.enabled=false"])


def test_the_install_output_does_the_lookups_and_gives_the_check_command(helm: Helm) -> None:
    """NOTES.txt renders the cluster part (here without a cluster) and a kubectl command whose selector picks the
    agents' DaemonSet; agent.clusterCheck false still renders."""
    manifests = helm.template(CI["defaults"])
    daemonset = find(manifests, "DaemonSet")
    for sets in ((), ("--set", "agent.clusterCheck=false")):
        result = helm.run("install", RELEASE, str(CHART), "-n", NAMESPACE, "--dry-run=client", *sets)
        assert result.returncode == 0, result.stderr
        notes = result.stdout.split("NOTES:", 1)[1]
        command = next(line.strip() for line in notes.splitlines() if "get daemonset" in line)
        selector = dict(pair.split("=") for pair in command.rsplit(" ", 1)[1].split(","))
        assert command.startswith(f"kubectl -n {NAMESPACE} get daemonset -l ")
        assert selects(selector, daemonset["metadata"]["labels"])
        assert not selects(selector, find(manifests, "Deployment")["metadata"]["labels"])
    notes_text = (CHART / "templates" / "NOTES.txt").read_text()
    assert 'lookup "v1" "Node" "" ""' in notes_text
    assert "if $agent.clusterCheck" in notes_text
