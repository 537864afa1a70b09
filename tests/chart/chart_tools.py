"""Builds the chart-test tools (helm, kubeconform, promtool, prometheus) and offline API schemas once per machine,
into a user cache.

Why build from Go modules: CI has a Go toolchain and a Go module proxy but no download site, and a pinned
module version is as reproducible as a release binary. Everything lands under
``${XDG_CACHE_HOME:-~/.cache}/gpuscaler-tools`` (outside the repo, so a clean checkout reuses it) and is
keyed by version, so bumping a pin below rebuilds exactly that tool.

Run ``python tests/chart/chart_tools.py`` to warm the cache and print how long each step took.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
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
# CRDs: (module, version, CRD file in it). ServiceMonitor and PrometheusRule for the chart; ScaledObject for
# examples/.
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
)

Json = dict[str, Any]


class ToolUnavailable(Exception):
    """Neither a Go toolchain nor a prebuilt tool on PATH: the caller skips, loudly."""


@contextlib.contextmanager
def locked() -> Iterator[None]:
    """Serialises builds between concurrent test runs on one machine."""
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


def _go_install(name: str, package: str, version: str, tags: tuple[str, ...] = ()) -> Path:
    """Builds ``package@version`` stripped and trimmed, with build ``tags``, once; returns the binary."""
    # Tags change what is compiled in, so they are part of the key: another set is another binary.
    target = cache_dir() / "bin" / "-".join((name, version, *tags))
    with locked():
        if target.exists():
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache_dir()) as gobin:
            env = _go_env() | {"GOBIN": gobin}
            subprocess.run(
                [
                    _go(),
                    "install",
                    "-trimpath",
                    "-ldflags=-s -w",
                    *([f"-tags={','.join(tags)}"] if tags else []),
                    f"{package}@{version}",
                ],
                env=env,
                cwd=gobin,
                check=True,
            )
            os.replace(Path(gobin) / name, target)
    return target


def build_local(name: str, source: Path) -> Path:
    """Builds the Go program in ``source`` (its own go.mod and go.sum, read-only), once per content of its files."""
    digest = hashlib.sha256()
    for path in sorted(source.glob("*")):
        if path.suffix == ".go" or path.name in ("go.mod", "go.sum"):
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
    target = cache_dir() / "bin" / f"{name}-{digest.hexdigest()[:16]}"
    with locked():
        if target.exists():
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache_dir()) as scratch:
            built = Path(scratch) / name
            # -mod=readonly: a build must never rewrite the committed go.mod or go.sum.
            env = _go_env() | {"GOFLAGS": "-mod=readonly -buildvcs=false"}
            subprocess.run(
                [_go(), "build", "-trimpath", "-ldflags=-s -w", "-o", str(built), "."],
                env=env,
                cwd=source,
                check=True,
            )
            os.replace(built, target)
    return target


def _module_dir(module: str, version: str) -> Path:
    """Downloads one module's source from the module proxy (no build) and returns its directory."""
    with tempfile.TemporaryDirectory() as cwd:
        result = subprocess.run(
            [_go(), "mod", "download", "-json", f"{module}@{version}"],
            env=_go_env(),
            cwd=cwd,
            check=True,
            capture_output=True,
            text=True,
        )
    return Path(json.loads(result.stdout)["Dir"])


def _prebuilt_or_build(name: str, package: str, version: str, tags: tuple[str, ...] = ()) -> Path:
    """The pinned build where Go exists, else a tool already on PATH, else ToolUnavailable."""
    if shutil.which("go"):
        return _go_install(name, package, version, tags)
    found = shutil.which(name)
    if found:
        return Path(found)
    raise ToolUnavailable(f"neither `go` nor `{name}` is on PATH")


def helm() -> Path:
    """The helm binary."""
    return _prebuilt_or_build("helm", HELM_PACKAGE, HELM_VERSION)


def kubeconform() -> Path:
    """The kubeconform binary."""
    return _prebuilt_or_build("kubeconform", KUBECONFORM_PACKAGE, KUBECONFORM_VERSION)


def promtool() -> Path:
    """The promtool binary, of the pinned Prometheus."""
    return _prebuilt_or_build("promtool", f"{PROMETHEUS_MODULE}/cmd/promtool", PROMETHEUS_VERSION, PROMETHEUS_TAGS)


def prometheus() -> Path:
    """The prometheus server binary, of the same release as promtool."""
    return _prebuilt_or_build("prometheus", f"{PROMETHEUS_MODULE}/cmd/prometheus", PROMETHEUS_VERSION, PROMETHEUS_TAGS)


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


def kubernetes_schemas() -> Path:
    """A folder of strict standalone JSON schemas, one per kind, from the Kubernetes release's OpenAPI document."""
    directory = cache_dir() / "schemas" / f"kubernetes-{KUBERNETES_VERSION}-strict"
    with locked():
        if directory.exists():
            return directory
        directory.parent.mkdir(parents=True, exist_ok=True)
        source = _module_dir(KUBERNETES_MODULE, KUBERNETES_VERSION) / "api" / "openapi-spec" / "swagger.json"
        definitions: Json = {
            name: strict(schema) for name, schema in json.loads(source.read_text())["definitions"].items()
        }
        # Quantity is a string in OpenAPI, but the API accepts a bare number (``cpu: 1``) too.
        definitions["io.k8s.apimachinery.pkg.api.resource.Quantity"] = {
            "oneOf": [{"type": "string"}, {"type": "number"}]
        }
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
        _write_json_atomically(directory, files)
    return directory


def crd_schemas() -> Path:
    """A folder with the CRDs' schemas (ServiceMonitor, PrometheusRule, ScaledObject), in the same strict form."""
    pins = "-".join(version for _, version, _ in CRDS)
    directory = cache_dir() / "schemas" / f"crds-{pins}-strict"
    with locked():
        if directory.exists():
            return directory
        directory.parent.mkdir(parents=True, exist_ok=True)
        files: dict[str, Json] = {}
        for module, version, crd_path in CRDS:
            crd = yaml.safe_load((_module_dir(module, version) / crd_path).read_text())
            group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
            for served in crd["spec"]["versions"]:
                schema = strict(served["schema"]["openAPIV3Schema"])
                files[_file_name(group, served["name"], kind)] = _pin_gvk(schema, group, served["name"], kind)
        _write_json_atomically(directory, files)
    return directory


def schema_locations() -> list[str]:
    """kubeconform ``-schema-location`` templates for every schema folder, built on first use."""
    return [
        f"{folder}/{{{{ .ResourceKind }}}}{{{{ .KindSuffix }}}}.json"
        for folder in (kubernetes_schemas(), crd_schemas())
    ]


def main() -> None:
    """Warms the cache and reports how long each step took (the cold numbers matter for CI's budget)."""
    for step in (helm, kubeconform, promtool, prometheus, kubernetes_schemas, crd_schemas):
        start = time.monotonic()
        path = step()
        print(f"{step.__name__:20} {time.monotonic() - start:7.1f} s  {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
