"""The agent reads the kubelet's PodResources over a unix socket (a real gRPC fake kubelet) and tags samples."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from grpclib.const import Status

from gpuscaler.agent.attribution.podresources import PodResourcesWatcher
from gpuscaler.model.samples import AttributionState, GpuIdentity, GpuSample, PodRef, ReadErrorKind
from tests.fakes.fake_kubelet import Assignment, DraAssignment, FakeKubelet, short_socket_path


def samples(count: int = 3, *, minors: list[int] | None = None) -> list[GpuSample]:
    """``count`` untagged samples of node n, with the UUIDs the fake kubelet's assignments name (minor = index
    unless ``minors`` says otherwise)."""
    numbers = minors if minors is not None else list(range(count))
    return [GpuSample(GpuIdentity(i, f"GPU-fake-n-{i}", "Fake GPU", minor=numbers[i]), "n") for i in range(count)]


@pytest.fixture
async def kubelet() -> AsyncIterator[FakeKubelet]:
    """A fake kubelet serving on a fresh unix socket."""
    fake = await FakeKubelet(short_socket_path()).start()
    yield fake
    await fake.stop()


async def test_list_tags_each_gpu_with_the_containers_holding_it(kubelet: FakeKubelet) -> None:
    """UUID, shared and DRA assignments all land on the right GPU; other resources are ignored."""
    kubelet.assign(
        [
            Assignment("ml", "trainer-0", ("GPU-fake-n-0",)),
            Assignment("ml", "infer-0", ("GPU-fake-n-1::0",), container="server"),
            Assignment("ml", "infer-1", ("GPU-fake-n-1::1",)),
            Assignment("ml", "fpga", ("GPU-fake-n-2",), resource_name="example.com/fpga"),
            DraAssignment("batch", "job-0", (("gpu.nvidia.com", "gpu-2"), ("other.example.com", "gpu-0"))),
        ]
    )
    watcher = PodResourcesWatcher(kubelet.socket_path)
    state = await watcher.refresh()
    assert state.state is AttributionState.OK

    tagged, attribution = watcher.attribute(samples())
    assert attribution.state is AttributionState.OK
    assert [sample.pods for sample in tagged] == [
        (PodRef("ml", "trainer-0", "main"),),
        (PodRef("ml", "infer-0", "server"), PodRef("ml", "infer-1", "main")),
        (PodRef("batch", "job-0", "main"),),
    ]
    watcher.close()


async def test_dra_devices_land_by_minor_number_and_unplaced_ones_are_listed(kubelet: FakeKubelet) -> None:
    """gpu-<minor> lands on the GPU with that minor number; a name no GPU carries is in the tick's attribution."""
    kubelet.assign(
        [
            DraAssignment("ml", "infer-0", (("gpu.nvidia.com", "gpu-0"),)),
            DraAssignment("ml", "infer-1", (("gpu.nvidia.com", "gpu-0-mig-1g10gb-19-0"), ("gpu.nvidia.com", "gpu-1"))),
            DraAssignment("vm", "guest-0", (("gpu.nvidia.com", "gpu-vfio-0"),)),
            DraAssignment("ml", "other", (("gpu.example.com", "gpu-1"),)),
        ]
    )
    watcher = PodResourcesWatcher(kubelet.socket_path)
    await watcher.refresh()

    tagged, attribution = watcher.attribute(samples(2, minors=[1, 0]))

    assert attribution.state is AttributionState.OK
    assert [sample.pods for sample in tagged] == [
        (PodRef("ml", "infer-1", "main"),),
        (PodRef("ml", "infer-0", "main"),),
    ]
    assert [(u.pod.pod, u.device, u.kind) for u in attribution.unplaced] == [
        ("infer-1", "gpu.nvidia.com device 'gpu-0-mig-1g10gb-19-0'", ReadErrorKind.OTHER),
        ("guest-0", "gpu.nvidia.com device 'gpu-vfio-0'", ReadErrorKind.NOT_SUPPORTED),
    ]
    assert watcher.state.unplaced == ()  # the kubelet's state is the read's; what is unplaced is per tick
    watcher.close()


async def test_dra_drivers_listed_are_read(kubelet: FakeKubelet) -> None:
    """A second vendor's driver is read when --dra-drivers lists it, with no code of its own."""
    kubelet.assign([DraAssignment("ml", "other", (("gpu.example.com", "gpu-1"),))])
    watcher = PodResourcesWatcher(kubelet.socket_path, dra_drivers=("gpu.nvidia.com", "gpu.example.com"))
    await watcher.refresh()

    tagged, _ = watcher.attribute(samples(2))

    assert [sample.pods for sample in tagged] == [(), (PodRef("ml", "other", "main"),)]
    watcher.close()


async def test_no_socket_is_off_and_says_where_it_looked() -> None:
    """Without a socket at the path, the state is OFF, naming the path and the fix, and samples carry no pods."""
    path = short_socket_path()
    watcher = PodResourcesWatcher(path)
    state = await watcher.refresh()
    assert state.state is AttributionState.OFF
    assert str(path) in state.detail
    assert "--pod-resources-socket" in state.detail
    tagged, _ = watcher.attribute(samples(1))
    assert tagged[0].pods == ()


async def test_a_failing_kubelet_keeps_the_last_assignment_then_turns_unavailable(kubelet: FakeKubelet) -> None:
    """A failed List keeps the last good assignment within the staleness bound, then reports UNAVAILABLE."""
    kubelet.assign([Assignment("ml", "a", ("GPU-fake-n-0",))])
    watcher = PodResourcesWatcher(kubelet.socket_path, interval_seconds=0.1)
    await watcher.refresh()
    kubelet.failure = Status.INTERNAL

    still = await watcher.refresh()
    assert still.state is AttributionState.OK
    assert watcher.attribute(samples(1))[0][0].pods == (PodRef("ml", "a", "main"),)

    watcher.stale_after_seconds = 0.0  # the bound has passed
    gone = await watcher.refresh()
    assert gone.state is AttributionState.UNAVAILABLE
    assert "INTERNAL" in gone.detail
    assert watcher.attribute(samples(1))[0][0].pods == ()

    kubelet.failure = None
    assert (await watcher.refresh()).state is AttributionState.OK
    watcher.close()


async def test_assignments_follow_the_kubelet(kubelet: FakeKubelet) -> None:
    """A pod that the kubelet no longer lists leaves the GPU at the next refresh."""
    kubelet.assign([Assignment("ml", "a", ("GPU-fake-n-0",))])
    watcher = PodResourcesWatcher(kubelet.socket_path)
    await watcher.refresh()
    kubelet.assign([Assignment("ml", "b", ("nvidia0",))])
    await watcher.refresh()
    assert watcher.attribute(samples(1))[0][0].pods == (PodRef("ml", "b", "main"),)
    watcher.close()


async def test_a_change_of_gpus_asks_for_a_refresh(kubelet: FakeKubelet) -> None:
    """When the set of GPUs changes, the watcher reads the kubelet again without waiting for its interval."""
    watcher = PodResourcesWatcher(kubelet.socket_path, interval_seconds=60)
    await watcher.refresh()
    watcher.attribute(samples(2))
    assert watcher._wake.is_set()
    watcher._wake.clear()
    watcher.attribute(samples(2))
    assert not watcher._wake.is_set()
    watcher.attribute(samples(3))
    assert watcher._wake.is_set()
    watcher.close()
