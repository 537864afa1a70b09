"""Builds the KEDA e2e suite's control plane (etcd, kube-apiserver, kube-controller-manager, KEDA) once per machine.

Like ``tests/chart/chart_tools.py``: built from pinned Go modules into ``${XDG_CACHE_HOME:-~/.cache}/gpuscaler-tools``,
keyed by version, under a file lock, with ``GOTOOLCHAIN=local`` and ``CGO_ENABLED=0``. None of the three can be
``go install``-ed by version (their go.mod files carry replace directives), so each is built from a small module
generated here: it requires the pinned module and repeats the replacements a build of that module needs.

A missing Go toolchain or a failed build raises: this suite exists to run the real thing, so it never skips.
Builds run only in the setup step before the tests (``python -m tests.tools keda`` in ``make e2e-keda``, ``node``
in ``make e2e-node``); fixtures locate what it built.
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
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from image.build import cache_dir
from tests.chart.chart_tools import ModuleSource

# The newest KEDA release the module proxy serves, and the Kubernetes minor its own go.mod builds against (k8s.io/*
# v0.36): the control plane KEDA's release was tested with.
KEDA_MODULE = "github.com/kedacore/keda/v2"
KEDA_VERSION = "v2.21.0"
KUBERNETES_MODULE = "k8s.io/kubernetes"
KUBERNETES_VERSION = "v1.36.3"
# etcd's 3.6 line is the one Kubernetes 1.36 ships with.
ETCD_MODULE = "go.etcd.io/etcd/server/v3"
ETCD_VERSION = "v3.6.16"
# Cluster DNS for `make e2e-node`: the newest CoreDNS release the module proxy serves.
COREDNS_MODULE = "github.com/coredns/coredns"
COREDNS_VERSION = "v1.15.0"


# Bump when the way a tool is built changes (flags, the generated go.mod), so every cache rebuilds it.
RECIPE = 2


class BuildFailed(Exception):
    """A tool could not be built: the suite fails with this message instead of skipping."""


@dataclass(frozen=True)
class Tool:
    """One Go module at one version and the programs built from it, by binary name and package."""

    name: str
    module: str
    version: str
    programs: tuple[tuple[str, str], ...]
    # -X settings for the linker, e.g. the version a binary reports (KEDA reads the API server's).
    version_variables: tuple[str, ...] = ()
    # Files written into the generated module before the build, as (relative path, text): a main package of our own
    # when the module's own one builds far more than the suite needs.
    sources: tuple[tuple[str, str], ...] = ()
    # Whether the generated module repeats the pinned module's own replace and exclude lines, so that the build
    # resolves the dependencies the module's release was built with.
    keeps_directives: bool = False

    @property
    def needs_go(self) -> bool:
        """Built with Go."""
        return True

    @property
    def stand_in(self) -> str | None:
        """Nothing stands in: the suite runs these builds or nothing."""
        return None

    @property
    def path(self) -> Path:
        """Where the binaries land, one folder per tool and version."""
        return cache_dir() / "bin" / f"{self.name}-{self.version}-r{RECIPE}"

    def build(self) -> Path:
        """Builds every program once and returns the folder; raises BuildFailed with Go's output."""
        return _build(self)


