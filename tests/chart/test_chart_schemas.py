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
    TOOL_BUILD_TIMEOUT_SECONDS,
    Helm,
    Kubeconform,
    kinds,
)

pytestmark = pytest.mark.timeout(TOOL_BUILD_TIMEOUT_SECONDS)

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
    """Each example is a ScaledObject that KEDA's CRD schema accepts."""
    (result,) = kubeconform.validate(example)
    assert (result["kind"], result["status"]) == ("ScaledObject", "statusValid"), result.get("msg")


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
        ("nvmlHostMount.enabled=true", "additional properties 'nvmlHostMount' not allowed"),
        ("nvmlHostMounts.devices.mode=some", "at '/nvmlHostMounts/devices/mode'"),
        ("terminationGracePeriodSeconds=soon", "at '/terminationGracePeriodSeconds': got string, want integer"),
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
