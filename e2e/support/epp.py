"""The Gateway API Inference Extension's real endpoint picker (EPP) on loopback: its CRDs, its pool, its process, and
one request sent to it over Envoy's ext_proc protocol.

The EPP (``cmd/epp`` of GIE v1.5.0, built by ``python -m tests.tools keda``) watches one InferencePool in the
control plane's API server and the pods its selector picks, and queues what it receives in its flow-control layer
(the ``flowControl`` feature gate) while the pool has no endpoint it may dispatch to.
"""

from __future__ import annotations

import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import yaml
from prometheus_client.parser import text_string_to_metric_families

from e2e.keda import tools
from e2e.keda.control_plane import Json, Kube, free_port
from gpuscaler.model.epp_series import EPP_POOL_LABEL
from tests.tools import locate

POOL_API_VERSION = "inference.networking.k8s.io/v1"
QUEUE_SERIES = "inference_extension_flow_control_queue_size"
# Flow control on, everything else at v1.5.0's defaults: no DefaultRequestTTL, so a queued request waits for as long
# as its ext_proc stream lives (pkg/epp/flowcontrol/controller/config.go).
FLOW_CONTROL_CONFIG = """apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
featureGates:
- flowControl
"""


def install_crds(kube: Kube, wait: Callable[[str, Callable[[], bool]], None]) -> None:
    """Applies every CRD of GIE's release (the EPP watches InferencePools and InferenceObjectives) and waits for
    each to be Established."""
    crds = sorted((locate(tools.GIE_SOURCE) / "config" / "crd" / "bases").glob("*.yaml"))
    for crd in crds:
        kube.apply(yaml.safe_load(crd.read_text()))
    for crd in crds:
        name = yaml.safe_load(crd.read_text())["metadata"]["name"]
        wait(f"CRD {name}", partial(_established, kube, name))


def _established(kube: Kube, name: str) -> bool:
    found = kube.get(f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}") or {}
    conditions = (found.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Established" and c.get("status") == "True" for c in conditions)


def inference_pool(name: str, namespace: str, *, app: str, target_port: int, epp: str) -> Json:
    """An InferencePool of the pods labelled ``app=<app>``, served on ``target_port``, picked by the EPP ``epp``."""
    return {
        "apiVersion": POOL_API_VERSION,
        "kind": "InferencePool",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "selector": {"matchLabels": {"app": app}},
            "targetPorts": [{"number": target_port}],
            "endpointPickerRef": {"name": epp, "port": {"number": 9002}},
        },
    }


@dataclass
class Epp:
    """One EPP process for one pool, its gRPC (ext_proc), gRPC health and /metrics on free ports of their own.

    GIE v1.5.0 has no flag for the address: it listens on every address (``:<port>``, cmd/epp/runner/runner.go:275
    and internal/runnable/grpc.go:38), so these ports are reachable from wherever this machine is, for the test's
    length; the test talks to them on 127.0.0.1 only."""

    pool: str
    namespace: str
    kubeconfig: Path
    log_path: Path
    grpc_port: int = field(default_factory=free_port)
    metrics_port: int = field(default_factory=free_port)
    health_port: int = field(default_factory=free_port)
    # --metrics-endpoint-auth: /metrics answers only a bearer token the API server's TokenReview and
    # SubjectAccessReview accept; ``bearer`` is the one this test's own reads send.
    auth: bool = False
    bearer: str | None = None
    process: subprocess.Popen[bytes] | None = None

    def start(self) -> Epp:
        """Starts it and waits until its /metrics shows ``inference_extension_info`` (30 s at most)."""
        binary = locate(tools.EPP) / "epp"
        argv = [
            str(binary),
            f"--pool-name={self.pool}",
            f"--pool-namespace={self.namespace}",
            f"--grpc-port={self.grpc_port}",
            f"--grpc-health-port={self.health_port}",
            f"--metrics-port={self.metrics_port}",
            # Plain gRPC (its default serves TLS with a self-signed certificate), no OTLP exporter to dial, and
            # /metrics open unless this test is about its bearer token.
            "--secure-serving=false",
            "--tracing=false",
            f"--metrics-endpoint-auth={str(self.auth).lower()}",
            "--enable-pprof=false",
            f"--config-text={FLOW_CONTROL_CONFIG}",
            "--v=2",
        ]
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={"KUBECONFIG": str(self.kubeconfig), "PATH": "/usr/bin:/bin"},
            )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"the EPP exited with {self.process.returncode}:\n{self.tail()}")
            try:
                if "inference_extension_info" in self.metrics_text():
                    return self
            except OSError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"the EPP's /metrics did not answer within 30 s:\n{self.tail()}")

    def metrics_text(self) -> str:
        """Its /metrics page as served."""
        headers = {"Authorization": f"Bearer {self.bearer}"} if self.bearer is not None else {}
        request = urllib.request.Request(f"http://127.0.0.1:{self.metrics_port}/metrics", headers=headers)
        with urllib.request.urlopen(request, timeout=5) as response:
            text: str = response.read().decode()
            return text

    def queue_size(self) -> float | None:
        """The summed flow-control queue size of this EPP's pool, or None while no such series is on the page."""
        values = [
            sample.value
            for family in text_string_to_metric_families(self.metrics_text())
            for sample in family.samples
            if sample.name == QUEUE_SERIES and sample.labels.get(EPP_POOL_LABEL) == self.pool
        ]
        return sum(values) if values else None

    def wait_queue(self, expected: float, timeout: float = 30) -> None:
        """Waits until its own /metrics shows ``expected`` queued for the pool."""
        deadline = time.monotonic() + timeout
        seen = None
        while time.monotonic() < deadline:
            if (seen := self.queue_size()) == expected:
                return
            time.sleep(0.1)
        raise AssertionError(f"the EPP's queue for pool {self.pool} is {seen}, not {expected}:\n{self.tail()}")

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@dataclass
class EppRequest:
    """One request in flight through the EPP, as Envoy would send it: e2e/keda/eppclient, its stdin held open so
    that closing it cancels the stream as Envoy does when its client leaves."""

    lines: list[str] = field(default_factory=list)
    process: subprocess.Popen[str] | None = None
    _reader: threading.Thread | None = None

    def send(self, epp: Epp, model: str) -> EppRequest:
        """Sends the request headers and a JSON completion body naming ``model``; waits until both are written."""
        return self.send_to(f"127.0.0.1:{epp.grpc_port}", model)

    def send_to(self, address: str, model: str) -> EppRequest:
        """Sends the request to the EPP's ext_proc port at ``address`` (host:port), as ``send`` does."""
        binary = locate(tools.EPP) / "eppclient"
        self.process = subprocess.Popen(
            [str(binary), address, model],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self._reader = threading.Thread(target=self._read, name="eppclient", daemon=True)
        self._reader.start()
        self.wait_line("sent")
        return self

    def _read(self) -> None:
        assert self.process is not None
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line.rstrip("\n"))

    def wait_line(self, prefix: str, timeout: float = 30) -> str:
        """The first line the client printed that starts with ``prefix`` (``headers`` once the EPP picked)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if line.startswith(prefix):
                    return line
            time.sleep(0.05)
        raise AssertionError(f"the ext_proc client printed no {prefix!r} line within {timeout:g} s: {self.lines}")

    def close(self) -> None:
        """Cancels the stream (stdin closes) and reaps the client."""
        if self.process is None:
            return
        if self.process.stdin is not None:
            self.process.stdin.close()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        if self._reader is not None:
            self._reader.join(5)
        if self.process.stdout is not None:
            self.process.stdout.close()
