"""The rendered manifests against the Kubernetes API schemas (offline, strict), and values.schema.json itself."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema  # type: ignore[import-untyped]  # no stubs in the dev dependencies
import pytest
import yaml

from tests.chart.rendering import (
    CHART,
    CI_VALUES,
    EXAMPLES,
    Helm,
    Kubeconform,
    kinds,
)

VALUES_SCHEMA = json.loads((CHART / "values.schema.json").read_text())


@pytest.mark.parametrize("values", CI_VALUES, ids=[p.name for p in CI_VALUES])
def test_every_rendered_manifest_is_valid_for_the_kubernetes_api(
    helm: Helm, kubeconform: Kubeconform, values: Path, tmp_path: Path
) -> None:
    """kubeconform (strict, no unknown kinds) finds every resource of the scenario valid, CRDs included."""
    rendered = tmp_path / "rendered.yaml"
    rendered.write_text(helm.template_text(values))
    results = kubeconform.validate(rendered)
    problems = [
        f"{r['kind']} {r['name']}: {r['status']} {r.get('msg', '')}" for r in results if r["status"] != "statusValid"
    ]
    assert problems == []
    assert sorted(r["kind"] for r in results) == kinds(helm.template(values)), "every manifest was checked"


@pytest.mark.parametrize("example", EXAMPLES, ids=[f"{p.parent.name}/{p.name}" for p in EXAMPLES])
def test_examples_are_valid_keda_scaledobjects(kubeconform: Kubeconform, example: Path) -> None:
    """Each example holds a ScaledObject that KEDA's CRD schema accepts, and the Kubernetes API schemas accept
    whatever else it holds (an engine example's Deployment)."""
    documents = [document for document in yaml.safe_load_all(example.read_text()) if document]
    assert "ScaledObject" in [document["kind"] for document in documents]
    results = kubeconform.validate(example)
    assert sorted((r["kind"], r["status"], r.get("msg") or "") for r in results) == sorted(
        (document["kind"], "statusValid", "") for document in documents
    )


BROKEN = """\
apiVersion: apps/v1
kind: DaemonSet
metadata:
  name: typo
spec:
  selector: {matchLabels: {app: x}}
  template:
    metadata: {labels: {app: x}}
    spec:
      containers:
        - name: agent
          image: x
          securityContext: {readOnlyRootFileSystem: true}
          ports: [{containerPort: "6000"}]
---
apiVersion: monitoring.coreos.com/v1
kind: ServiceMonitor
metadata: {name: typo}
spec:
  selector: {matchLabels: {app: x}}
  endpoints: [{port: metrics, intervall: 15s}]
---
apiVersion: example.com/v1
kind: Unknown
metadata: {name: x}
"""


def test_validation_catches_typos_wrong_types_and_unknown_kinds(kubeconform: Kubeconform, tmp_path: Path) -> None:
    """A misspelt field, a string port, a CRD typo and a kind without a schema all fail: the check is not vacuous."""
    broken = tmp_path / "broken.yaml"
    broken.write_text(BROKEN)
    results = {r["kind"]: r for r in kubeconform.validate(broken)}
    assert results["DaemonSet"]["status"] == "statusInvalid"
    assert "readOnlyRootFileSystem" in results["DaemonSet"]["msg"]
    assert "containerPort" in results["DaemonSet"]["msg"]
    assert results["ServiceMonitor"]["status"] == "statusInvalid"
    assert "intervall" in results["ServiceMonitor"]["msg"]
    assert results["Unknown"]["status"] == "statusError"


def test_values_yaml_satisfies_its_own_schema() -> None:
    """The defaults pass values.schema.json (checked here without helm)."""
    jsonschema.validate(yaml.safe_load((CHART / "values.yaml").read_text()), VALUES_SCHEMA)


@pytest.mark.parametrize(
    ("assignment", "message"),
    [
        ("agent.listen.port=grpc", "at '/agent/listen/port': got string, want integer"),
        ("agent.metrics.enabled=yes", "at '/agent/metrics/enabled': got string, want boolean"),
        ("agent.collector=dcgm", "at '/agent/collector'"),
        ("agent.pollIntervall=1", "additional properties 'pollIntervall' not allowed"),
        ("agent.pollInterval=0", "at '/agent/pollInterval'"),
        ("agent.nvmlHostMount.enabled=true", "at '/agent': additional properties 'nvmlHostMount' not allowed"),
        ("agent.nvmlHostMounts.devices.mode=some", "at '/agent/nvmlHostMounts/devices/mode'"),
        (
            "agent.terminationGracePeriodSeconds=soon",
            "at '/agent/terminationGracePeriodSeconds': got string, want integer",
        ),
        ("gateway.probes.startup.periodSeconds=1", "at '/gateway/probes': additional properties 'startup' not allowed"),
        ("image.digest=latest", "at '/image/digest'"),
    ],
)
def test_schema_rejects_wrong_types_unknown_keys_and_bad_choices(helm: Helm, assignment: str, message: str) -> None:
    """helm refuses the values before rendering anything, naming the path of the bad value."""
    error = helm.template_error(sets=[assignment])
    assert message in error


def test_schema_accepts_decimal_seconds_from_the_command_line(helm: Helm) -> None:
    """`--set agent.pollInterval=0.25` works although helm keeps that decimal as a string."""
    assert helm.template(sets=["agent.pollInterval=0.25", "agent.drainTimeout=2.5"])


def test_schema_allows_global_for_use_as_a_subchart() -> None:
    """A parent chart passes `global`; rejecting unknown top-level keys must not reject it."""
    values = yaml.safe_load((CHART / "values.yaml").read_text()) | {"global": {"imageRegistry": "mirror"}}
    jsonschema.validate(values, VALUES_SCHEMA)
    with pytest.raises(jsonschema.ValidationError, match="'globals' was unexpected"):
        jsonschema.validate(values | {"globals": {}}, VALUES_SCHEMA)


# Sections whose keys are data, not the chart's: Kubernetes objects passed through as they are (the API server
# checks their fields), label and annotation maps, resource quantities by resource name, the fake scenario (the
# agent's parser checks it). Every other mapping in values.yaml must refuse a key it does not know.
OPEN_SECTIONS = {
    "agent.fake.scenario",
    "agent.nodeSelector",
    "agent.affinity",
    "agent.resources.requests",
    "agent.resources.limits",
    "agent.podSecurityContext",
    "agent.podSecurityContext.seccompProfile",
    "agent.securityContext",
    "agent.securityContext.capabilities",
    "agent.serviceAccount.annotations",
    "agent.podAnnotations",
    "agent.podLabels",
    "agent.headlessService.annotations",
    "gateway.resources.requests",
    "gateway.resources.limits",
    "gateway.podSecurityContext",
    "gateway.podSecurityContext.seccompProfile",
    "gateway.securityContext",
    "gateway.securityContext.capabilities",
    "gateway.nodeSelector",
    "gateway.affinity",
    "gateway.serviceAccount.annotations",
    "gateway.podAnnotations",
    "gateway.podLabels",
    "service.annotations",
    "serviceMonitor.labels",
    "prometheusRule.labels",
    "prometheusRule.additionalLabels",
    "dashboard.annotations",
    "networkPolicy.kedaPodSelector",
}


def _sections(value: object, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """The path of every mapping in values.yaml (lists hold data and are left out)."""
    if not isinstance(value, dict):
        return []
    found = [path]
    for key, child in value.items():
        found += _sections(child, (*path, str(key)))
    return found


SECTIONS = _sections(yaml.safe_load((CHART / "values.yaml").read_text()))


def _with_unknown_key(path: tuple[str, ...]) -> dict[str, object]:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    section = values
    for key in path:
        section = section[key]
    section["unknownKey"] = "x"
    result: dict[str, object] = values
    return result


@pytest.mark.parametrize("path", SECTIONS, ids=[".".join(p) or "(top level)" for p in SECTIONS])
def test_every_chart_section_refuses_an_unknown_key(path: tuple[str, ...]) -> None:
    """A misspelt key fails anywhere in the chart's own sections; only the listed data sections take any key."""
    values = _with_unknown_key(path)
    if ".".join(path) in OPEN_SECTIONS:
        jsonschema.validate(values, VALUES_SCHEMA)
    else:
        with pytest.raises(jsonschema.ValidationError, match="unknownKey"):
            jsonschema.validate(values, VALUES_SCHEMA)


def test_the_open_sections_all_exist() -> None:
    """Every exception above names a section of values.yaml, so a moved or removed key cannot linger there."""
    assert OPEN_SECTIONS - {".".join(path) for path in SECTIONS} == set()
