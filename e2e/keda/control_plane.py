"""A Kubernetes control plane with KEDA on 127.0.0.1: etcd, kube-apiserver, kube-controller-manager, KEDA's operator
and metrics adapter as local processes, and a small REST client for the tests.

For ``make e2e-keda`` there is no kubelet and no scheduler. The controller manager runs the Deployment, ReplicaSet and
HPA controllers, so a Deployment's ``spec.replicas`` is what KEDA and the HPA decided; ``PodStandIn`` plays the
kubelet's one part the HPA reads (a pod is Running and Ready), because ``metricType: Value`` multiplies by the ready
pods. ``make e2e-node`` starts the same plane with other ``PlaneSettings`` (e2e/node/node.py), and pods really run.

Every process logs to its own file in the folder given to ``ControlPlane.start``; ``tails`` gathers them for a failed
test's report.
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import itertools
import json
import os
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import yaml

from e2e.keda import tools
from e2e.support.certs import TlsFiles, make_certificates, make_server_certificate
from tests.tools import locate, programs

Json = dict[str, Any]

START_TIMEOUT_SECONDS = 120.0
STOP_TIMEOUT_SECONDS = 15.0
# The HPA controller's sync period (default 15 s): short, so each HPA step is seconds apart and the suite takes minutes.
HPA_SYNC_SECONDS = 1
KEDA_NAMESPACE = "keda"
ADAPTER_SERVICE = "keda-metrics-apiserver"
WEBHOOKS_SERVICE = "keda-admission-webhooks"
EXTERNAL_METRICS_API = "v1beta1.external.metrics.k8s.io"

# (apiVersion, kind) -> (plural, namespaced) for the kinds the suite writes.
RESOURCES: dict[tuple[str, str], tuple[str, bool]] = {
    ("v1", "Namespace"): ("namespaces", False),
    ("v1", "Secret"): ("secrets", True),
    ("v1", "Service"): ("services", True),
    ("v1", "Pod"): ("pods", True),
    ("v1", "ConfigMap"): ("configmaps", True),
    ("v1", "ServiceAccount"): ("serviceaccounts", True),
    ("v1", "Node"): ("nodes", False),
    ("apps/v1", "Deployment"): ("deployments", True),
    ("apps/v1", "DaemonSet"): ("daemonsets", True),
    ("apps/v1", "StatefulSet"): ("statefulsets", True),
    ("node.k8s.io/v1", "RuntimeClass"): ("runtimeclasses", False),
    ("keda.sh/v1alpha1", "ScaledObject"): ("scaledobjects", True),
    ("keda.sh/v1alpha1", "TriggerAuthentication"): ("triggerauthentications", True),
    ("inference.networking.k8s.io/v1", "InferencePool"): ("inferencepools", True),
    ("apiregistration.k8s.io/v1", "APIService"): ("apiservices", False),
    ("admissionregistration.k8s.io/v1", "ValidatingWebhookConfiguration"): ("validatingwebhookconfigurations", False),
    ("apiextensions.k8s.io/v1", "CustomResourceDefinition"): ("customresourcedefinitions", False),
    ("resource.k8s.io/v1", "DeviceClass"): ("deviceclasses", False),
    ("resource.k8s.io/v1", "ResourceSlice"): ("resourceslices", False),
    ("resource.k8s.io/v1", "ResourceClaim"): ("resourceclaims", True),
    ("resource.k8s.io/v1", "ResourceClaimTemplate"): ("resourceclaimtemplates", True),
    ("rbac.authorization.k8s.io/v1", "ClusterRole"): ("clusterroles", False),
    ("rbac.authorization.k8s.io/v1", "ClusterRoleBinding"): ("clusterrolebindings", False),
    ("rbac.authorization.k8s.io/v1", "Role"): ("roles", True),
    ("rbac.authorization.k8s.io/v1", "RoleBinding"): ("rolebindings", True),
}


@dataclass(frozen=True)
class PlaneSettings:
    """What differs between the suites' control planes; the defaults are e2e-keda's (loopback only, no pod runs)."""

    # The address the API server advertises in the `kubernetes` Service's endpoints. 127.0.0.1 writes none (the API
    # refuses loopback endpoints); another address is served on every interface and put in the certificate, so that
    # pods reach the API through the `kubernetes` Service's ClusterIP, as in-cluster clients do.
    advertise_address: str = "127.0.0.1"
    # Service accounts as a cluster has them: the ServiceAccount admission plugin, the controllers that create each
    # namespace's `default` account and its `kube-root-ca.crt`, so a pod's projected API token can be mounted.
    service_accounts: bool = False
    # Controllers beyond the Deployment, ReplicaSet, HPA and garbage-collector ones (e.g. "daemonset-controller").
    more_controllers: tuple[str, ...] = ()
    # The HPA's scale-down stabilisation window (the controller manager's default is 5 minutes).
    downscale_stabilization: str | None = None
    # Mark every pod Running and Ready (there is no kubelet).
    pod_stand_in: bool = True
    # Admit privileged containers and host namespaces (the API server refuses them otherwise).
    allow_privileged: bool = False


SERVICE_CLUSTER_IP_RANGE = "10.96.0.0/24"
KUBERNETES_SERVICE_IP = "10.96.0.1"  # the first address of the range: the `kubernetes` Service's ClusterIP


class ControlPlaneFailed(AssertionError):
    """A control-plane process did not start or died; the message carries its log's tail."""


