"""The agent's series of its kubelet PodResources reads, up and last good, and the devices it could not place."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from grpclib.const import Status

from gpuscaler.agent.attribution.podresources import PodResourcesWatcher
from gpuscaler.agent.history import History
from gpuscaler.agent.telemetry import AgentTelemetry
from tests.builders import gpu_sample
from tests.fakes.fake_kubelet import Assignment, DraAssignment, FakeKubelet, short_socket_path

UP = "gpuscaler_attribution_up"
LAST_SUCCESS = "gpuscaler_attribution_last_success_timestamp_seconds"
UNPLACED = "gpuscaler_attribution_unplaced_devices"


@pytest.fixture
async def kubelet() -> AsyncIterator[FakeKubelet]:
    """A fake kubelet serving on a fresh unix socket."""
    fake = await FakeKubelet(short_socket_path()).start()
    yield fake
    await fake.stop()


def telemetry() -> AgentTelemetry:
    """An agent's registry over an empty history."""
    return AgentTelemetry(History(history_seconds=60, poll_interval_seconds=0.5))


async def test_a_failing_kubelet_read_is_down_and_keeps_its_last_success_time(kubelet: FakeKubelet) -> None:
    """A good read is up at its wall-clock time; a failed one is down, still showing when the last good one was."""
    clock = iter([1_700_000_000.0, 1_700_000_090.0])
    watcher = PodResourcesWatcher(kubelet.socket_path, wall_clock=lambda: next(clock))
    series = telemetry()
    series.watch_attribution(watcher)
    registry = series.registry
    assert (registry.get_sample_value(UP), registry.get_sample_value(LAST_SUCCESS)) == (None, None)  # not read yet

    kubelet.assign([Assignment("ml", "a", ("GPU-fake-n-0",))])
    await watcher.refresh()
    assert (registry.get_sample_value(UP), registry.get_sample_value(LAST_SUCCESS)) == (1.0, 1_700_000_000.0)

    kubelet.failure = Status.INTERNAL
    await watcher.refresh()  # within the staleness bound: the assignment is kept, the read still failed
    assert (registry.get_sample_value(UP), registry.get_sample_value(LAST_SUCCESS)) == (0.0, 1_700_000_000.0)

    kubelet.failure = None
    await watcher.refresh()
    assert (registry.get_sample_value(UP), registry.get_sample_value(LAST_SUCCESS)) == (1.0, 1_700_000_090.0)
    watcher.close()


async def test_no_socket_is_down_with_no_last_success() -> None:
    """A missing kubelet socket is a failed read (the mount is missing): down, and no last-success series, never 0."""
    watcher = PodResourcesWatcher(short_socket_path())
    series = telemetry()
    series.watch_attribution(watcher)
    await watcher.refresh()
    assert series.registry.get_sample_value(UP) == 0.0
    assert series.registry.get_sample_value(LAST_SUCCESS) is None


def test_attribution_turned_off_exports_neither_series() -> None:
    """An agent without a PodResources reader (``--pod-resources-socket ''``) has no attribution series at all."""
    names = {family.name for family in telemetry().registry.collect()}
    assert not {UP, LAST_SUCCESS} & names
    assert "gpuscaler_sample_age_seconds" in names  # the registry does export the agent's other series


async def test_unplaced_devices_are_counted_by_kind_once_placing_has_run(kubelet: FakeKubelet) -> None:
    """The devices the last tick could not place count by kind; before any placement there is no series, never 0."""
    watcher = PodResourcesWatcher(kubelet.socket_path)
    series = telemetry()
    series.watch_attribution(watcher)
    registry = series.registry
    assert registry.get_sample_value(UNPLACED, {"kind": "other"}) is None

    kubelet.assign(
        [
            Assignment("ml", "a", ("GPU-fake-n-0",)),
            Assignment("ml", "b", ("GPU-elsewhere",)),
            DraAssignment("vm", "guest", (("gpu.nvidia.com", "gpu-vfio-0"),)),
        ]
    )
    await watcher.refresh()
    watcher.attribute([gpu_sample(0, node="n", uuid="GPU-fake-n-0")])

    assert registry.get_sample_value(UNPLACED, {"kind": "other"}) == 1.0
    assert registry.get_sample_value(UNPLACED, {"kind": "not_supported"}) == 1.0
    kubelet.assign([Assignment("ml", "a", ("GPU-fake-n-0",))])
    await watcher.refresh()
    watcher.attribute([gpu_sample(0, node="n", uuid="GPU-fake-n-0")])
    assert registry.get_sample_value(UNPLACED, {"kind": "other"}) == 0.0
    watcher.close()
