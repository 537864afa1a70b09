"""The real helm and kubeconform as the chart tests call them, and small lookups over rendered manifests."""

from __future__ import annotations

import copy
import json
import os
import subprocess
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from gpuscaler.flags import ENV_PREFIX, SERVER_FLAGS

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "gpuscaler"
CI_VALUES = sorted((CHART / "ci").glob("*-values.yaml"))
EXAMPLES = sorted((CHART / "examples").rglob("*.yaml"))
RELEASE = "gpuscaler"
NAMESPACE = "gpuscaler"
COMMAND_TIMEOUT_SECONDS = 120

Manifest = dict[str, Any]


@dataclass(frozen=True)
class Helm:
    """One helm binary with its own empty config, cache and data folders (no repositories, no plugins)."""

    binary: Path
    home: Path
    _renders: dict[tuple[str, ...], list[Manifest]] = field(default_factory=dict, compare=False)

    def run(self, *args: str) -> subprocess.CompletedProcess[str]:
        environment = dict(os.environ) | {
            name: str(self.home / name.lower()) for name in ("HELM_CACHE_HOME", "HELM_CONFIG_HOME", "HELM_DATA_HOME")
        }
        return subprocess.run(
            [str(self.binary), *args],
            env=environment,
            capture_output=True,
            text=True,
            timeout=COMMAND_TIMEOUT_SECONDS,
            check=False,
        )

    def _template_args(self, values: Sequence[Path], sets: Sequence[str], extra: Sequence[str]) -> list[str]:
        args = ["template", RELEASE, str(CHART), "--namespace", NAMESPACE, *extra]
        for path in values:
            args += ["--values", str(path)]
        for assignment in sets:
            args += ["--set", assignment]
        return args

    def template(self, *values: Path, sets: Sequence[str] = (), extra: Sequence[str] = ()) -> list[Manifest]:
        """Every manifest ``helm template`` renders; fails the test with helm's message when rendering fails."""
        key = (*map(str, values), "--set", *sets, "--", *extra)
        if key not in self._renders:
            result = self.run(*self._template_args(values, sets, extra))
            assert result.returncode == 0, f"helm template failed:\n{result.stderr}"
            self._renders[key] = [doc for doc in yaml.safe_load_all(result.stdout) if doc]
        return copy.deepcopy(self._renders[key])

    def template_text(self, *values: Path, sets: Sequence[str] = (), extra: Sequence[str] = ()) -> str:
        result = self.run(*self._template_args(values, sets, extra))
        assert result.returncode == 0, f"helm template failed:\n{result.stderr}"
        return result.stdout

    def template_error(self, *values: Path, sets: Sequence[str] = (), extra: Sequence[str] = ()) -> str:
        """helm's error for a render that must fail; fails the test if it renders."""
        result = self.run(*self._template_args(values, sets, extra))
        assert result.returncode != 0, f"helm template accepted {values} {sets}, expected a refusal"
        return result.stderr


@dataclass(frozen=True)
class Kubeconform:
    """kubeconform in strict mode against the offline schema folders; a kind without a schema is an error."""

    binary: Path
    schema_locations: Sequence[str]

    def validate(self, path: Path) -> list[dict[str, Any]]:
        """One result per resource in the file: {"kind", "name", "status", "msg"}."""
        args = [str(self.binary), "-strict", "-output", "json", "-verbose"]
        for location in self.schema_locations:
            args += ["-schema-location", location]
        result = subprocess.run(
            [*args, str(path)], capture_output=True, text=True, timeout=COMMAND_TIMEOUT_SECONDS, check=False
        )
        report = json.loads(result.stdout)
        resources: list[dict[str, Any]] = report["resources"]
        return resources


def find(manifests: Sequence[Manifest], kind: str, name: str | None = None) -> Manifest:
    """The one manifest of that kind (and name)."""
    matches = [m for m in manifests if m["kind"] == kind and (name is None or m["metadata"]["name"] == name)]
    assert len(matches) == 1, f"expected one {kind} {name or ''}, found {[m['metadata']['name'] for m in matches]}"
    return matches[0]


def of_kind(manifests: Sequence[Manifest], kind: str) -> list[Manifest]:
    """Every manifest of ``kind``, in rendering order."""
    return [m for m in manifests if m["kind"] == kind]


def kinds(manifests: Sequence[Manifest]) -> list[str]:
    """The kinds of ``manifests``, sorted with repeats kept: what a render holds at a glance."""
    return sorted(m["kind"] for m in manifests)


def pod_spec(daemonset: Manifest) -> dict[str, Any]:
    """The spec of the DaemonSet's pod template."""
    spec: dict[str, Any] = daemonset["spec"]["template"]["spec"]
    return spec


def agent_container(daemonset: Manifest) -> dict[str, Any]:
    """The DaemonSet's only container, which must be the agent."""
    containers = pod_spec(daemonset)["containers"]
    assert [c["name"] for c in containers] == ["agent"]
    container: dict[str, Any] = containers[0]
    return container


def env_values(container: Mapping[str, Any]) -> dict[str, str]:
    """Plain environment values by name (Downward API entries are left out)."""
    return {item["name"]: item["value"] for item in container.get("env", []) if "value" in item}


