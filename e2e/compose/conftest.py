"""Fixtures for the compose suite: the private podman with the image `make image` built, and compose.yaml's stack
up on it, once per session.

Collected only under ``make e2e-compose`` (GPUSCALER_E2E_COMPOSE=1, set by ``python -m e2e.compose``, which runs
pytest in network and mount namespaces of its own): ignored, not skipped, otherwise. Once collected it never skips.
At the end the session fails if anything it made is left: containers, volumes, networks, iptables chains, cgroups,
mounts, mount points, processes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Generator, Iterator
from pathlib import Path

import pytest

from e2e.compose.podman import PrivatePodman, other_processes_in_this_network_namespace
from e2e.compose.project import Project, free_ports, published_ports
from e2e.compose.tools import COMPOSE
from e2e.support.namespaces import left
from image.build import archive_path, host_architecture, project_version
from tests.tools import locate

collect_ignore_glob = [] if os.environ.get("GPUSCALER_E2E_COMPOSE") == "1" else ["test_*.py"]

# Set by ``python -m e2e.compose``: the unpacked Debian packages, and the namespaces it ran in before entering
# private ones.
PACKAGES_VARIABLE = "GPUSCALER_E2E_COMPOSE_PODMAN"
HOST_NAMESPACES_VARIABLE = "GPUSCALER_E2E_COMPOSE_HOST_NAMESPACES"
BIN = Path(sys.executable).parent
PROJECT = pytest.StashKey[Project]()
PODMAN = pytest.StashKey[PrivatePodman]()
MEASUREMENTS: list[str] = []


def gpus_per_node(address: str) -> Counter[str]:
    """GPUs per node in what `gpuscaler query` gets at ``address``; none while nothing answers there."""
    command = [str(BIN / "gpuscaler"), "query", "--address", address, "--output", "json", "profile=batch"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60)
    gpus = json.loads(result.stdout)["explanation"]["gpus"] if result.returncode == 0 else []
    return Counter(gpu["node"] for gpu in gpus)


@pytest.fixture(scope="session")
def podman(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrivatePodman]:
    """podman's API socket with the image `make image` built loaded; at the end everything removed."""
    outer = os.environ.get(HOST_NAMESPACES_VARIABLE, "")
    if not left(outer) or os.geteuid() != 0:
        pytest.fail(
            "run `make e2e-compose` (python -m e2e.compose): as root, in network and mount namespaces of its own"
        )
    archive = archive_path(project_version(), host_architecture())
    engine = PrivatePodman(Path(os.environ[PACKAGES_VARIABLE]), tmp_path_factory.mktemp("podman"))
    engine.write_config()
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)  # a new network namespace's loopback is down
    problems: list[str] = []
    try:
        engine.shadow()
        started = time.monotonic()
        engine.start()
        MEASUREMENTS.append(f"podman system service answered in {time.monotonic() - started:.1f} s")
        started = time.monotonic()
        engine.podman("load", "--input", str(archive))
        MEASUREMENTS.append(f"{archive.name} loaded in {time.monotonic() - started:.1f} s")
        request.config.stash[PODMAN] = engine
        yield engine
        del request.config.stash[PODMAN]
    finally:
        problems += engine.stop()
        problems += engine.unshadow()
        problems += [f"still running: {line}" for line in other_processes_in_this_network_namespace()]
    assert not problems, "the compose suite left things behind:\n- " + "\n- ".join(problems)


@pytest.fixture(scope="session")
def stack(
    request: pytest.FixtureRequest, podman: PrivatePodman, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Project]:
    """``docker compose up -d`` of compose.yaml with every port moved to a free one, once the gateway answers for
    every agent's GPUs; ``docker compose down -v`` at the end, which must leave nothing of the project."""
    ports = published_ports()
    project = Project(
        compose=locate(COMPOSE) / "docker-compose",
        docker_host=podman.docker_host,
        name="gpuscaler-e2e",
        moved=dict(zip(ports, free_ports(len(ports)), strict=True)),
        config=tmp_path_factory.mktemp("docker-config"),
    )
    started = time.monotonic()
    project.check("up", "--detach")
    MEASUREMENTS.append(f"docker compose up -d returned in {time.monotonic() - started:.1f} s")
    request.config.stash[PROJECT] = project
    try:
        gateway = project.address("gateway", "grpc")
        deadline = time.monotonic() + 90
        while (got := gpus_per_node(gateway)) != EXPECTED_GPUS:
            assert time.monotonic() < deadline, f"the gateway at {gateway} gives {dict(got)}, not {EXPECTED_GPUS}"
            time.sleep(0.2)
        MEASUREMENTS.append(f"the gateway answered for all 14 GPUs {time.monotonic() - started:.1f} s after `up`")
        yield project
    finally:
        started = time.monotonic()
        project.check("down", "--volumes", "--timeout", "20")
        MEASUREMENTS.append(f"docker compose down -v took {time.monotonic() - started:.1f} s")
        del request.config.stash[PROJECT]
    left = [
        f"{kind}: {output.strip()}"
        for kind in ("container", "volume", "network")
        if (
            output := podman.podman(
                kind, "ls", "--quiet", "--filter", f"label=com.docker.compose.project={project.name}"
            )
        ).strip()
    ]
    assert not left, f"`docker compose down -v` left {left}"


# GPUs per node as compose.yaml's agents make them (--fake-gpus).
EXPECTED_GPUS = Counter({"gpu-node-a": 8, "gpu-node-b": 2, "gpu-node-c": 4})


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """Adds the stack's logs and the podman service's to a failed test's report."""
    report = yield
    project = item.config.stash.get(PROJECT, None)
    engine = item.config.stash.get(PODMAN, None)
    if report.failed and project is not None:
        report.sections.append(("docker compose logs (tail)", "\n".join(project.logs().splitlines()[-80:])))
    if report.failed and engine is not None:
        report.sections.append(("podman system service log (tail)", engine.log_tail()))
    return report


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """The measured times, for CONTRIBUTING.md's numbers."""
    if MEASUREMENTS:
        terminalreporter.section("compose e2e measurements")
        for line in MEASUREMENTS:
            terminalreporter.write_line(line)