class ApiError(Exception):
    """The API server answered with an error status."""

    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"{status}: {body[:2000]}")
        self.status = status
        self.body = body


def _http_get(port: int, path: str) -> str:
    """A plain HTTP GET on loopback; raises unless 200."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        body = response.read().decode(errors="replace")
        if response.status != 200:
            raise ApiError(response.status, body)
        return body
    finally:
        connection.close()


def free_port() -> int:
    """A loopback port that was free a moment ago, for processes that cannot report an ephemeral one."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass
class Daemon:
    """One control-plane process with its log file."""

    name: str
    argv: list[str]
    log_path: Path
    environ: dict[str, str]
    process: subprocess.Popen[bytes] | None = None

    def start(self) -> Daemon:
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.environ,
                start_new_session=True,  # a Ctrl-C on pytest reaches the suite, which stops these in order
            )
        return self

    def check_alive(self) -> None:
        """Raises with the log's tail if the process has exited."""
        if self.process is not None and self.process.poll() is not None:
            raise ControlPlaneFailed(f"{self.name} exited with {self.process.returncode}:\n{self.tail()}")

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:]) or "(empty log)"

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after a grace period; never raises (teardown must reach every process)."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(STOP_TIMEOUT_SECONDS)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


class Kube:
    """A minimal client of the API server: JSON over HTTPS with a bearer token, synchronous (call it from a thread).

    One connection per call, closed explicitly: the suite runs with ``filterwarnings = error``, and urllib leaves
    TLS sockets to the garbage collector.
    """

    def __init__(self, server: str, token: str, ca: Path) -> None:
        self.server = server
        parsed = urllib.parse.urlsplit(server)
        self._host, self._port = parsed.hostname or "127.0.0.1", parsed.port or 443
        self._token = token
        self._context = ssl.create_default_context(cafile=str(ca))

    @contextlib.contextmanager
    def _call(
        self, method: str, path: str, body: bytes | None, content_type: str, timeout: float
    ) -> Iterator[http.client.HTTPResponse]:
        connection = http.client.HTTPSConnection(self._host, self._port, context=self._context, timeout=timeout)
        try:
            headers = {"Authorization": f"Bearer {self._token}", "Accept": "application/json"}
            if body is not None:
                headers["Content-Type"] = content_type
            connection.request(method, path, body=body, headers=headers)
            yield connection.getresponse()
        finally:
            connection.close()

    def request(
        self,
        method: str,
        path: str,
        body: Json | None = None,
        *,
        content_type: str = "application/json",
        timeout: float = 30.0,
    ) -> Json:
        data = None if body is None else json.dumps(body).encode()
        with self._call(method, path, data, content_type, timeout) as response:
            payload = response.read()
            if response.status >= 400:
                raise ApiError(response.status, payload.decode(errors="replace"))
        result: Json = json.loads(payload) if payload else {}
        return result

    def text(self, path: str) -> str:
        """A plain-text endpoint such as /readyz."""
        with self._call("GET", path, None, "", 5.0) as response:
            return str(response.read().decode(errors="replace"))

    def get(self, path: str) -> Json | None:
        """The object at ``path``, or None when it does not exist."""
        try:
            return self.request("GET", path)
        except ApiError as error:
            if error.status == 404:
                return None
            raise

    def apply(self, document: Mapping[str, Any]) -> Json:
        """Server-side apply with strict field validation: an unknown or misspelt field is an error, not dropped."""
        path = object_path(document)
        query = urllib.parse.urlencode({"fieldManager": "gpuscaler-e2e", "force": "true", "fieldValidation": "Strict"})
        return self.request("PATCH", f"{path}?{query}", dict(document), content_type="application/apply-patch+yaml")

    def delete(self, document: Mapping[str, Any]) -> None:
        with contextlib.suppress(ApiError):
            self.request("DELETE", object_path(document))

    def watch(self, path: str, on_event: Callable[[Json], None], stop: threading.Event) -> None:
        """Calls ``on_event`` with every watch event on ``path`` (a list URL) until ``stop`` is set."""
        separator = "&" if "?" in path else "?"
        with self._call("GET", f"{path}{separator}watch=1", None, "", 3600.0) as response:
            if response.status >= 400:
                raise ApiError(response.status, response.read().decode(errors="replace"))
            for line in response:
                if stop.is_set():
                    return
                if line.strip():
                    on_event(json.loads(line))


