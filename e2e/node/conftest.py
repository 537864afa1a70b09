"""Fixtures for the node suite: the loopback control plane of e2e-keda, plus one real node, for the whole session.

Collected only under ``make e2e-node`` (GPUSCALER_E2E_NODE=1): it needs root, Debian packages and minutes. Ignored,
not skipped, otherwise, so nothing in it passes by being skipped; and once collected it never skips: a missing
prerequisite fails the session with what to do. At the end the session fails if anything it made is left behind
(pods, mounts, containerd tasks and shims, cgroups).
"""

from __future__ import annotations

import os
import time
from collections.abc import Generator, Iterator

import pytest

from e2e.keda import tools
from e2e.keda.control_plane import ControlPlane, namespace
from e2e.node import host
from e2e.node.chart import GPU_NODE_LABEL, NAMESPACE, RUNTIME_CLASS, Release, install
from e2e.node.cluster import CHART_IMAGE, NodeCluster
from e2e.node.images import ImageArchive, suite_images
from e2e.node.node import NODE_SETTINGS, Node
from e2e.node.product_image import chart_image_archive, chart_version
from tests.chart import chart_tools
from tests.tools import locate
from tests.tools import programs as located_programs

# Collected only when asked for, as e2e/keda is.
collect_ignore_glob = [] if os.environ.get("GPUSCALER_E2E_NODE") == "1" else ["test_*.py"]

CLUSTER = pytest.StashKey[NodeCluster]()
# Eight: two pods of four GPUs each fit on the node, as a multi-GPU workload needs.
FAKE_GPUS = 8
MEASUREMENTS: list[str] = []


def record(line: str) -> None:
    """A line for the session's summary (replica steps, timings)."""
    MEASUREMENTS.append(line)


@pytest.fixture(scope="session")
def cluster(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeCluster]:
    """The control plane, the node with the suite's images and the gpuscaler image, and the device plugin."""
    host.check()
    started = time.monotonic()
    directory = tmp_path_factory.mktemp("node-cluster")
    programs = located_programs(tools.TOOLS + tools.NODE_TOOLS)
    helm = locate(chart_tools.HELM)
    private = host.PrivateHost(directory / "node")
    problems: list[str] = []
    try:
        private.set_up(nameserver=host.NODE_ADDRESS)
        plane = ControlPlane.start(directory / "control-plane", programs, NODE_SETTINGS)
        try:
            node = Node(plane, directory / "node", programs, private)
            try:
                images: list[ImageArchive] = suite_images(directory / "images")
                node.start(images)
                # The journeys' agent fakes as many (agent.fake.gpus, set in `installed`).
                node.start_device_plugin(FAKE_GPUS)
                world = NodeCluster(plane, node, helm, directory)
                record(f"node cluster: started in {time.monotonic() - started:.1f} s (tools already built)")
                request.config.stash[CLUSTER] = world
                yield world
                del request.config.stash[CLUSTER]
            finally:
                problems += node.stop()
        finally:
            plane.stop()
    finally:
        problems += private.restore()
    assert not problems, "the node suite left things behind:\n- " + "\n- ".join(problems)


@pytest.fixture(scope="session")
def chart_cluster(cluster: NodeCluster) -> NodeCluster:
    """The cluster with the gpuscaler image imported under the name the chart's defaults give it, and the GPU
    node's labels and RuntimeClass; imported once, on first use (``make image`` builds the archive)."""
    archive = chart_image_archive()
    started = time.monotonic()
    cluster.node.import_image(archive, f"{CHART_IMAGE}:{chart_version()}")
    record(f"gpuscaler image: {archive.path} imported in {time.monotonic() - started:.1f} s")
    cluster.node.label(dict([GPU_NODE_LABEL]))
    cluster.apply(RUNTIME_CLASS)
    return cluster


@pytest.fixture(scope="module")
def installed(chart_cluster: NodeCluster) -> Iterator[Release]:
    """The chart as the README installs it, with the documented podResources on, and the fake collector making as
    many GPUs as the device plugin offers (the chart's default is 4); uninstalled after the module."""
    kube = chart_cluster.kube
    document = namespace(NAMESPACE)
    document["metadata"]["labels"] = {"pod-security.kubernetes.io/enforce": "privileged"}
    kube.apply(document)
    release = install(chart_cluster, sets={"agent.podResources.enabled": "true", "agent.fake.gpus": str(FAKE_GPUS)})
    try:
        release.wait_ready()
        yield release
    finally:
        release.uninstall()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """Adds the control plane's and node's log tails to a failed test's report."""
    report = yield
    world = item.config.stash.get(CLUSTER, None)
    if report.failed and world is not None:
        report.sections.append(("control plane and node logs (tails)", world.plane.tails()))
    return report


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Prints what the journeys measured."""
    if MEASUREMENTS:
        terminalreporter.section("node e2e measurements")
        for line in MEASUREMENTS:
            terminalreporter.write_line(line)