ETCD = Tool("etcd", ETCD_MODULE, ETCD_VERSION, (("etcd", ETCD_MODULE),))
KUBERNETES = Tool(
    "kubernetes",
    KUBERNETES_MODULE,
    KUBERNETES_VERSION,
    (
        ("kube-apiserver", "k8s.io/kubernetes/cmd/kube-apiserver"),
        ("kube-controller-manager", "k8s.io/kubernetes/cmd/kube-controller-manager"),
    ),
    # What Kubernetes' own build stamps (hack/lib/version.sh); without it the API server says v0.0.0-master.
    (
        f"k8s.io/component-base/version.gitVersion={KUBERNETES_VERSION}",
        f"k8s.io/component-base/version.gitMajor={KUBERNETES_VERSION[1:].split('.')[0]}",
        f"k8s.io/component-base/version.gitMinor={KUBERNETES_VERSION.split('.')[1]}",
        "k8s.io/component-base/version.gitTreeState=clean",
        f"k8s.io/client-go/pkg/version.gitVersion={KUBERNETES_VERSION}",
    ),
)
# The node side of the same release, for `make e2e-node`: a tool of its own so that the control plane's binaries (and
# their 10-minute build) stay as they are; it shares the Go build cache, so its packages in common are built already.
KUBERNETES_NODE = Tool(
    "kubernetes-node",
    KUBERNETES_MODULE,
    KUBERNETES_VERSION,
    (
        ("kubelet", "k8s.io/kubernetes/cmd/kubelet"),
        ("kube-scheduler", "k8s.io/kubernetes/cmd/kube-scheduler"),
        ("kube-proxy", "k8s.io/kubernetes/cmd/kube-proxy"),
    ),
    KUBERNETES.version_variables,
)
# CoreDNS with only the plugins a cluster's DNS needs (its own main package compiles in every plugin: cloud DNS
# providers, etcd, ...). The list mirrors the usual Corefile of a cluster: errors, health, ready, kubernetes, cache.
_COREDNS_MAIN = """// Generated by e2e/keda/tools.py: CoreDNS with the plugins of a cluster's Corefile only.
package main

import (
	"github.com/coredns/coredns/coremain"
	_ "github.com/coredns/coredns/core/dnsserver"
	_ "github.com/coredns/coredns/plugin/bind"
	_ "github.com/coredns/coredns/plugin/cache"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/health"
	_ "github.com/coredns/coredns/plugin/kubernetes"
	_ "github.com/coredns/coredns/plugin/log"
	_ "github.com/coredns/coredns/plugin/ready"
)

func main() { coremain.Run() }
"""
COREDNS = Tool(
    "coredns",
    COREDNS_MODULE,
    COREDNS_VERSION,
    (("coredns", "./coredns"),),
    sources=(("coredns/main.go", _COREDNS_MAIN),),
)
KEDA = Tool(
    "keda",
    KEDA_MODULE,
    KEDA_VERSION,
    (
        ("keda-operator", f"{KEDA_MODULE}/cmd/operator"),
        ("keda-adapter", f"{KEDA_MODULE}/cmd/adapter"),
        ("keda-webhooks", f"{KEDA_MODULE}/cmd/webhooks"),
    ),
    (f"{KEDA_MODULE}/version.Version={KEDA_VERSION}",),
    keeps_directives=True,
)
# The Gateway API Inference Extension's endpoint picker (EPP): the last GIE release whose EPP has flow control (v1.6
# ships one without it); its go.mod has no replace directives, so the module proxy's copy builds as released.
GIE_MODULE = "sigs.k8s.io/gateway-api-inference-extension"
GIE_VERSION = "v1.5.0"
# With it, a client of our own (e2e/keda/eppclient) that sends one request over Envoy's ext_proc protocol, built from
# the go-control-plane and grpc versions the EPP's own go.mod requires. The client's hash is in the tool's name, so an
# edit to it rebuilds this tool alone.
_EPP_CLIENT = (Path(__file__).parent / "eppclient" / "main.go").read_text()
EPP = Tool(
    f"epp-{hashlib.sha256(_EPP_CLIENT.encode()).hexdigest()[:12]}",
    GIE_MODULE,
    GIE_VERSION,
    (("epp", f"{GIE_MODULE}/cmd/epp"), ("eppclient", "./eppclient")),
    sources=(("eppclient/main.go", _EPP_CLIENT),),
)
# Its source: the InferencePool CRD and the others the EPP watches.
GIE_SOURCE = ModuleSource(GIE_MODULE, GIE_VERSION)
TOOLS = (ETCD, KUBERNETES, KEDA)
# What `make e2e-node` adds to them.
NODE_TOOLS = (KUBERNETES_NODE, COREDNS)
# KEDA's source: its CRDs and its admission webhooks' configuration.
KEDA_SOURCE = ModuleSource(KEDA_MODULE, KEDA_VERSION)


@contextlib.contextmanager
def _locked(name: str) -> Iterator[None]:
    """Serialises builds of one tool between concurrent runs; a lock of its own so a 30-minute cold build of the
    control plane does not hold up the chart tests' helm lookups."""
    with (cache_dir() / f".lock-{name}").open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _go() -> str:
    go = shutil.which("go")
    if go is None:
        raise BuildFailed("no `go` on PATH: the KEDA e2e suite builds etcd, Kubernetes and KEDA from Go modules")
    return go


