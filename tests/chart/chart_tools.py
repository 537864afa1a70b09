"""The chart tests' pinned tools (helm, kubeconform, promtool, prometheus) and offline API schemas: where each lands
in the user's tool cache, and how it is built there once per machine.

Why build from Go modules: CI has a Go toolchain and a Go module proxy but no download site, and a pinned
module version is as reproducible as a release binary. Everything lands under
``${XDG_CACHE_HOME:-~/.cache}/gpuscaler-tools`` (outside the repo, so a clean checkout reuses it) and is
keyed by version, so bumping a pin below rebuilds exactly that tool. Builds run only in the setup step before the
tests (``make tools``, tests/tools.py); fixtures locate what it built.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from image.build import cache_dir  # the one per-user tool cache: helm, the Go tools, the image's bases

HELM_PACKAGE = "helm.sh/helm/v4/cmd/helm"
HELM_VERSION = "v4.3.2"
KUBECONFORM_PACKAGE = "github.com/yannh/kubeconform/cmd/kubeconform"
KUBECONFORM_VERSION = "v0.8.0"
# promtool checks and unit-tests the alert rules (tests/monitoring/); prometheus is pinned beside it so a rule can
# be loaded by the server the rules are written for. remove_all_sd drops every service-discovery plugin but file
# and http (we need none), which halves the build.
PROMETHEUS_MODULE = "github.com/prometheus/prometheus"
PROMETHEUS_VERSION = "v0.316.0"
PROMETHEUS_TAGS = ("remove_all_sd",)
# The Kubernetes release whose OpenAPI document (api/openapi-spec/swagger.json) the manifests must satisfy.
KUBERNETES_MODULE = "k8s.io/kubernetes"
KUBERNETES_VERSION = "v1.37.2"
# CRDs: (module, version, CRD file in it). ServiceMonitor and PrometheusRule for the chart; ScaledObject and the
# serving-from-zero example's InferencePool (GIE v1.5.0, the release the EPP journeys run) for examples/.
CRDS = (
    (
        "github.com/prometheus-operator/prometheus-operator",
        "v0.85.0",
        "example/prometheus-operator-crd/monitoring.coreos.com_servicemonitors.yaml",
    ),
    (
        "github.com/prometheus-operator/prometheus-operator",
        "v0.85.0",
        "example/prometheus-operator-crd/monitoring.coreos.com_prometheusrules.yaml",
    ),
    ("github.com/kedacore/keda/v2", "v2.21.0", "config/crd/bases/keda.sh_scaledobjects.yaml"),
    (
        "sigs.k8s.io/gateway-api-inference-extension",
        "v1.5.0",
        "config/crd/bases/inference.networking.k8s.io_inferencepools.yaml",
    ),
)

Json = dict[str, Any]


class ToolUnavailable(Exception):
    """Neither a Go toolchain nor a prebuilt tool on PATH: the caller skips, loudly (or fails, where nothing skips)."""


@contextlib.contextmanager
def locked() -> Iterator[None]:
    """Serialises builds between concurrent runs on one machine."""
    with (cache_dir() / ".lock").open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _go_env() -> dict[str, str]:
    """Lean, shared settings for every Go step: one build cache, one module cache, no cgo, no toolchain switch."""
    env = dict(os.environ)
    env.update(
        GOCACHE=str(cache_dir() / "go-build"),
        GOMODCACHE=str(cache_dir() / "go-mod"),
        GOFLAGS="-mod=mod -buildvcs=false",
        CGO_ENABLED="0",
        GOTOOLCHAIN="local",
    )
    return env


def _go() -> str:
    go = shutil.which("go")
    if go is None:
        raise ToolUnavailable("no `go` on PATH")
    return go


@dataclass(frozen=True)
class GoProgram:
    """One program ``go install``-ed from a pinned module version, stripped and trimmed, with build ``tags``."""

    name: str
    package: str
    version: str
    tags: tuple[str, ...] = ()

    @property
    def needs_go(self) -> bool:
        """Built with Go."""
        return True

    @property
    def stand_in(self) -> str | None:
        """Where there is no Go, a program of the same name on PATH may stand in for the pinned build."""
        return self.name

    @property
    def path(self) -> Path:
        """The binary; tags change what is compiled in, so they are part of the name, as the version is."""
        return cache_dir() / "bin" / "-".join((self.name, self.version, *self.tags))

    def build(self) -> Path:
        """Builds the binary once; returns it."""
        target = self.path
        with locked():
            if target.exists():
                return target
            target.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=cache_dir()) as gobin:
                tags = [f"-tags={','.join(self.tags)}"] if self.tags else []
                subprocess.run(
                    [_go(), "install", "-trimpath", "-ldflags=-s -w", *tags, f"{self.package}@{self.version}"],
                    env=_go_env() | {"GOBIN": gobin},
                    cwd=gobin,
                    check=True,
                    capture_output=True,  # hundreds of "go: downloading" lines: the error carries them if it fails
                    text=True,
                )
                os.replace(Path(gobin) / self.name, target)
        return target


@dataclass(frozen=True)
class LocalProgram:
    """A Go program kept in this repository (its own go.mod and go.sum, read-only), built once per content of its
    files."""

    name: str
    source: Path

    @property
    def needs_go(self) -> bool:
        """Built with Go."""
        return True

    @property
    def stand_in(self) -> str | None:
        """Nothing stands in for a program of our own."""
        return None

    @property
    def version(self) -> str:
        """The digest of its Go files, go.mod and go.sum: an edit is another version."""
        digest = hashlib.sha256()
        for path in sorted(self.source.glob("*")):
            if path.suffix == ".go" or path.name in ("go.mod", "go.sum"):
                digest.update(path.name.encode() + b"\0" + path.read_bytes())
        return digest.hexdigest()[:16]

    @property
    def path(self) -> Path:
        """The binary."""
        return cache_dir() / "bin" / f"{self.name}-{self.version}"

    def build(self) -> Path:
        """Builds the binary once; returns it."""
        target = self.path
        with locked():
            if target.exists():
                return target
            target.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=cache_dir()) as scratch:
                built = Path(scratch) / self.name
                subprocess.run(
                    [_go(), "build", "-trimpath", "-ldflags=-s -w", "-o", str(built), "."],
                    # -mod=readonly: a build must never rewrite the committed go.mod or go.sum.
                    env=_go_env() | {"GOFLAGS": "-mod=readonly -buildvcs=false"},
                    cwd=self.source,
                    check=True,
                    capture_output=True,
                    text=True,
                )
                os.replace(built, target)
        return target


def _escaped(path: str) -> str:
    """A module path or version as the module cache spells it: each capital letter as ``!`` and its lower case."""
    return "".join(f"!{char.lower()}" if char.isupper() else char for char in path)


@dataclass(frozen=True)
class ModuleSource:
    """One Go module's source at a pinned version, downloaded from the module proxy into the module cache (no
    build): where the CRDs, the OpenAPI document and KEDA's webhook configuration come from."""

    module: str
    version: str

    @property
    def name(self) -> str:
        """The module path."""
        return self.module

    @property
    def needs_go(self) -> bool:
        """Downloaded with Go."""
        return True

    @property
    def stand_in(self) -> str | None:
        """A module's source has no stand-in."""
        return None

    @property
    def path(self) -> Path:
        """The module's folder in the module cache, where ``go mod download`` extracts it."""
        return cache_dir() / "go-mod" / f"{_escaped(self.module)}@{_escaped(self.version)}"

    def build(self) -> Path:
        """Downloads the module (Go's module cache has a lock of its own); returns its folder."""
        with tempfile.TemporaryDirectory() as cwd:
            result = subprocess.run(
                [_go(), "mod", "download", "-json", f"{self.module}@{self.version}"],
                env=_go_env(),
                cwd=cwd,
                check=True,
                capture_output=True,
                text=True,
            )
        directory = Path(json.loads(result.stdout)["Dir"])
        assert directory == self.path, f"go put {self.name} in {directory}, not in {self.path}"
        return directory