def object_path(document: Mapping[str, Any]) -> str:
    """The REST path of one object, from its apiVersion, kind, namespace and name."""
    api_version, kind = document["apiVersion"], document["kind"]
    plural, namespaced = RESOURCES[(api_version, kind)]
    base = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
    metadata = document["metadata"]
    namespace = f"/namespaces/{metadata.get('namespace', 'default')}" if namespaced else ""
    return f"{base}{namespace}/{plural}/{metadata['name']}"


def _condition(document: Json | None, kind: str) -> Json | None:
    for condition in ((document or {}).get("status") or {}).get("conditions") or []:
        if condition.get("type") == kind:
            found: Json = condition
            return found
    return None


@dataclass
class ControlPlane:
    """The running processes, the admin client, and the files a test needs (CA, certificates for scalers)."""

    directory: Path
    kube: Kube
    certificates: TlsFiles
    daemons: list[Daemon] = field(default_factory=list)
    stand_in: PodStandIn | None = None
    settings: PlaneSettings = field(default_factory=PlaneSettings)
    api_port: int = 0
    kubeconfig: Path | None = None

    # --- start -------------------------------------------------------------------------------------------

    @classmethod
    def start(
        cls, directory: Path, programs: Mapping[str, Path], settings: PlaneSettings | None = None
    ) -> ControlPlane:
        """Starts everything in order, each waited for; on any failure stops what started and raises."""
        directory.mkdir(parents=True, exist_ok=True)
        certificates = make_certificates(directory / "pki")
        token = secrets.token_hex(16)
        api_port = free_port()
        server = f"https://127.0.0.1:{api_port}"
        plane = cls(directory, Kube(server, token, certificates.ca), certificates, settings=settings or PlaneSettings())
        plane.api_port = api_port
        try:
            plane._start_all(programs, token, api_port)
        except BaseException:
            plane.stop()
            raise
        return plane

    def _start_all(self, programs: Mapping[str, Path], token: str, api_port: int) -> None:
        kubeconfig = self._write_kubeconfig(token)
        self.kubeconfig = kubeconfig
        self._start_etcd(programs["etcd"])
        self._start_apiserver(programs["kube-apiserver"], token, api_port)
        self._start_controller_manager(programs["kube-controller-manager"], kubeconfig)
        adapter_port = free_port()
        self._install_keda_api_objects(adapter_port)
        self._start_keda(programs["keda-operator"], programs["keda-adapter"], kubeconfig, adapter_port)
        self._start_keda_webhooks(programs["keda-webhooks"], kubeconfig)
        if self.settings.pod_stand_in:
            self.stand_in = PodStandIn(self.kube)
            self.stand_in.start()

    def start_daemon(self, name: str, argv: Sequence[str], environ: Mapping[str, str] | None = None) -> Daemon:
        """Starts one process that logs to ``<name>.log`` in the plane's folder and is stopped with the plane
        (newest first), without the caller's KUBE*, KEDA* and WATCH_* environment."""
        env = {key: value for key, value in os.environ.items() if not key.startswith(("KUBE", "KEDA", "WATCH_"))}
        env.update(environ or {})
        daemon = Daemon(name, list(argv), self.directory / f"{name}.log", env).start()
        self.daemons.append(daemon)
        return daemon

    def wait_for(self, what: str, ready: Callable[[], bool], daemons: Sequence[Daemon]) -> None:
        """Polls ``ready`` until it is true; raises with the daemons' log tails after START_TIMEOUT_SECONDS, or at
        once when one of them exits."""
        deadline = time.monotonic() + START_TIMEOUT_SECONDS
        last: BaseException | None = None
        while time.monotonic() < deadline:
            for daemon in daemons:
                daemon.check_alive()
            try:
                if ready():
                    return
            except Exception as error:  # not up yet: refused, 503, ...
                last = error
            time.sleep(0.2)
        tails = "\n\n".join(f"--- {d.name} ---\n{d.tail()}" for d in daemons)
        raise ControlPlaneFailed(f"{what} not ready within {START_TIMEOUT_SECONDS:g}s (last: {last}):\n{tails}")

    def _write_kubeconfig(self, token: str) -> Path:
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": "e2e",
                    "cluster": {"server": self.kube.server, "certificate-authority": str(self.certificates.ca)},
                }
            ],
            "users": [{"name": "admin", "user": {"token": token}}],
            "contexts": [{"name": "e2e", "context": {"cluster": "e2e", "user": "admin"}}],
            "current-context": "e2e",
        }
        path = self.directory / "kubeconfig"
        path.write_text(yaml.safe_dump(config))
        return path

    def _start_etcd(self, etcd: Path) -> None:
        client, peer = free_port(), free_port()
        self.etcd_url = f"http://127.0.0.1:{client}"
        daemon = self.start_daemon(
            "etcd",
            [
                str(etcd),
                "--name=e2e",
                f"--data-dir={self.directory / 'etcd-data'}",
                f"--listen-client-urls={self.etcd_url}",
                f"--advertise-client-urls={self.etcd_url}",
                f"--listen-peer-urls=http://127.0.0.1:{peer}",
                f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
                f"--initial-cluster=e2e=http://127.0.0.1:{peer}",
                # A throw-away store on a shared machine: durability buys nothing, fsync latency costs seconds.
                "--unsafe-no-fsync",
                "--log-level=warn",
            ],
        )

        def healthy() -> bool:
            return bool(json.loads(_http_get(client, "/health")).get("health") == "true")

        self.wait_for("etcd", healthy, [daemon])

    def _apiserver_network_flags(self) -> list[str]:
        """Where the API server listens and what it advertises, with the certificate that goes with it."""
        pki, advertise = self.certificates, self.settings.advertise_address
        if advertise == "127.0.0.1":
            return [
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                f"--tls-cert-file={pki.server_cert}",
                f"--tls-private-key-file={pki.server_key}",
                # Endpoints on loopback are refused; without a reconciler there is no kubernetes Endpoints to write.
                "--endpoint-reconciler-type=none",
            ]
        # Pods dial the `kubernetes` Service's ClusterIP and verify it; the suite dials 127.0.0.1.
        cert, key = make_server_certificate(
            pki,
            self.directory / "apiserver-certs",
            "kubernetes.default.svc",
            more_names=["DNS:localhost", "IP:127.0.0.1", f"IP:{advertise}", f"IP:{KUBERNETES_SERVICE_IP}"],
        )
        return [
            "--bind-address=0.0.0.0",
            f"--advertise-address={advertise}",
            # Logs and exec reach the kubelet at the node's address (no DNS knows its name).
            "--kubelet-preferred-address-types=InternalIP",
            f"--tls-cert-file={cert}",
            f"--tls-private-key-file={key}",
        ]

    def _start_apiserver(self, apiserver: Path, token: str, port: int) -> None:
        pki = self.certificates
        tokens = self.directory / "tokens.csv"
        tokens.write_text(f'{token},admin,admin,"system:masters"\n')
        # No ServiceAccount controller runs for e2e-keda, and nothing there mounts a token.
        admission = [] if self.settings.service_accounts else ["--disable-admission-plugins=ServiceAccount"]
        daemon = self.start_daemon(
            "kube-apiserver",
            [
                str(apiserver),
                f"--etcd-servers={self.etcd_url}",
                *self._apiserver_network_flags(),
                f"--secure-port={port}",
                f"--token-auth-file={tokens}",
                # The test control plane's only users are the suite and its own components, all admin.
                "--authorization-mode=AlwaysAllow",
                f"--service-cluster-ip-range={SERVICE_CLUSTER_IP_RANGE}",
                f"--service-account-issuer={self.kube.server}",
                f"--service-account-key-file={pki.server_cert}",
                f"--service-account-signing-key-file={pki.server_key}",
                *admission,
                *(["--allow-privileged=true"] if self.settings.allow_privileged else []),
                # The aggregation layer, so the API server proxies external.metrics.k8s.io to KEDA's adapter.
                f"--requestheader-client-ca-file={pki.ca}",
                "--requestheader-allowed-names=",
                "--requestheader-username-headers=X-Remote-User",
                "--requestheader-group-headers=X-Remote-Group",
                "--requestheader-extra-headers-prefix=X-Remote-Extra-",
                f"--proxy-client-cert-file={pki.client_cert}",
                f"--proxy-client-key-file={pki.client_key}",
                "--enable-priority-and-fairness=false",
                "--profiling=false",
            ],
        )
        self.wait_for("kube-apiserver", lambda: self.kube.text("/readyz") == "ok", [daemon])

    def _start_controller_manager(self, manager: Path, kubeconfig: Path) -> None:
        settings = self.settings
        # The garbage collector deletes the HPA of a deleted ScaledObject (KEDA relies on its owner reference).
        controllers = ["deployment", "replicaset", "horizontalpodautoscaling", "garbagecollector"]
        controllers += settings.more_controllers
        more_flags = []
        if settings.service_accounts:
            controllers += ["serviceaccount-controller", "root-ca-certificate-publisher-controller"]
            more_flags.append(f"--root-ca-file={self.certificates.ca}")
        if settings.downscale_stabilization is not None:
            more_flags.append(f"--horizontal-pod-autoscaler-downscale-stabilization={settings.downscale_stabilization}")
        daemon = self.start_daemon(
            "kube-controller-manager",
            [
                str(manager),
                f"--kubeconfig={kubeconfig}",
                f"--controllers={','.join(controllers)}",
                "--leader-elect=false",
                "--secure-port=0",
                "--use-service-account-credentials=false",
                f"--horizontal-pod-autoscaler-sync-period={HPA_SYNC_SECONDS}s",
                "--concurrent-horizontal-pod-autoscaler-syncs=5",
                *more_flags,
            ],
        )
        # Without a secure port it serves no health endpoint; its log says when each controller runs.
        started = ('"Starting controller" controller="deployment"', '"Starting HPA controller"', 'name="replicaset"')
        self.wait_for("kube-controller-manager", lambda: all(line in daemon.log_text() for line in started), [daemon])

    def _install_keda_api_objects(self, adapter_port: int) -> None:
        crds = sorted((locate(tools.KEDA_SOURCE) / "config" / "crd" / "bases").glob("*.yaml"))
        for crd in crds:
            self.kube.apply(yaml.safe_load(crd.read_text()))
        for crd in crds:
            name = yaml.safe_load(crd.read_text())["metadata"]["name"]
            self.wait_for(f"CRD {name}", partial(self._established, name), [])
        self.kube.apply(namespace(KEDA_NAMESPACE))
        # The API server refuses loopback Endpoints, but follows an ExternalName Service to the adapter's port.
        self.kube.apply(_localhost_service(ADAPTER_SERVICE, adapter_port))
        self.kube.apply(
            {
                "apiVersion": "apiregistration.k8s.io/v1",
                "kind": "APIService",
                "metadata": {"name": EXTERNAL_METRICS_API},
                "spec": {
                    "service": {"name": ADAPTER_SERVICE, "namespace": KEDA_NAMESPACE, "port": adapter_port},
                    "group": "external.metrics.k8s.io",
                    "version": "v1beta1",
                    "groupPriorityMinimum": 100,
                    "versionPriority": 100,
                    # The aggregator checks the name <service>.<namespace>.svc, which no loopback certificate can
                    # carry usefully; the hop is 127.0.0.1 to 127.0.0.1.
                    "insecureSkipTLSVerify": True,
                },
            }
        )

    def _established(self, crd: str) -> bool:
        found = self.kube.get(f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{crd}")
        condition = _condition(found, "Established")
        return condition is not None and condition.get("status") == "True"

    def _start_keda(self, operator: Path, adapter: Path, kubeconfig: Path, adapter_port: int) -> None:
        pki = self.certificates
        # KEDA's operator and adapter talk gRPC with mTLS from ca.crt, tls.crt and tls.key in their --cert-dir.
        operator_certs = self._cert_dir("operator-certs", pki.server_cert, pki.server_key)
        adapter_certs = self._cert_dir("adapter-certs", pki.client_cert, pki.client_key)
        # --ca-dir: the CAs KEDA adds to the system roots for scalers (the chart's customCA), so `enableTLS: "true"`
        # can verify an agent certified by the suite's CA.
        scaler_cas = self.directory / "scaler-cas"
        scaler_cas.mkdir(exist_ok=True)
        shutil.copy(pki.ca, scaler_cas / "e2e-ca.crt")
        environ = {
            "KUBECONFIG": str(kubeconfig),
            "WATCH_NAMESPACE": "",
            "POD_NAMESPACE": KEDA_NAMESPACE,
            "KEDA_CLUSTER_OBJECT_NAMESPACE": KEDA_NAMESPACE,
        }
        metrics_service = f"127.0.0.1:{free_port()}"
        operator_daemon = self.start_daemon(
            "keda-operator",
            [
                str(operator),
                f"--metrics-bind-address=127.0.0.1:{free_port()}",
                f"--health-probe-bind-address=127.0.0.1:{free_port()}",
                f"--metrics-service-bind-address={metrics_service}",
                f"--cert-dir={operator_certs}",
                f"--ca-dir={scaler_cas}",
                "--enable-cert-rotation=false",
                "--leader-elect=false",
                "--zap-log-level=info",
                "--zap-encoder=console",
            ],
            environ,
        )
        adapter_daemon = self.start_daemon(
            "keda-adapter",
            [
                str(adapter),
                f"--secure-port={adapter_port}",
                "--bind-address=127.0.0.1",
                f"--tls-cert-file={pki.server_cert}",
                f"--tls-private-key-file={pki.server_key}",
                f"--cert-dir={adapter_certs}",
                f"--metrics-service-address={metrics_service}",
                f"--port={free_port()}",
                f"--lister-kubeconfig={kubeconfig}",
                f"--authentication-kubeconfig={kubeconfig}",
                f"--authorization-kubeconfig={kubeconfig}",
                "--zap-log-level=info",
                "--zap-encoder=console",
            ],
            environ,
        )
        path = f"/apis/apiregistration.k8s.io/v1/apiservices/{EXTERNAL_METRICS_API}"

        def available() -> bool:
            condition = _condition(self.kube.get(path), "Available")
            return condition is not None and condition.get("status") == "True"

        self.wait_for("KEDA's external metrics API", available, [operator_daemon, adapter_daemon])

    def _start_keda_webhooks(self, webhooks: Path, kubeconfig: Path) -> None:
        """KEDA's admission webhooks, registered with failurePolicy Fail: what they refuse, the API server refuses."""
        cert_dir = self.directory / "webhook-certs"
        # The API server verifies the name <service>.<namespace>.svc, even behind an ExternalName Service.
        make_server_certificate(self.certificates, cert_dir, f"{WEBHOOKS_SERVICE}.{KEDA_NAMESPACE}.svc")
        port, probe = free_port(), free_port()
        daemon = self.start_daemon(
            "keda-webhooks",
            [
                str(webhooks),
                f"--port={port}",
                f"--cert-dir={cert_dir}",
                f"--health-probe-bind-address=127.0.0.1:{probe}",
                f"--metrics-bind-address=127.0.0.1:{free_port()}",
                "--zap-log-level=info",
                "--zap-encoder=console",
            ],
            {"KUBECONFIG": str(self.directory / "kubeconfig"), "POD_NAMESPACE": KEDA_NAMESPACE},
        )

        self.wait_for("KEDA's admission webhooks", lambda: _http_get(probe, "/readyz") == "ok", [daemon])
        self.kube.apply(_localhost_service(WEBHOOKS_SERVICE, port))
        configuration = yaml.safe_load(
            (locate(tools.KEDA_SOURCE) / "config" / "webhooks" / "validation_webhooks.yaml").read_text()
        )
        ca_bundle = base64.b64encode(self.certificates.ca.read_bytes()).decode()
        for webhook in configuration["webhooks"]:
            webhook["clientConfig"]["service"] |= {"namespace": KEDA_NAMESPACE, "port": port}
            webhook["clientConfig"]["caBundle"] = ca_bundle
            # KEDA ships Ignore (a down webhook must not block a cluster); here a down webhook must fail the test.
            webhook["failurePolicy"] = "Fail"
        self.kube.apply(configuration)

    def _cert_dir(self, name: str, cert: Path, key: Path) -> Path:
        folder = self.directory / name
        folder.mkdir(exist_ok=True)
        shutil.copy(self.certificates.ca, folder / "ca.crt")
        shutil.copy(cert, folder / "tls.crt")
        shutil.copy(key, folder / "tls.key")
        return folder

    # --- use -------------------------------------------------------------------------------------------

    def check_alive(self) -> None:
        """Raises if any control-plane process has died (a test's failure is then the plane's, not ours)."""
        for daemon in self.daemons:
            daemon.check_alive()

    def tails(self, lines: int = 60) -> str:
        """The end of every process's log, for a failed test's report."""
        return "\n\n".join(f"--- {d.name} ({d.log_path}) ---\n{d.tail(lines)}" for d in self.daemons)

    def stop(self) -> None:
        """Stops every process, newest first (KEDA before the API server before etcd)."""
        if self.stand_in is not None:
            self.stand_in.stop()
        for daemon in reversed(self.daemons):
            daemon.stop()


class PodStandIn:
    """The kubelet's part the HPA and the gateway read: every pod becomes Running and Ready shortly after it is
    created, with an IP of its own (127.1.0.0/16: loopback, where a test can serve the pod's metrics page)."""

    def __init__(self, kube: Kube) -> None:
        self._kube = kube
        self._addresses = itertools.count()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pod-stand-in", daemon=True)
        self.errors: list[str] = []

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.wait(0.25):
            try:
                self._mark_ready()
            except Exception as error:  # the API server stopping under us at teardown, or a pod just deleted
                self.errors.append(str(error))

    def _mark_ready(self) -> None:
        pods = self._kube.request("GET", "/api/v1/pods")["items"]
        for pod in pods:
            ready = _condition(pod, "Ready")
            if pod.get("metadata", {}).get("deletionTimestamp") or (ready and ready.get("status") == "True"):
                continue
            now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            number = next(self._addresses)
            ip = f"127.1.{number // 250 % 250}.{number % 250 + 1}"
            status = {
                "phase": "Running",
                "podIP": ip,
                "podIPs": [{"ip": ip}],
                "conditions": [
                    {"type": "Ready", "status": "True", "lastTransitionTime": now},
                    {"type": "ContainersReady", "status": "True", "lastTransitionTime": now},
                ],
                "startTime": now,
            }
            metadata = pod["metadata"]
            with contextlib.suppress(ApiError):
                self._kube.request(
                    "PATCH",
                    f"/api/v1/namespaces/{metadata['namespace']}/pods/{metadata['name']}/status",
                    {"status": status},
                    content_type="application/merge-patch+json",
                )


def namespace(name: str) -> Json:
    """The manifest of the Namespace ``name``, to apply before what lives in it."""
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}