def _go_env(gomod_flags: str = "-mod=mod") -> dict[str, str]:
    """The chart tools' settings: one build and module cache, no cgo, never a toolchain download."""
    env = dict(os.environ)
    env.update(
        GOCACHE=str(cache_dir() / "go-build"),
        GOMODCACHE=str(cache_dir() / "go-mod"),
        GOFLAGS=f"{gomod_flags} -buildvcs=false",
        CGO_ENABLED="0",
        GOTOOLCHAIN="local",
    )
    return env


def _run(argv: list[str], cwd: Path, what: str) -> str:
    result = subprocess.run(argv, env=_go_env(), cwd=cwd, capture_output=True, text=True)
    if result.returncode != 0:
        raise BuildFailed(f"{what} failed ({' '.join(argv)}):\n{result.stderr[-6000:]}")
    return result.stdout


def _module_go_mod(module: str, version: str, scratch: Path) -> dict[str, object]:
    """The pinned module's go.mod as ``go mod edit -json`` prints it (downloads the module)."""
    info = json.loads(_run([_go(), "mod", "download", "-json", f"{module}@{version}"], scratch, "go mod download"))
    parsed: dict[str, object] = json.loads(_run([_go(), "mod", "edit", "-json", info["GoMod"]], scratch, "go mod edit"))
    return parsed


def _local_go_version() -> str:
    """The running toolchain's version without the ``go`` prefix (``1.26.8``), for the generated go.mod."""
    return subprocess.run([_go(), "env", "GOVERSION"], capture_output=True, text=True, check=True).stdout.strip()[2:]


def _replacements(tool: Tool, go_mod: dict[str, object]) -> list[str]:
    """The replace (and exclude) lines a build of ``tool`` needs in a module that requires it."""
    lines: list[str] = []
    replaces = go_mod.get("Replace") or []
    assert isinstance(replaces, list)
    if tool.module == KUBERNETES_MODULE:
        # k8s.io/kubernetes requires its staging modules at v0.0.0 and replaces them with folders that are not in its
        # module zip; each is published as k8s.io/<name> v0.<minor>.<patch> of the same release.
        staging_version = "v0" + tool.version[len("v1") :]
        for replace in replaces:
            old, new = replace["Old"]["Path"], replace["New"]["Path"]
            if new.startswith("./staging/"):
                lines.append(f"replace {old} => {old} {staging_version}")
    elif tool.keeps_directives:
        for replace in replaces:
            old, new = replace["Old"], replace["New"]
            left = old["Path"] + (f" {old['Version']}" if old.get("Version") else "")
            right = new["Path"] + (f" {new['Version']}" if new.get("Version") else "")
            lines.append(f"replace {left} => {right}")
        for exclude in go_mod.get("Exclude") or []:  # type: ignore[attr-defined]
            lines.append(f"exclude {exclude['Path']} {exclude['Version']}")
    # etcd's server module replaces only its sibling modules of the same release by relative paths; a dependent
    # module gets them at their required (same) versions, so it needs nothing.
    return lines


def _build(tool: Tool) -> Path:
    with _locked(tool.name):
        if tool.path.exists():
            return tool.path
        tool.path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache_dir(), prefix=f"build-{tool.name}-") as scratch_name:
            scratch = Path(scratch_name)
            go_mod = _module_go_mod(tool.module, tool.version, scratch)
            module_dir = scratch / "module"
            module_dir.mkdir()
            (module_dir / "go.mod").write_text(
                "\n".join(
                    [
                        f"module gpuscaler.test/{tool.name}-tools",
                        "",
                        f"go {_local_go_version()}",
                        "",
                        f"require {tool.module} {tool.version}",
                        "",
                        *_replacements(tool, go_mod),
                        "",
                    ]
                )
            )
            for relative, text in tool.sources:
                (module_dir / relative).parent.mkdir(parents=True, exist_ok=True)
                (module_dir / relative).write_text(text)
            out = scratch / "bin"
            out.mkdir()
            for program, package in tool.programs:
                # One `go build` at a time (the machine has two cores); -mod=mod lets Go fill in go.sum, checked
                # against the checksum database, for this throwaway module.
                ldflags = " ".join(["-s", "-w", *(f"-X '{setting}'" for setting in tool.version_variables)])
                _run(
                    [_go(), "build", "-trimpath", f"-ldflags={ldflags}", "-o", str(out / program), package],
                    module_dir,
                    f"building {program} from {tool.module}@{tool.version}",
                )
            os.replace(out, tool.path)
    return tool.path
