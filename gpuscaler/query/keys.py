"""The keys a trigger may write: the query's, KEDA's own, each as ``<key>FromEnv`` too, and which keys together are
refused before any value is read."""

from __future__ import annotations

from collections.abc import Mapping

from gpuscaler.model.errors import InvalidMetadata
from gpuscaler.query.engine_keys import ENDPOINT_KEYS, ENGINE_KEYS, endpoint_refusal

# KEDA passes its own trigger keys through to the scaler; they configure KEDA's client, not the query.
KEDA_KEYS = frozenset(
    {"scalerAddress", "enableTLS", "unsafeSsl", "caCert", "tlsClientCert", "tlsClientKey", "tlsCertFile"}
)

QUERY_KEYS = (
    "profile",
    "metric",
    "metricType",
    "targetValue",
    "targetGpuUtilization",
    "targetMemoryUtilization",
    "activationThreshold",
    "deactivationThreshold",
    "aggregation",
    "gpuIndex",
    "gpuUUID",
    "window",
    "windowFunction",
    "metricName",
    "pollIntervalSeconds",
    "namespace",
    "pod",
    "workload",
    "podSelector",
    "podAggregation",
    "minNodes",
    "maxUnreadable",
    "scaleTargetPods",
    *ENGINE_KEYS,
)
# The keys that select pods by name or labels, in `namespace`, else in the ScaledObject's (scaleTargetPods' always is).
POD_NAME_KEYS = ("pod", "workload", "podSelector")
POD_KEYS = ("namespace", *POD_NAME_KEYS)
SELECTOR_KEYS = (*POD_KEYS, "gpuIndex", "gpuUUID")
KNOWN_KEYS = frozenset(QUERY_KEYS) | KEDA_KEYS

FROM_ENV_SUFFIX = "FromEnv"


def asks_in_scaled_object_namespace(metadata: Mapping[str, str]) -> bool:
    """Whether ``metadata`` selects pods by name or labels without naming their namespace, which is then the
    ScaledObject's: each key counts as written or as ``<key>FromEnv``, as the server reads it."""

    def written(key: str) -> bool:
        return key in metadata or key + FROM_ENV_SUFFIX in metadata

    return not written("namespace") and any(written(key) for key in POD_NAME_KEYS)


def resolve_keys(metadata: Mapping[str, str]) -> dict[str, str]:
    """Known query keys with their values; `<key>FromEnv` counts as `<key>`, KEDA's keys are dropped."""
    for key in ENDPOINT_KEYS:
        if key in metadata or key + FROM_ENV_SUFFIX in metadata:
            raise endpoint_refusal(key)
    resolved: dict[str, str] = {}
    for key, value in metadata.items():
        name = key
        if key.endswith(FROM_ENV_SUFFIX) and key[: -len(FROM_ENV_SUFFIX)] in KNOWN_KEYS:
            name = key[: -len(FROM_ENV_SUFFIX)]
        if name in KEDA_KEYS:
            continue
        if name not in KNOWN_KEYS:
            raise InvalidMetadata(_unknown_key_message(key))
        if name in resolved:
            raise InvalidMetadata(f"keys {name!r} and {name + FROM_ENV_SUFFIX!r} are both set; set one of them")
        resolved[name] = value
    if "metric" in resolved and "metricType" in resolved:
        raise InvalidMetadata("keys 'metric' and 'metricType' are both set; 'metricType' is an alias: set one")
    if "gpuIndex" in resolved and "gpuUUID" in resolved:
        raise InvalidMetadata("keys 'gpuIndex' and 'gpuUUID' are both set; select GPUs by one of them")
    pod_keys = [key for key in POD_KEYS if key in resolved]
    gpu_keys = [key for key in ("gpuIndex", "gpuUUID") if key in resolved]
    if pod_keys and gpu_keys:
        raise InvalidMetadata(
            f"keys {gpu_keys[0]!r} and {pod_keys[0]!r} are both set; select GPUs either by GPU or by the pods "
            "that hold them"
        )
    if "maxUnreadable" in resolved and gpu_keys:
        raise InvalidMetadata(
            f"keys 'maxUnreadable' and {gpu_keys[0]!r} are both set; GPUs named by {gpu_keys[0]} must all be readable "
            "(the query is strict), so maxUnreadable does not apply: leave it out"
        )
    scale_target_pods = resolved.get("scaleTargetPods", "").strip().lower() == "true" and not gpu_keys
    if "podAggregation" in resolved and not pod_keys and not scale_target_pods:
        raise InvalidMetadata(
            "podAggregation is set, but no pods are selected; it says how one pod's GPUs reduce, so it needs "
            "pod, workload, podSelector, namespace or scaleTargetPods"
        )
    if "targetGpuUtilization" in resolved and "targetMemoryUtilization" in resolved:
        raise InvalidMetadata(
            "keys 'targetGpuUtilization' and 'targetMemoryUtilization' are both set; each picks the metric: "
            "set one, or use 'metric' with 'targetValue'"
        )
    return resolved


def _unknown_key_message(key: str) -> str:
    import difflib  # only for a refusal: the agent starts smaller without it

    candidates = {known.lower(): known for known in QUERY_KEYS}
    close = difflib.get_close_matches(key.lower(), list(candidates), n=1, cutoff=0.6)
    hint = f"did you mean {candidates[close[0]]!r}?" if close else "known keys: " + ", ".join(QUERY_KEYS)
    return f"unknown key {key!r}; {hint}"
