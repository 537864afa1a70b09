"""The Grafana dashboard's ConfigMap: rendered only when asked for, labelled for the sidecar, the file unchanged."""

from __future__ import annotations

import json

from tests.chart.rendering import CHART, CI_VALUES, NAMESPACE, RELEASE, Helm, of_kind

NAME = f"{RELEASE}-dashboard"
DASHBOARD = CHART / "files" / "dashboard.json"


def dashboards(helm: Helm, *sets: str) -> list[dict[str, object]]:
    """The dashboard ConfigMaps the defaults render with ``sets``."""
    configmaps = of_kind(helm.template(sets=sets), "ConfigMap")
    return [configmap for configmap in configmaps if configmap["metadata"]["name"] == NAME]


def test_no_dashboard_by_default(helm: Helm) -> None:
    """The default install renders no dashboard ConfigMap: without Grafana's sidecar it would do nothing."""
    assert dashboards(helm) == []


def test_the_dashboard_is_the_file_with_the_sidecar_label(helm: Helm) -> None:
    """With dashboard.enabled the ConfigMap carries grafana_dashboard: "1" and holds files/dashboard.json byte for
    byte, as valid JSON."""
    [configmap] = dashboards(helm, "dashboard.enabled=true")
    metadata = configmap["metadata"]
    assert isinstance(metadata, dict)
    assert metadata["namespace"] == NAMESPACE
    assert metadata["labels"]["grafana_dashboard"] == "1"
    assert metadata["labels"]["app.kubernetes.io/part-of"] == "gpuscaler"
    assert "annotations" not in metadata
    data = configmap["data"]
    assert isinstance(data, dict)
    assert list(data) == ["gpuscaler.json"]
    assert data["gpuscaler.json"] == DASHBOARD.read_text(encoding="utf-8")
    assert json.loads(data["gpuscaler.json"])["uid"] == "gpuscaler"


def test_the_label_annotations_and_namespace_follow_the_values(helm: Helm) -> None:
    """Another sidecar's label and value, a folder annotation and the sidecar's namespace reach the ConfigMap; a
    numeric label value from --set is quoted, as a label value must be."""
    [configmap] = dashboards(
        helm,
        "dashboard.enabled=true",
        "dashboard.label=example.com/dashboard",
        "dashboard.labelValue=2",
        "dashboard.annotations.grafana_folder=GPUs",
        "dashboard.namespace=monitoring",
    )
    metadata = configmap["metadata"]
    assert isinstance(metadata, dict)
    assert metadata["namespace"] == "monitoring"
    assert metadata["labels"]["example.com/dashboard"] == "2"
    assert "grafana_dashboard" not in metadata["labels"]
    assert metadata["annotations"] == {"grafana_folder": "GPUs"}


def test_a_label_that_is_no_label_key_is_refused(helm: Helm) -> None:
    """A label key Kubernetes would refuse fails at helm install, naming the value."""
    error = helm.template_error(sets=["dashboard.enabled=true", "dashboard.label=grafana dashboard"])
    assert "dashboard.label" in error or "/dashboard/label" in error


def test_some_ci_scenario_renders_the_dashboard(helm: Helm) -> None:
    """CI's scenarios (each validated by kubeconform) include one with the dashboard on."""
    rendered = [
        configmap
        for values in CI_VALUES
        for configmap in of_kind(helm.template(values), "ConfigMap")
        if configmap["metadata"]["name"] == NAME
    ]
    assert rendered
