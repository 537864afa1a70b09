"""The chart, installed with helm on the real node, under its defaults and under each of its ci/ values files.

Each install adds only ``chart.BASE_SETS`` (the fake collector, imagePullPolicy Never) and what ``ADAPTATIONS``
names for its file, with the reason; the agent's pod and every gateway replica must become Ready, and the scaler
Service must answer KEDA's four RPCs at the address the examples name (cluster DNS, then kube-proxy's ClusterIP).
A values file that cannot run on a node without NVIDIA hardware is in ``CANNOT_RUN``, and its test shows the
failure the chart documents for it instead.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import pytest

from e2e.keda.control_plane import secret
from e2e.node.chart import CI_VALUES, NAMESPACE, Release, install, monitoring_crds, query
from e2e.node.cluster import CHART_IMAGE, Deadline, NodeCluster, in_thread
from e2e.node.conftest import record
from e2e.node.product_image import chart_version
from e2e.support.certs import make_server_certificate


def _library_stand_in(cluster: NodeCluster) -> dict[str, str]:
    """The driver's library is absent on this node: an empty file stands in (the fake collector never loads it)."""
    stand_in = cluster.directory / "libnvidia-ml.so.1"
    stand_in.touch()
    return {"agent.nvmlHostMounts.libraryHostPaths.amd64": str(stand_in)}


def _tls_secret(cluster: NodeCluster) -> dict[str, str]:
    """tls-values.yaml names the Secret gpuscaler-tls: made here from the suite's CA, for the name the gateway
    verifies (<fullname>-agents.<namespace>.svc) and usable as the gateway's client certificate (mTLS)."""
    pki = cluster.plane.certificates
    cert, key = make_server_certificate(
        pki, cluster.directory / "agent-tls", f"{NAMESPACE}-agents.{NAMESPACE}.svc", client_auth=True
    )
    files = {"tls.crt": cert.read_bytes(), "tls.key": key.read_bytes(), "ca.crt": pki.ca.read_bytes()}
    document = secret("gpuscaler-tls", NAMESPACE, files) | {"type": "kubernetes.io/tls"}
    cluster.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}})
    cluster.apply(document)
    return {}


def _pinned_digest(cluster: NodeCluster) -> dict[str, str]:
    """tls-values.yaml pins registry.example/...@sha256:0123...: a digest of no image. The imported image's own
    digest instead, under that registry's name (there is no registry to pull from)."""
    name = f"{CHART_IMAGE}:{chart_version()}"
    listing = cluster.node.ctr("images", "ls").stdout.splitlines()
    digest = next(line.split()[2] for line in listing if line.split()[0] == name)
    cluster.node.tag_image(name, f"registry.example/gpuscaler/gpuscaler@{digest}")
    return {"image.digest": digest}


def _monitoring_crds(cluster: NodeCluster) -> dict[str, str]:
    """The ServiceMonitor and PrometheusRule a values file renders: their CRDs (no operator) let the API accept
    them."""
    for crd in monitoring_crds():
        cluster.apply(crd)
        path = f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{crd['metadata']['name']}"
        Deadline(f"the {crd['spec']['names']['kind']} CRD to be established", 60).until(
            partial(cluster.kube.get, path),
            lambda found: any(
                c["type"] == "Established" and c["status"] == "True"
                for c in ((found or {}).get("status") or {}).get("conditions") or []
            ),
        )
    return {}


def _ipv4_listener(cluster: NodeCluster) -> dict[str, str]:
    """tls-values.yaml listens on "::". The node's pod network is IPv4 only, and gpuscaler's "::" is IPv6 only
    (asyncio sets IPV6_V6ONLY), so no probe or gateway could reach it: 0.0.0.0 instead, the rest as written."""
    return {"agent.listen.host": "0.0.0.0"}


