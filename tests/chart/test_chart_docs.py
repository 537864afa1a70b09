"""What people read: values.yaml comments, NOTES.txt, the README, and the ScaledObject examples."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema  # type: ignore[import-untyped]  # no stubs in the dev dependencies
import pytest
import yaml

from gpuscaler.gateway.directory.pod_watch import pod_info
from gpuscaler.model.aggregation import Aggregation
from gpuscaler.model.engines import ENGINE_SIGNALS
from gpuscaler.query.metadata import Limits, parse_metadata
from gpuscaler.query.profiles import PROFILES, SIGNAL_PROFILES
from gpuscaler.query.query import CombinedQuery, EngineQuery
from gpuscaler.signals.engines.pods import Endpoint, metrics_endpoint
from tests.chart.rendering import (
    CHART,
    CI_VALUES,
    EXAMPLES,
    NAMESPACE,
    RELEASE,
    Helm,
    Manifest,
    find,
    of_kind,
    yaml_documents,
)

KEY = re.compile(r"^(?P<indent> *)(?P<key>[A-Za-z0-9_.\"/-]+):(?: |$)")


def uncommented_keys(text: str) -> list[str]:
    """Mapping keys of values.yaml with no comment line right above them (keys inside list items are data)."""
    missing: list[str] = []
    previous = ""
    list_indent: int | None = None
    for line in text.splitlines():
        stripped = line.strip()
        indent = len(line) - len(line.lstrip())
        if list_indent is not None and stripped and indent <= list_indent and not stripped.startswith("-"):
            list_indent = None
        if stripped.startswith("- ") and list_indent is None:
            list_indent = indent
        match = KEY.match(line)
        if match and list_indent is None and not previous.startswith("#"):
            missing.append(f"{match.group('key')} (line: {line.strip()})")
        if stripped:
            previous = stripped
    return missing


def test_every_key_in_values_yaml_has_a_comment_above_it() -> None:
    """A reader of values.yaml finds what every key does right above it."""
    assert uncommented_keys((CHART / "values.yaml").read_text()) == []


def test_the_comment_check_notices_a_missing_comment() -> None:
    """The check above fails for a key without a comment, nested or not, but not for list items."""
    text = "# a\nimage:\n  # b\n  tag: x\n  pullPolicy: y\nlist:\n  - key: v\n    other: w\nlast: 1\n"
    assert uncommented_keys(text) == ["pullPolicy (line: pullPolicy: y)", "list (line: list:)", "last (line: last: 1)"]


def test_notes_give_the_keda_address_and_the_one_node_warning(helm: Helm) -> None:
    """NOTES.txt names the Service KEDA should use, and says a ClusterIP reaches ONE node when the gateway is off."""
    result = helm.run("install", RELEASE, str(CHART), "--namespace", NAMESPACE, "--dry-run=client")
    assert result.returncode == 0, result.stderr
    notes = result.stdout.split("NOTES:", 1)[1]
    service = find(helm.template(CI_VALUES[0]), "Service", RELEASE)["metadata"]["name"]
    assert f"{service}.{NAMESPACE}.svc.cluster.local:6000" in notes
    assert "That is the gateway" in notes
    assert "ONE NODE ONLY" not in notes
    assert "PRIVILEGED" not in notes
    without = helm.run(
        "install", RELEASE, str(CHART), "-n", NAMESPACE, "--dry-run=client", "--set", "gateway.enabled=false"
    )
    assert "ONE NODE ONLY" in without.stdout.split("NOTES:", 1)[1]


@pytest.mark.parametrize(
    ("sets", "port"),
    [
        (("gateway.listen.port=7100",), 7100),
        (("gateway.listen.port=7100", "gateway.enabled=false", "agent.listen.port=7200"), 7200),
    ],
)
def test_keda_reaches_the_port_of_the_component_its_service_fronts(
    helm: Helm, sets: tuple[str, ...], port: int
) -> None:
    """KEDA's Service listens on the port of what it selects (the gateway's, or the agents' without one), and
    NOTES gives KEDA that address."""
    service = find(helm.template(CI_VALUES[0], sets=sets), "Service", RELEASE)
    (grpc,) = [p for p in service["spec"]["ports"] if p["name"] == "grpc"]
    assert (grpc["port"], grpc["targetPort"]) == (port, "grpc")
    flags = [flag for pair in sets for flag in ("--set", pair)]
    result = helm.run("install", RELEASE, str(CHART), "-n", NAMESPACE, "--dry-run=client", *flags)
    assert f"{service['metadata']['name']}.{NAMESPACE}.svc.cluster.local:{port}" in result.stdout.split("NOTES:", 1)[1]


def test_notes_warn_when_host_mounts_make_the_agent_privileged(helm: Helm) -> None:
    """With agent.nvmlHostMounts the install output says it runs privileged."""
    host_mounts = CHART / "ci" / "host-mounts-values.yaml"
    result = helm.run("install", RELEASE, str(CHART), "-n", NAMESPACE, "--dry-run=client", "-f", str(host_mounts))
    assert result.returncode == 0, result.stderr
    assert "PRIVILEGED" in result.stdout.split("NOTES:", 1)[1]


def test_notes_say_when_the_agents_share_the_host_pid_namespace(helm: Helm) -> None:
    """With agent.processes the install output names hostPID and the Pod Security level it needs."""
    processes = CHART / "ci" / "processes-values.yaml"
    result = helm.run("install", RELEASE, str(CHART), "-n", NAMESPACE, "--dry-run=client", "-f", str(processes))
    assert result.returncode == 0, result.stderr
    notes = result.stdout.split("NOTES:", 1)[1]
    assert "HOST PID NAMESPACE" in notes
    assert '"privileged"' in notes


def test_readme_explains_the_one_node_limit() -> None:
    """The README says that KEDA reads one node until the gateway exists."""
    readme = (CHART / "README.md").read_text()
    assert "KEDA reads ONE node" in readme
    assert "headless" in readme


@pytest.mark.parametrize("trigger", ["external", "external-push"])
def test_there_is_one_example_per_profile_and_trigger(trigger: str) -> None:
    """examples/<trigger>/ has a ScaledObject for each profile the agent knows, using that trigger."""
    files = sorted((CHART / "examples" / trigger).glob("*.yaml"))
    profiles = set()
    for path in files:
        (scaled_object,) = yaml_documents(path)
        (trigger_spec,) = scaled_object["spec"]["triggers"]
        assert trigger_spec["type"] == trigger
        profiles.add(trigger_spec["metadata"]["profile"])
        assert path.stem == trigger_spec["metadata"]["profile"]
    assert profiles == set(PROFILES)


ENGINE_EXAMPLES = sorted((CHART / "examples" / "engines").glob("*.yaml"))


def _engine_example(path: Path) -> tuple[Manifest, Manifest, Manifest]:
    """The example's Deployment, its ScaledObject and that ScaledObject's one trigger."""
    documents = list(yaml_documents(path))
    assert sorted(d["kind"] for d in documents) == ["Deployment", "ScaledObject"], path.name
    scaled_object = find(documents, "ScaledObject")
    (trigger,) = scaled_object["spec"]["triggers"]
    return find(documents, "Deployment"), scaled_object, trigger


def test_there_is_one_engine_example_per_signal_profile() -> None:
    """examples/engines/ has one file per engine-signal profile that reads the model servers' own pods, named after
    it: the Deployment and the ScaledObject that scales it on that profile. A profile on the EPP's signals (epp-wake)
    reads the EPP's pods, not its scale target's, so its example is the serving-from-zero one, not of this shape."""
    profiles = set()
    for path in ENGINE_EXAMPLES:
        deployment, scaled_object, trigger = _engine_example(path)
        assert trigger["metadata"]["profile"] == path.stem
        profiles.add(path.stem)
        assert scaled_object["spec"]["scaleTargetRef"] == {"name": deployment["metadata"]["name"]}
        assert scaled_object["metadata"]["namespace"] == deployment["metadata"]["namespace"]
    reads_own_pods = {
        name
        for name, profile in SIGNAL_PROFILES.items()
        if not any(ENGINE_SIGNALS[metric].absent_unknown for metric, _ in profile.signals)  # type: ignore[index]
    }
    assert reads_own_pods
    assert profiles == reads_own_pods


@pytest.mark.parametrize("example", ENGINE_EXAMPLES, ids=[p.name for p in ENGINE_EXAMPLES])
def test_an_engine_example_reads_the_pods_of_its_deployment_where_they_serve_metrics(example: Path) -> None:
    """A pod of the example's Deployment, Running and Ready as the API would show it, is selected by the trigger
    (the Deployment's name as its workload, or the scale target's pods) and has a metrics page the gateway finds,
    on a port its engine container declares."""
    deployment, _, trigger = _engine_example(example)
    name, namespace = deployment["metadata"]["name"], deployment["metadata"]["namespace"]
    template = deployment["spec"]["template"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= template["metadata"]["labels"].items()
    pod = {
        "metadata": {
            **template["metadata"],
            "namespace": namespace,
            "name": f"{name}-7c9d8f6b5-x2x4p",
            "labels": {**template["metadata"]["labels"], "pod-template-hash": "7c9d8f6b5"},
            "ownerReferences": [{"kind": "ReplicaSet", "name": f"{name}-7c9d8f6b5", "controller": True}],
        },
        "spec": template["spec"],
        "status": {"podIP": "10.0.0.7", "phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]},
    }
    info = pod_info(pod)
    assert info is not None
    selects = trigger["metadata"].get("workload") == name or trigger["metadata"].get("scaleTargetPods") == "true"
    assert selects, trigger["metadata"]
    assert (info.workload_kind, info.workload) == ("Deployment", name)
    (metric, _), *_ = SIGNAL_PROFILES[trigger["metadata"]["profile"]].signals
    engine = ENGINE_SIGNALS[metric].engine  # type: ignore[index]  # signal profiles name engine signals
    endpoint = metrics_endpoint(info, engine)
    assert isinstance(endpoint, Endpoint), endpoint
    (container,) = template["spec"]["containers"]
    assert endpoint.port in {port["containerPort"] for port in container["ports"]}


@pytest.mark.parametrize("example", ENGINE_EXAMPLES, ids=[p.name for p in ENGINE_EXAMPLES])
def test_an_engine_example_gives_the_hpa_a_value_it_counts_replicas_from(example: Path) -> None:
    """A sum over the pods (a queue, a rate) and a combined answer (already in replicas) keep KEDA's default
    AverageValue; an average over the pods (a cache's fill, a wait) sets metricType Value, or the HPA could never go
    above ceil(100 / target) replicas."""
    _, scaled_object, trigger = _engine_example(example)
    query = parse_metadata(
        trigger["metadata"],
        Limits(history_seconds=600, cluster=True),
        namespace=scaled_object["metadata"]["namespace"],
        name=scaled_object["metadata"]["name"],
    )
    metric_type = trigger.get("metricType", "AverageValue")
    if isinstance(query.value, CombinedQuery):
        assert metric_type == "AverageValue"
    else:
        assert isinstance(query.value, EngineQuery)
        averaged = query.value.aggregation is Aggregation.AVG
        assert metric_type == ("Value" if averaged else "AverageValue"), query.value


@pytest.mark.parametrize("example", EXAMPLES, ids=[f"{p.parent.name}/{p.name}" for p in EXAMPLES])
def test_examples_use_metadata_the_agent_accepts_and_the_chart_service(helm: Helm, example: Path) -> None:
    """Each example trigger's metadata parses with the agent's own parser (given the ScaledObject's namespace and
    name, as KEDA sends them), and its address is the chart's Service (serving-from-zero has two triggers: the EPP's
    wake and the model servers' queue)."""
    scaled_object = find(list(yaml_documents(example)), "ScaledObject")
    triggers = scaled_object["spec"]["triggers"]
    assert triggers
    metadata = scaled_object["metadata"]
    service = find(helm.template(CI_VALUES[0]), "Service", RELEASE)
    port = service["spec"]["ports"][0]["port"]
    for trigger in triggers:
        parse_metadata(
            trigger["metadata"], Limits(history_seconds=600), namespace=metadata["namespace"], name=metadata["name"]
        )
        assert trigger["metadata"]["scalerAddress"] == f"{RELEASE}.{NAMESPACE}.svc.cluster.local:{port}"


def test_examples_are_not_rendered_by_the_chart(helm: Helm) -> None:
    """No scenario renders a ScaledObject: examples/ is outside templates/."""
    for values in CI_VALUES:
        assert of_kind(helm.template(values), "ScaledObject") == []
    assert not list((CHART / "templates").rglob("*scaledobject*"))


def _moved_keys() -> list[tuple[str, list[str]]]:
    """(old key, new keys) for each row of the README's "Upgrading / values moved" table."""
    readme = (CHART / "README.md").read_text()
    section = readme.split("\n## Upgrading / values moved\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    moved = []
    for row in rows:
        old, new = row.strip("|").split("|")[:2]
        (old_key,) = re.findall(r"`([^`]+)`", old)
        moved.append((old_key, [key for key in re.findall(r"`([^`]+)`", new) if "." in key]))
    return moved


def _lookup(values: dict[str, object], dotted: str) -> bool:
    section: object = values
    for key in dotted.split("."):
        if not isinstance(section, dict) or key not in section:
            return False
        section = section[key]
    return True


def test_the_moved_keys_table_names_refused_old_keys_and_real_new_ones() -> None:
    """Each old key in the README's upgrade table is refused by the schema, and each new key is in values.yaml."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    moved = _moved_keys()
    assert len(moved) >= 10, "the table was found and read"
    for old, new in moved:
        with pytest.raises(jsonschema.ValidationError, match=f"'{old}' was unexpected"):
            jsonschema.validate(values | {old: {}}, schema)
        assert new, old
        assert all(_lookup(values, key) for key in new), (old, new)


def test_notes_point_to_the_upgrade_table(helm: Helm) -> None:
    """The install output names the README section that lists the moved keys, and that section exists."""
    result = helm.run("install", RELEASE, str(CHART), "--namespace", NAMESPACE, "--dry-run=client")
    assert result.returncode == 0, result.stderr
    assert '"Upgrading / values moved" in the chart\'s README' in result.stdout.split("NOTES:", 1)[1]
    assert "\n## Upgrading / values moved\n" in (CHART / "README.md").read_text()