def env_field_refs(container: Mapping[str, Any]) -> dict[str, str]:
    """Downward API environment entries: name -> fieldPath."""
    return {
        item["name"]: item["valueFrom"]["fieldRef"]["fieldPath"]
        for item in container.get("env", [])
        if "fieldRef" in item.get("valueFrom", {})
    }


def selects(selector: Mapping[str, str], labels: Mapping[str, str]) -> bool:
    """Whether a matchLabels-style selector picks an object with these labels."""
    return all(labels.get(key) == value for key, value in selector.items())


# Pod Security Standard "restricted" (the checks that a pod template can fail), from the Kubernetes docs.
RESTRICTED_VOLUME_SOURCES = frozenset(
    {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim", "projected", "secret"}
)


def restricted_violations(spec: Mapping[str, Any]) -> list[str]:
    """What in a pod spec Pod Security "restricted" would refuse; empty when it admits the pod."""
    problems: list[str] = []
    pod_context = spec.get("securityContext", {})
    for flag in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(flag):
            problems.append(flag)
    for volume in spec.get("volumes", []):
        sources = set(volume) - {"name"}
        if not sources <= RESTRICTED_VOLUME_SOURCES:
            problems.append(f"volume {volume['name']}: {sorted(sources)}")
    for container in spec.get("containers", []):
        context = container.get("securityContext", {})
        name = container["name"]

        def setting(key: str, context: Mapping[str, Any] = context) -> Any:
            return context.get(key, pod_context.get(key))

        if context.get("privileged"):
            problems.append(f"{name}: privileged")
        if context.get("allowPrivilegeEscalation") is not False:
            problems.append(f"{name}: allowPrivilegeEscalation is not false")
        if setting("runAsNonRoot") is not True:
            problems.append(f"{name}: runAsNonRoot is not true")
        if setting("runAsUser") == 0:
            problems.append(f"{name}: runAsUser 0")
        if (setting("seccompProfile") or {}).get("type") not in ("RuntimeDefault", "Localhost"):
            problems.append(f"{name}: seccomp profile is not RuntimeDefault or Localhost")
        capabilities = context.get("capabilities", {})
        if "ALL" not in capabilities.get("drop", []):
            problems.append(f"{name}: capabilities do not drop ALL")
        if set(capabilities.get("add", [])) - {"NET_BIND_SERVICE"}:
            problems.append(f"{name}: adds capabilities {capabilities['add']}")
        if any("hostPort" in port for port in container.get("ports", [])):
            problems.append(f"{name}: hostPort")
    return problems


def yaml_documents(path: Path) -> Iterator[Manifest]:
    """The non-empty YAML documents of the file at ``path``."""
    yield from (doc for doc in yaml.safe_load_all(path.read_text(encoding="utf-8")) if doc)


def connection_limit_settings(component: str) -> list[tuple[str, str, str]]:
    """(``--set`` assignment, variable, rendered value) for each of ``component``'s connectionLimits."""
    values = {
        "handshakeTimeout": ("GPUSCALER_HANDSHAKE_TIMEOUT", "2.5"),
        "idleTimeout": ("GPUSCALER_IDLE_TIMEOUT", "60"),
        "maxConnections": ("GPUSCALER_MAX_CONNECTIONS", "64"),
        "maxConnectionsPerPeer": ("GPUSCALER_MAX_CONNECTIONS_PER_PEER", "16"),
        "maxPendingConnections": ("GPUSCALER_MAX_PENDING_CONNECTIONS", "8"),
        "firstRequestTimeout": ("GPUSCALER_FIRST_REQUEST_TIMEOUT", "2"),
        "maxStreams": ("GPUSCALER_MAX_STREAMS", "2000"),
        "requestTimeout": ("GPUSCALER_REQUEST_TIMEOUT", "5"),
        "maxResetsPerSecond": ("GPUSCALER_MAX_RESETS_PER_SECOND", "50"),
        "maxPingsPerSecond": ("GPUSCALER_MAX_PINGS_PER_SECOND", "20"),
        "maxDeadlineResetsPerSecond": ("GPUSCALER_MAX_DEADLINE_RESETS_PER_SECOND", "500"),
        "turnCalls": ("GPUSCALER_TURN_CALLS", "8"),
        "turnBytes": ("GPUSCALER_TURN_BYTES", "65536"),
        "writeBufferLimit": ("GPUSCALER_WRITE_BUFFER_LIMIT", "4194304"),
        "writeTimeout": ("GPUSCALER_WRITE_TIMEOUT", "15"),
    }
    return [
        (f"{component}.connectionLimits.{key}={value}", variable, value) for key, (variable, value) in values.items()
    ]


def connection_limit_defaults() -> dict[str, str]:
    """The connection limits' variables as the chart renders its defaults: the flags' own defaults."""
    variables = {variable for _, variable, _ in connection_limit_settings("agent")}
    return {
        ENV_PREFIX + env: default
        for env, default, _ in SERVER_FLAGS.values()
        if ENV_PREFIX + env in variables and default is not None
    }
