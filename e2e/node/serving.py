"""What the serving-from-zero journey runs on the node: the real EPP as a pod, its pool, and the moments it measures.

The EPP is GIE v1.5.0's ``cmd/epp`` (``python -m tests.tools node`` builds it into the tool cache), run in a busybox
pod straight from that folder through a hostPath volume: no registry is here and no image builder is needed for one
static binary. It reaches the API server in-cluster, with its namespace's default ServiceAccount (this control plane
authorizes everything), and runs with flow control on. Its /metrics is open (``--metrics-endpoint-auth=false``): the
bearer token is the chart's ``gateway.epp.metricsToken`` and is tested elsewhere; here the subject is timing.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import urllib.request
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from grpclib.client import Channel

from e2e.keda import tools
from e2e.keda.control_plane import Json
from e2e.node.cluster import CHART, NodeCluster, condition
from e2e.node.images import BUSYBOX_IMAGE
from e2e.support.epp import FLOW_CONTROL_CONFIG
from gpuscaler.generated import externalscaler as keda
from tests.tools import locate

SERVING_FROM_ZERO = CHART / "examples" / "serving-from-zero"
EXAMPLE = SERVING_FROM_ZERO / "vllm-from-zero.yaml"
EPP_GRPC_PORT = 9002
EPP_HEALTH_PORT = 9003
EPP_METRICS_PORT = 9090
POLL_SECONDS = 0.1


def epp_labels(name: str) -> dict[str, str]:
    """The labels GIE v1.5.0's chart gives EPP ``name``'s pods and selects them by (its epplib ``selectorLabels``):
    the example's ``podSelector`` names them."""
    return {"inferencepool": name}


def epp_selector(name: str) -> str:
    """``epp_labels(name)`` as a label selector."""
    return ",".join(f"{key}={value}" for key, value in epp_labels(name).items())


def epp_deployment(name: str, namespace: str, pool: str) -> Json:
    """The EPP for ``pool``: one busybox pod running the tool cache's ``epp`` binary, flow control on, Ready when its
    gRPC health says the ext_proc service serves (GIE's own chart probes the same service)."""
    labels = epp_labels(name)
    argv = [
        "/epp/epp",
        f"--pool-name={pool}",
        f"--pool-namespace={namespace}",
        f"--grpc-port={EPP_GRPC_PORT}",
        f"--grpc-health-port={EPP_HEALTH_PORT}",
        f"--metrics-port={EPP_METRICS_PORT}",
        # Plain gRPC for the test's ext_proc client, no OTLP exporter to dial, an open /metrics (module docstring).
        "--secure-serving=false",
        "--tracing=false",
        "--metrics-endpoint-auth=false",
        "--enable-pprof=false",
        f"--config-text={FLOW_CONTROL_CONFIG}",
        "--v=2",
    ]
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": labels},
            "template": {
                # Where the gateway reads the EPP's page (docs/engines.md: the annotation wins).
                "metadata": {"labels": labels, "annotations": {"prometheus.io/port": str(EPP_METRICS_PORT)}},
                "spec": {
                    "terminationGracePeriodSeconds": 1,
                    "containers": [
                        {
                            "name": "epp",
                            "image": BUSYBOX_IMAGE,
                            "imagePullPolicy": "Never",
                            "command": argv,
                            "ports": [
                                {"name": "grpc", "containerPort": EPP_GRPC_PORT},
                                {"name": "grpc-health", "containerPort": EPP_HEALTH_PORT},
                                {"name": "metrics", "containerPort": EPP_METRICS_PORT},
                            ],
                            "readinessProbe": {
                                "grpc": {"port": EPP_HEALTH_PORT, "service": "inference-extension"},
                                "periodSeconds": 1,
                            },
                            "volumeMounts": [{"name": "epp", "mountPath": "/epp", "readOnly": True}],
                        }
                    ],
                    "volumes": [{"name": "epp", "hostPath": {"path": str(locate(tools.EPP)), "type": "Directory"}}],
                },
            },
        },
    }