# What a values file needs beyond BASE_SETS on this node, and why (each adaptation returns its --set pairs).
ADAPTATIONS = {
    "host-mounts-dev-values.yaml": [_library_stand_in],
    "servicemonitor-values.yaml": [_monitoring_crds],
    "prometheusrule-values.yaml": [_monitoring_crds],
    "tls-values.yaml": [_tls_secret, _pinned_digest, _ipv4_listener],
}
# Values files that cannot run on a node without NVIDIA hardware: why, and what the pods say instead (a pattern
# in ``describe_pods``), which the test waits for.
CANNOT_RUN = {
    "host-mounts-values.yaml": (
        "mounts /dev/nvidiactl, /dev/nvidia0, /dev/nvidia1 and /dev/nvidia-uvm as hostPath CharDevices: a node "
        "without NVIDIA's driver has none, and making device nodes in the host's /dev is out of bounds",
        r"FailedMount: MountVolume.SetUp failed for volume \"host-dev-nvidiactl\" : hostPath type check failed: "
        r"/dev/nvidiactl is not a character device",
    ),
    "processes-values.yaml": (
        "agent.processes reads NVML's per-process lists, and the agent refuses --processes with the fake collector "
        "(fake GPUs run no processes); its podResources half runs in test_journeys",
        r"needs --collector nvml: fake GPUs run no processes",
    ),
}
# Values files the chart renders into pods no runtime starts: a defect of the chart, named, until it is fixed.
CHART_DEFECTS: dict[str, str] = {}


def values_files() -> list[Path]:
    """Every ci/ values file, read when collected: files added later are tried too."""
    return sorted(CI_VALUES.glob("*.yaml"))


def _runnable() -> list[object]:
    cases: list[object] = []
    for path in values_files():
        if path.name in CANNOT_RUN:
            continue
        marks = []
        if path.name in CHART_DEFECTS:
            marks.append(pytest.mark.xfail(reason=CHART_DEFECTS[path.name], strict=True, raises=AssertionError))
        cases.append(pytest.param(path, id=path.name, marks=marks))
    return cases


@pytest.fixture
def release(chart_cluster: NodeCluster) -> Iterator[Release]:
    """The release the test installs; uninstalled (its namespace deleted, its pods gone) at the end."""
    made = Release(chart_cluster)
    yield made
    if (made.name, made.namespace) in chart_cluster.releases:
        made.uninstall()


def _ids(path: Path) -> str:
    return path.name


@pytest.mark.parametrize("values", _runnable())
async def test_the_chart_runs_under_its_values_file(chart_cluster: NodeCluster, release: Release, values: Path) -> None:
    """The agent pod and every gateway replica become Ready, and the scaler Service answers all four RPCs."""
    sets: dict[str, str] = {}
    for adapt in ADAPTATIONS.get(values.name, []):
        sets |= await in_thread(adapt, chart_cluster)
    await in_thread(lambda: install(chart_cluster, [values], sets))
    agents, gateways = await in_thread(release.wait_ready)
    address = await in_thread(release.service_address)
    answer = await query(address, {"metric": "gpu_utilization"})
    for call in ("get_metric_spec", "get_metrics", "is_active", "stream_is_active"):
        assert answer[call]["ok"], f"{values.name}: {call} through {address} failed: {answer[call]}"
    gpus = (answer.get("explanation") or {}).get("gpus", [])
    assert gpus, f"{values.name}: the scaler counted no GPU: {answer}"
    extra = f" with --set {sets}" if sets else ""
    record(
        f"chart {values.name}{extra}: agent {[p['metadata']['name'] for p in agents]} and "
        f"{len(gateways)} gateway pod(s) Ready; {address} answered over {len(gpus)} GPU(s)"
    )


@pytest.mark.parametrize("values", [CI_VALUES / name for name in CANNOT_RUN], ids=_ids)
async def test_a_values_file_that_needs_nvidia_hardware_says_so(
    chart_cluster: NodeCluster, release: Release, values: Path
) -> None:
    """Without NVIDIA's driver the agent does not run, and its pod says why (an event or the agent's own error),
    as the chart and the agent document: no silent crash loop."""
    reason, evidence = CANNOT_RUN[values.name]
    await in_thread(lambda: install(chart_cluster, [values]))
    described = await in_thread(
        Deadline(f"{values.name}: the pods to say {evidence!r}", 120).until,
        lambda: chart_cluster.describe_pods(NAMESPACE),
        lambda text: re.search(evidence, text) is not None,
    )
    match = re.search(evidence, described)
    assert match is not None
    record(f"chart {values.name}: cannot run here ({reason}); the pod says: {match.group(0)}")