def deployment(
    name: str,
    namespace_name: str,
    *,
    replicas: int = 0,
    labels: Mapping[str, str] | None = None,
    annotations: Mapping[str, str] | None = None,
) -> Json:
    """A Deployment whose pods never run (no kubelet): the image is never pulled."""
    pod_labels = {"app": name, **(labels or {})}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": namespace_name},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": pod_labels, **({"annotations": dict(annotations)} if annotations else {})},
                "spec": {
                    "automountServiceAccountToken": False,
                    "containers": [{"name": "main", "image": "gpuscaler-e2e/never-pulled:0"}],
                },
            },
        },
    }


def secret(name: str, namespace_name: str, files: Mapping[str, bytes]) -> Json:
    """A Secret manifest in ``namespace_name`` holding ``files``, base64-encoded as the API wants them."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": name, "namespace": namespace_name},
        "data": {key: base64.b64encode(value).decode() for key, value in files.items()},
    }


@contextlib.contextmanager
def running(directory: Path, settings: PlaneSettings | None = None) -> Iterator[ControlPlane]:
    """Starts the control plane with the tools the setup step built, and stops it on the way out."""
    plane = ControlPlane.start(directory, programs(tools.TOOLS), settings)
    try:
        yield plane
    finally:
        plane.stop()


def _localhost_service(name: str, port: int) -> dict[str, Any]:
    """A Service in KEDA's namespace that leads to ``localhost:port``: the API server refuses loopback Endpoints,
    but follows an ExternalName Service."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": KEDA_NAMESPACE},
        "spec": {
            "type": "ExternalName",
            "externalName": "localhost",
            "ports": [{"name": "https", "port": port, "protocol": "TCP"}],
        },
    }