def epp_service(name: str, namespace: str) -> Json:
    """The Service an InferencePool's ``endpointPickerRef`` names: the EPP's ext_proc port."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "selector": epp_labels(name),
            "ports": [{"name": "grpc", "port": EPP_GRPC_PORT, "targetPort": EPP_GRPC_PORT}],
        },
    }


def epp_page(ip: str) -> str:
    """The EPP pod's /metrics page, read from the host as the gateway and Prometheus read it."""
    with urllib.request.urlopen(f"http://{ip}:{EPP_METRICS_PORT}/metrics", timeout=5) as response:
        text: str = response.read().decode()
        return text


def scaled_object_active(cluster: NodeCluster, namespace: str, name: str) -> bool:
    """Whether KEDA's ScaledObject has its Active condition True."""
    found = cluster.kube.get(f"/apis/keda.sh/v1alpha1/namespaces/{namespace}/scaledobjects/{name}")
    return condition(found, "Active") == "True"


@dataclass
class Moments:
    """The monotonic times at which the journey first saw each event after a request was sent."""

    sent: float = 0.0
    seen: dict[str, float] = field(default_factory=dict)

    def mark(self, what: str) -> None:
        self.seen.setdefault(what, time.monotonic())

    def after(self, what: str) -> float:
        """Seconds from sending to ``what``."""
        return self.seen[what] - self.sent

    def describe(self) -> str:
        return ", ".join(f"{what} {at - self.sent:.1f} s" for what, at in sorted(self.seen.items(), key=lambda i: i[1]))


async def watch(what: str, moments: Moments, probe: object, timeout: float) -> None:
    """Marks ``what`` the first time ``probe()`` (a blocking callable, run in a thread) returns something true."""
    assert callable(probe)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await asyncio.to_thread(probe):
            moments.mark(what)
            return
        await asyncio.sleep(POLL_SECONDS)
    raise AssertionError(f"{what}: not seen within {timeout:g} s of sending; seen: {moments.describe()}")


@contextlib.asynccontextmanager
async def active_stream(
    address: str, metadata: dict[str, str], namespace: str, name: str
) -> AsyncIterator[asyncio.Queue[tuple[float, bool | BaseException]]]:
    """A StreamIsActive of the test's own at the gateway, as KEDA opens one for ScaledObject ``namespace/name`` (a
    name of its own: KEDA's stream is left alone): each message, as (monotonic time received, result), goes on the
    queue it yields, and the error that ends the stream, if one does."""
    host, port = address.rsplit(":", 1)
    channel = Channel(host, int(port))
    received: asyncio.Queue[tuple[float, bool | BaseException]] = asyncio.Queue()
    ref = keda.ScaledObjectRef(name=name, namespace=namespace, scaler_metadata=metadata)

    async def read() -> None:
        try:
            async for message in keda.ExternalScalerStub(channel).stream_is_active(ref):
                received.put_nowait((time.monotonic(), bool(message.result)))
        except Exception as error:  # the test reports it: a stream that ended says why
            received.put_nowait((time.monotonic(), error))

    reader = asyncio.create_task(read())
    try:
        yield received
    finally:
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reader
        channel.close()


async def first_true(
    received: asyncio.Queue[tuple[float, bool | BaseException]], moments: Moments, what: str, timeout: float
) -> None:
    """Marks ``what`` at the first ``true`` the stream sent after the request."""
    deadline = time.monotonic() + timeout
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise AssertionError(f"{what}: no true within {timeout:g} s; seen: {moments.describe()}")
        try:
            at, result = await asyncio.wait_for(received.get(), remaining)
        except TimeoutError:
            continue
        if isinstance(result, BaseException):
            raise AssertionError(f"{what}: the stream ended: {result!r}; seen: {moments.describe()}")
        if result and at >= moments.sent:
            moments.seen.setdefault(what, at)
            return
