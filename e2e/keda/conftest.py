"""Fixtures for the KEDA suite: one control plane per session, one namespace and set of processes per test.

A failed test's report carries the tail of every control-plane log (the full logs stay in pytest's tmp folder), and
the session ends with the measured numbers: push latency from ``gpuscaler fake set`` to ``spec.replicas == 1``, and
the replica steps each scenario saw.
"""

from __future__ import annotations

import re
import secrets
import time
from collections.abc import AsyncIterator, Generator, Iterator
from pathlib import Path

import pytest

from e2e.keda.control_plane import ControlPlane, namespace, running
from e2e.keda.scenario import Measurements, Scenario

PLANE = pytest.StashKey[ControlPlane]()
MEASUREMENTS = Measurements()


@pytest.fixture(scope="session")
def control_plane(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    """etcd, kube-apiserver, kube-controller-manager and KEDA on loopback, for the whole session."""
    started = time.monotonic()
    with running(tmp_path_factory.mktemp("control-plane")) as plane:
        MEASUREMENTS.add("control plane", f"started in {time.monotonic() - started:.1f} s (tools already built)")
        request.config.stash[PLANE] = plane
        yield plane
        del request.config.stash[PLANE]


@pytest.fixture
async def scenario(
    request: pytest.FixtureRequest, control_plane: ControlPlane, tmp_path: Path
) -> AsyncIterator[Scenario]:
    """A fresh namespace for this test; its ScaledObjects are deleted and its processes stopped at the end."""
    base = re.sub(r"[^a-z0-9]+", "-", request.node.name.lower()).strip("-")[:50].strip("-")
    name = f"{base}-{secrets.token_hex(2)}"
    control_plane.check_alive()
    world = Scenario(control_plane, name, tmp_path, MEASUREMENTS, request.node.name)
    await world.apply(namespace(name))
    yield world
    await world.close()
    # A control-plane process that died during the test fails it here, with its log.
    control_plane.check_alive()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """Adds the control plane's log tails to a failed test's report."""
    report = yield
    plane = item.config.stash.get(PLANE, None)
    if report.failed and plane is not None:
        report.sections.append(("control plane logs (tails)", plane.tails()))
    return report


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Prints what the scenarios measured."""
    if MEASUREMENTS.lines:
        terminalreporter.section("KEDA e2e measurements")
        for line in MEASUREMENTS.lines:
            terminalreporter.write_line(line)
