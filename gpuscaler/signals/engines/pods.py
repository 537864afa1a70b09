"""Which of a selection's pods an engine signal counts, and where each one's metrics page is.

A pod counts when it is Running, Ready and not terminating: a pod that is starting serves no requests yet,
and one that is going has had its traffic moved (a Service drops a pod that is not Ready). Both are left
out and shown in Explain; a pod that counts and cannot be read makes the answer unknown.

The address comes from the pod alone, never from trigger metadata: its IP, and the first port of
1. its ``prometheus.io/port`` annotation (a number, or a declared port's name), with ``prometheus.io/path``;
2. a container port named ``metrics``;
3. the engine's default port (``engines.DEFAULT_PORTS``), where a container declares it.
A hostNetwork pod is never read: its IP is its node's, so an annotation could aim the gateway at the
kubelet or any port on the node.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from gpuscaler.model.engines import DEFAULT_PORTS, Engine
from gpuscaler.model.pods import METRICS_PATH_ANNOTATION, METRICS_PORT_ANNOTATION, PodInfo

METRICS_PORT_NAME = "metrics"
DEFAULT_PATH = "/metrics"
# An absolute path of URL path characters, no query or fragment: what an annotation may name.
_PATH = re.compile(r"/[A-Za-z0-9._~!$&'()*+,;=:@%/-]{0,255}")


@dataclass(frozen=True, slots=True)
class Endpoint:
    """Where one pod's engine serves its metrics page."""

    host: str
    port: int
    path: str

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}{self.path}"


def left_out_because(info: PodInfo) -> str | None:
    """Why a selected pod is not counted (starting, not Ready, terminating, finished), or None when it is."""
    if info.deleting:
        return "terminating: its traffic has moved, so it is left out"
    if info.phase != "Running":
        return f"phase {info.phase or 'unknown'}: left out until it runs"
    if info.ready is not True:
        return "not Ready: left out until it serves (a Service sends it no requests)"
    return None


def metrics_endpoint(info: PodInfo, engine: Engine) -> Endpoint | str:
    """The pod's metrics page, or why it has none that gpuscaler may read (module docstring)."""
    if info.host_network:
        return (
            "a hostNetwork pod: its IP is its node's, and gpuscaler never reads one; run the engine on the pod network"
        )
    if not info.ip:
        return "no pod IP yet"
    path = info.metrics_path or DEFAULT_PATH
    if not _PATH.fullmatch(path):
        return f"annotation {METRICS_PATH_ANNOTATION} {path!r} is not an absolute URL path like '/metrics'"
    if info.metrics_port is not None:
        port = _port(info, info.metrics_port)
        if port is None:
            return (
                f"annotation {METRICS_PORT_ANNOTATION} {info.metrics_port!r} is neither a port number from 1 to "
                "65535 nor the name of a port its containers declare"
            )
        return Endpoint(info.ip, port, path)
    declared = dict(info.ports)
    if METRICS_PORT_NAME in declared:
        return Endpoint(info.ip, declared[METRICS_PORT_NAME], path)
    default = DEFAULT_PORTS[engine]
    if any(number == default for _, number in info.ports):
        return Endpoint(info.ip, default, path)
    return (
        f"it declares no metrics port: annotate it {METRICS_PORT_ANNOTATION}, name a container port "
        f"{METRICS_PORT_NAME!r}, or declare {engine.value}'s port {default}"
    )


def _port(info: PodInfo, text: str) -> int | None:
    if text.isdigit():
        number = int(text)
        return number if 0 < number < 65536 else None
    return next((number for name, number in info.ports if name == text), None)