HELM = GoProgram("helm", HELM_PACKAGE, HELM_VERSION)
KUBECONFORM = GoProgram("kubeconform", KUBECONFORM_PACKAGE, KUBECONFORM_VERSION)
# promtool, and the prometheus server of the same release.
PROMTOOL = GoProgram("promtool", f"{PROMETHEUS_MODULE}/cmd/promtool", PROMETHEUS_VERSION, PROMETHEUS_TAGS)
PROMETHEUS = GoProgram("prometheus", f"{PROMETHEUS_MODULE}/cmd/prometheus", PROMETHEUS_VERSION, PROMETHEUS_TAGS)
KUBERNETES_SOURCE = ModuleSource(KUBERNETES_MODULE, KUBERNETES_VERSION)
# Each module that holds a CRD, once.
CRD_SOURCES = tuple(dict.fromkeys(ModuleSource(module, version) for module, version, _ in CRDS))


# --- schemas -------------------------------------------------------------------------------------------


def strict(schema: Any) -> Any:
    """Returns an OpenAPI schema as a JSON schema that rejects unknown fields, as ``kubectl --validate=strict`` does.

    Objects that list properties get ``additionalProperties: false`` (unless they preserve unknown fields);
    int-or-string becomes ``oneOf`` string/integer, since OpenAPI's format is not a JSON-schema type.
    """
    if isinstance(schema, list):
        return [strict(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: strict(value) for key, value in schema.items() if key != "properties"}
    if "properties" in schema:
        out["properties"] = {key: strict(value) for key, value in schema["properties"].items()}
        if not schema.get("x-kubernetes-preserve-unknown-fields"):
            out.setdefault("additionalProperties", False)
    if schema.get("format") == "int-or-string" or schema.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out.pop("format", None)
        out["oneOf"] = [{"type": "string"}, {"type": "integer"}]
    return out


def _refs(schema: Any) -> Iterator[str]:
    if isinstance(schema, dict):
        ref = schema.get("$ref")
        if isinstance(ref, str):
            yield ref.removeprefix("#/definitions/")
        for value in schema.values():
            yield from _refs(value)
    elif isinstance(schema, list):
        for item in schema:
            yield from _refs(item)


def _closure(definitions: Json, root: str) -> Json:
    """The definitions reachable from ``root``, so each schema file stands alone."""
    seen: Json = {}
    todo = [root]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen[name] = definitions[name]
            todo.extend(_refs(definitions[name]))
    return seen


def _file_name(group: str, version: str, kind: str) -> str:
    """kubeconform's ``{{ .ResourceKind }}{{ .KindSuffix }}.json``: kind, first label of the group, version."""
    suffix = f"-{group.split('.')[0]}-{version}" if group else f"-{version}"
    return f"{kind.lower()}{suffix}.json".lower()


def _pin_gvk(schema: Json, group: str, version: str, kind: str) -> Json:
    """Makes apiVersion and kind part of the schema, so a typo there fails instead of matching loosely."""
    api_version = f"{group}/{version}" if group else version
    properties = dict(schema.get("properties", {}))
    properties["apiVersion"] = {"type": "string", "enum": [api_version]}
    properties["kind"] = {"type": "string", "enum": [kind]}
    return schema | {"properties": properties}


def _write_json_atomically(directory: Path, files: dict[str, Json]) -> None:
    """Writes every file into a scratch folder and renames it into place, so a crash leaves no half set."""
    with tempfile.TemporaryDirectory(dir=directory.parent) as scratch:
        staging = Path(scratch) / "schemas"
        staging.mkdir()
        for name, content in files.items():
            (staging / name).write_text(json.dumps(content))
        os.replace(staging, directory)


def _kubernetes_schema_files() -> dict[str, Json]:
    """Strict standalone JSON schemas, one per kind, from the Kubernetes release's OpenAPI document."""
    source = KUBERNETES_SOURCE.build() / "api" / "openapi-spec" / "swagger.json"
    definitions: Json = {name: strict(schema) for name, schema in json.loads(source.read_text())["definitions"].items()}
    # Quantity is a string in OpenAPI, but the API accepts a bare number (``cpu: 1``) too.
    definitions["io.k8s.apimachinery.pkg.api.resource.Quantity"] = {"oneOf": [{"type": "string"}, {"type": "number"}]}
    files: dict[str, Json] = {}
    for name, schema in definitions.items():
        for gvk in schema.get("x-kubernetes-group-version-kind", []):
            group, version, kind = gvk["group"], gvk["version"], gvk["kind"]
            # Several definitions carry meta kinds (DeleteOptions, WatchEvent): the group's own one wins.
            file_name = _file_name(group, version, kind)
            if file_name in files and not name.endswith(f".{version}.{kind}"):
                continue
            closure = _closure(definitions, name)
            root = _pin_gvk(closure.pop(name), group, version, kind)
            files[file_name] = root | {"definitions": closure}
    return files


def _crd_schema_files() -> dict[str, Json]:
    """The CRDs' schemas (ServiceMonitor, PrometheusRule, ScaledObject), in the same strict form."""
    files: dict[str, Json] = {}
    for module, version, crd_path in CRDS:
        crd = yaml.safe_load((ModuleSource(module, version).build() / crd_path).read_text())
        group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
        for served in crd["spec"]["versions"]:
            schema = strict(served["schema"]["openAPIV3Schema"])
            files[_file_name(group, served["name"], kind)] = _pin_gvk(schema, group, served["name"], kind)
    return files


@dataclass(frozen=True)
class SchemaFolder:
    """A folder of strict JSON schemas for kubeconform, made from pinned modules' sources."""

    name: str
    version: str
    files: Callable[[], dict[str, Json]]

    @property
    def needs_go(self) -> bool:
        """Its sources come from the Go module proxy."""
        return True

    @property
    def stand_in(self) -> str | None:
        """Nothing stands in for the schemas."""
        return None

    @property
    def path(self) -> Path:
        """The folder, keyed by the pins it is made from."""
        return cache_dir() / "schemas" / f"{self.name}-{self.version}-strict"

    def build(self) -> Path:
        """Makes the folder once; returns it."""
        directory = self.path
        with locked():
            if not directory.exists():
                directory.parent.mkdir(parents=True, exist_ok=True)
                _write_json_atomically(directory, self.files())
        return directory


KUBERNETES_SCHEMAS = SchemaFolder("kubernetes-schemas", KUBERNETES_VERSION, _kubernetes_schema_files)
CRD_SCHEMAS = SchemaFolder("crd-schemas", "-".join(dict.fromkeys(v for _, v, _ in CRDS)), _crd_schema_files)


def schema_locations(*folders: Path) -> list[str]:
    """kubeconform ``-schema-location`` templates for schema folders."""
    return [f"{folder}/{{{{ .ResourceKind }}}}{{{{ .KindSuffix }}}}.json" for folder in folders]
