"""The gateway's pod directory from a static YAML file, where there is no Kubernetes API (compose, tests).

The file is re-read when it changes::

    pods:
      - namespace: ml
        pod: trainer-7c9d8-x2x4p
        labels: {app: trainer, team: vision}
        workload: trainer          # the Deployment / StatefulSet / ... name
        workloadKind: Deployment   # optional, for people
        node: gpu-node-1           # optional: where it runs (spec.nodeName)
        gpus: true                 # optional: whether it asks for a GPU
        uid: 1b4e2a3c-...          # optional: metadata.uid, which ties its processes to it on a shared GPU
        ip: 10.1.2.3               # optional: status.podIP, where its engine's metrics are read
        ports: {http: 8000}        # optional: its containers' declared ports, by name
        annotations: {prometheus.io/port: "8000"}  # optional: only prometheus.io/port and /path are read
        ready: true                # optional: a listed pod is Running and Ready unless this says false
        deleting: false            # optional: true for a pod that is terminating
        hostNetwork: false         # optional: true for a pod on its node's network (never read)
    scaledObjects:                 # optional: KEDA's ScaledObjects, for triggers with scaleTargetPods
      - namespace: ml
        name: trainer
        scaleTargetRef: {name: trainer, kind: Deployment}   # kind defaults to Deployment, as in KEDA
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import structlog

from gpuscaler.gateway.directory.by_namespace import ByNamespace
from gpuscaler.gateway.directory.names import SeenNames
from gpuscaler.model.errors import ConfigError
from gpuscaler.model.pods import (
    METRICS_PATH_ANNOTATION,
    METRICS_PORT_ANNOTATION,
    PodDirectory,
    PodInfo,
    ScaleTarget,
)

log = structlog.get_logger(__name__)

STATIC_RELOAD_CHECK_SECONDS = 1.0


@runtime_checkable
class ManagedDirectory(PodDirectory, Protocol):
    """A pod directory with a life of its own (the Kubernetes pod watch): started and stopped with the gateway."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


class StaticPodDirectory:
    """Pods from a YAML file (see the module docstring), re-read when its modification time changes."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._pods: ByNamespace[PodInfo] = ByNamespace(lambda info: info.namespace)
        self._targets: dict[tuple[str, str], ScaleTarget] = {}
        self._mtime: float | None = None
        self._checked = 0.0
        self._problem: str | None = None
        self.seen_names = SeenNames()  # every version of the file's names, for selections that match no pod
        self._load()  # a bad file at start is a ConfigError, named by the flag

    def lookup(self, namespace: str, pod: str) -> PodInfo | None:
        self._maybe_reload()
        return self._pods.get((namespace, pod))

    def pods(self, namespace: str) -> list[PodInfo]:
        self._maybe_reload()
        return self._pods.in_namespace(namespace)

    def version(self, namespace: str) -> tuple[int, int]:
        """Moves when the file is read again with ``namespace``'s pods in it (or out), or names seen there change."""
        self._maybe_reload()
        return self._pods.version(namespace), self.seen_names.version(namespace)

    def problem(self) -> str | None:
        self._maybe_reload()
        return self._problem

    def scale_target(self, namespace: str, scaled_object: str) -> ScaleTarget | None:
        self._maybe_reload()
        return self._targets.get((namespace, scaled_object))

    def scale_targets_problem(self) -> str | None:
        return self.problem()

    def __len__(self) -> int:
        return len(self._pods)

    def _maybe_reload(self) -> None:
        now = time.monotonic()
        if now - self._checked < STATIC_RELOAD_CHECK_SECONDS:
            return
        self._checked = now
        try:
            mtime = os.stat(self.path).st_mtime
        except OSError as error:
            self._problem = f"pod directory file {str(self.path)!r} cannot be read: {error.strerror}"
            return
        if mtime == self._mtime:
            return
        try:
            self._load()
        except ConfigError as error:
            # Keep the pods we had: a half-written file must not make every workload read as empty.
            self._mtime = mtime
            log.error("pod_directory_reload_failed", path=str(self.path), error=str(error))

    def reload_now(self) -> None:
        """Re-read the file at the next lookup, whatever the time since the last check."""
        self._checked = 0.0
        self._mtime = None

    def _load(self) -> None:
        try:
            mtime = os.stat(self.path).st_mtime
            text = self.path.read_text(encoding="utf-8")
        except OSError as error:
            raise ConfigError(f"pod directory {str(self.path)!r}: {error.strerror}") from None
        pods, self._targets = parse_static_file(text, source=str(self.path))
        self._pods.replace(pods.items())
        for info in self._pods.values():
            self.seen_names.saw_pod(info)
        for target in self._targets.values():
            self.seen_names.saw_scale_target(target)
        self._mtime = mtime
        self._problem = None
        log.info("pod_directory_loaded", path=str(self.path), pods=len(self._pods))


def parse_static_pods(text: str, *, source: str) -> dict[tuple[str, str], PodInfo]:
    """The pods of a static directory file; ConfigError names the entry and the field."""
    return parse_static_file(text, source=source)[0]


