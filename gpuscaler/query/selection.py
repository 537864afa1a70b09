"""Which GPUs and which pods a trigger selects: its selection keys parsed, the ScaledObject's namespace and scale
target where the keys leave them out."""

from __future__ import annotations

from collections.abc import Mapping

from gpuscaler.model.aggregation import Aggregation
from gpuscaler.model.errors import InvalidMetadata
from gpuscaler.query.key_values import (
    NAMESPACE,
    OBJECT_NAME,
    POD_GLOB,
    non_empty,
    parse_bool,
    parse_enum,
    parse_indices,
    parse_list,
    parse_name,
)
from gpuscaler.query.keys import POD_KEYS
from gpuscaler.query.query import GpuSelection, PodSelection
from gpuscaler.query.selectors import parse_label_selector


def selected_pods(raw: Mapping[str, str], namespace: str, name: str) -> PodSelection | None:
    """The pods a selector or scaleTargetPods names, or None when the keys name none."""
    pods = parse_pods(raw, namespace)
    if pods is None and "scaleTargetPods" in raw and parse_bool("scaleTargetPods", raw["scaleTargetPods"]):
        pods = scale_target_selection(raw, namespace, name)
    return pods


def engine_pods(raw: Mapping[str, str], namespace: str, name: str, what: str) -> PodSelection:
    """The pods an engine signal reads; refused without any: there is no URL to read instead."""
    pods = selected_pods(raw, namespace, name)
    if pods is None:
        raise InvalidMetadata(
            f"{what} is read from the engines of the pods a query selects, and no pods are selected; set workload, "
            "podSelector or pod (or scaleTargetPods: 'true'); gpuscaler never reads a URL (docs/engines.md)"
        )
    return pods


def parse_selection(raw: Mapping[str, str]) -> GpuSelection:
    """The GPUs ``gpuIndex`` or ``gpuUUID`` name; every GPU without either."""
    if "gpuIndex" in raw:
        return GpuSelection(indices=parse_indices(raw["gpuIndex"]))
    if "gpuUUID" in raw:
        uuids = parse_list("gpuUUID", raw["gpuUUID"], non_empty)
        # Matching is case-insensitive and order-free (as gpuIndex is), so equal selections are one query.
        first_spelling = {uuid.lower(): uuid for uuid in reversed(uuids)}
        return GpuSelection(uuids=tuple(sorted(first_spelling.values(), key=str.lower)))
    return GpuSelection()


def parse_pods(raw: Mapping[str, str], scaled_object_namespace: str) -> PodSelection | None:
    """The pods ``namespace``, ``pod``, ``workload`` and ``podSelector`` select; None when none of them is set."""
    if not any(key in raw for key in POD_KEYS):
        return None
    if "namespace" in raw:
        namespace = parse_name("namespace", raw["namespace"], NAMESPACE, "a namespace name like 'ml'")
    elif scaled_object_namespace:
        namespace = scaled_object_namespace
    else:
        raise InvalidMetadata(
            "namespace is not set and the ScaledObject's namespace is unknown; set namespace to the pods' namespace"
        )
    pod = workload = labels = None
    if "pod" in raw:
        pod = parse_name("pod", raw["pod"], POD_GLOB, "a pod name or glob like 'trainer-*'")
    if "workload" in raw:
        workload = parse_name("workload", raw["workload"], OBJECT_NAME, "a Deployment or StatefulSet name")
    if "podSelector" in raw:
        try:
            labels = parse_label_selector(raw["podSelector"])
        except ValueError as error:
            raise InvalidMetadata(f"podSelector {raw['podSelector']!r} {error}") from None
    pod_aggregation = Aggregation.AVG
    if "podAggregation" in raw:
        pod_aggregation = parse_enum("podAggregation", raw["podAggregation"], Aggregation)
    return PodSelection(namespace=namespace, pod=pod, workload=workload, labels=labels, pod_aggregation=pod_aggregation)


def scale_target_selection(raw: Mapping[str, str], namespace: str, name: str) -> PodSelection:
    """The pods of the ScaledObject's own scale target: resolved by the gateway, which reads ScaledObjects."""
    if not namespace or not name:
        raise InvalidMetadata(
            "scaleTargetPods 'true' selects the pods of the ScaledObject's scaleTargetRef, and this request names no "
            "ScaledObject (KEDA always does; `gpuscaler query` needs --scaled-object NAMESPACE/NAME)"
        )
    pod_aggregation = Aggregation.AVG
    if "podAggregation" in raw:
        pod_aggregation = parse_enum("podAggregation", raw["podAggregation"], Aggregation)
    return PodSelection(namespace=namespace, scale_target=name, pod_aggregation=pod_aggregation)