def parse_static_file(
    text: str, *, source: str
) -> tuple[dict[tuple[str, str], PodInfo], dict[tuple[str, str], ScaleTarget]]:
    """The pods and ScaledObjects of a static directory file; ConfigError names the entry and the field."""
    import yaml  # only here: the agent starts faster and smaller without it

    try:
        document = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise ConfigError(f"pod directory {source}: not YAML: {error}") from None
    if document is None:
        return {}, {}
    lists = ("pods", "scaledObjects")
    if not isinstance(document, dict) or not all(isinstance(document.get(key, []), list) for key in lists):
        raise ConfigError(f"pod directory {source}: expected a mapping with a 'pods' list (and a 'scaledObjects' one)")
    unknown = set(document) - set(lists)
    if unknown:
        raise ConfigError(
            f"pod directory {source}: unknown top-level keys {sorted(unknown)}; only 'pods', 'scaledObjects'"
        )
    pods: dict[tuple[str, str], PodInfo] = {}
    for number, entry in enumerate(document.get("pods") or [], start=1):
        info = _static_entry(entry, f"pod directory {source}: pods[{number}]")
        pods[(info.namespace, info.pod)] = info
    targets: dict[tuple[str, str], ScaleTarget] = {}
    for number, entry in enumerate(document.get("scaledObjects") or [], start=1):
        target = _static_target(entry, f"pod directory {source}: scaledObjects[{number}]")
        targets[(target.namespace, target.scaled_object)] = target
    return pods, targets


def _static_target(entry: Any, where: str) -> ScaleTarget:
    if not isinstance(entry, dict) or set(entry) - {"namespace", "name", "scaleTargetRef"}:
        raise ConfigError(f"{where}: expected a mapping with namespace, name and scaleTargetRef")
    ref = entry.get("scaleTargetRef")
    if not isinstance(ref, dict) or set(ref) - {"name", "kind", "apiVersion"}:
        raise ConfigError(f"{where}: scaleTargetRef must be a mapping with name (and kind, apiVersion)")
    fields = {  # KEDA's defaults for kind and apiVersion
        "namespace": entry.get("namespace"),
        "name": entry.get("name"),
        "scaleTargetRef.name": ref.get("name"),
        "scaleTargetRef.kind": ref.get("kind", "Deployment"),
        "scaleTargetRef.apiVersion": ref.get("apiVersion", "apps/v1"),
    }
    for key, value in fields.items():
        if not isinstance(value, str) or not value:
            raise ConfigError(f"{where}: {key} is missing or not a string")
    text = {key: str(value) for key, value in fields.items()}
    return ScaleTarget(
        namespace=text["namespace"],
        scaled_object=text["name"],
        kind=text["scaleTargetRef.kind"],
        name=text["scaleTargetRef.name"],
        api_version=text["scaleTargetRef.apiVersion"],
    )


_ENTRY_KEYS = {
    "namespace",
    "pod",
    "labels",
    "workload",
    "workloadKind",
    "node",
    "gpus",
    "uid",
    "ip",
    "ports",
    "annotations",
    "ready",
    "deleting",
    "hostNetwork",
}


def _static_entry(entry: Any, where: str) -> PodInfo:
    if not isinstance(entry, dict):
        raise ConfigError(f"{where}: expected a mapping with namespace and pod")
    unknown = set(entry) - _ENTRY_KEYS
    if unknown:
        raise ConfigError(f"{where}: unknown keys {sorted(unknown)}; known: {', '.join(sorted(_ENTRY_KEYS))}")
    for key in ("namespace", "pod"):
        if not isinstance(entry.get(key), str) or not entry[key]:
            raise ConfigError(f"{where}: {key} is missing or not a string")
    labels = entry.get("labels") or {}
    if not isinstance(labels, dict) or not all(isinstance(k, str) for k in labels):
        raise ConfigError(f"{where}: labels must be a mapping of strings")
    workload = entry.get("workload")
    kind = entry.get("workloadKind")
    node = entry.get("node")
    uid = entry.get("uid")
    for key, value in (("workload", workload), ("workloadKind", kind), ("node", node), ("uid", uid)):
        if value is not None and not isinstance(value, str):
            raise ConfigError(f"{where}: {key} must be a string")
    ip = entry.get("ip")
    if ip is not None and not isinstance(ip, str):
        raise ConfigError(f"{where}: ip must be a string")
    flags = {key: entry.get(key) for key in ("gpus", "ready", "deleting", "hostNetwork")}
    for key, value in flags.items():
        if value is not None and not isinstance(value, bool):
            raise ConfigError(f"{where}: {key} must be true or false")
    ports = entry.get("ports") or {}
    if not isinstance(ports, dict) or not all(
        isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) and 0 < v < 65536
        for k, v in ports.items()
    ):
        raise ConfigError(f"{where}: ports must map port names to numbers from 1 to 65535, like {{http: 8000}}")
    annotations = entry.get("annotations") or {}
    if not isinstance(annotations, dict) or not all(isinstance(k, str) for k in annotations):
        raise ConfigError(f"{where}: annotations must be a mapping of strings")
    return PodInfo(
        namespace=entry["namespace"],
        pod=entry["pod"],
        labels={str(k): str(v) for k, v in labels.items()},
        workload=workload,
        workload_kind=kind,
        node=node,
        holds_gpus=flags["gpus"],
        uid=uid,
        ip=ip,
        phase="Running",
        ready=flags["ready"] is not False,
        deleting=flags["deleting"] is True,
        host_network=flags["hostNetwork"] is True,
        ports=tuple(sorted(ports.items())),
        metrics_port=_annotation(annotations, METRICS_PORT_ANNOTATION),
        metrics_path=_annotation(annotations, METRICS_PATH_ANNOTATION),
    )


def _annotation(annotations: dict[str, Any], name: str) -> str | None:
    value = annotations.get(name)
    return str(value) if value is not None and str(value) else None
