"""The poll loop enumerates the devices again soon after a name the attribution could not place, at most so often."""

from __future__ import annotations

from collections.abc import Sequence

from gpuscaler.agent.attribution.devices import Assignment, dra_name, place
from gpuscaler.agent.collectors.nvml import NvmlCollector
from gpuscaler.agent.history import History
from gpuscaler.agent.poller import REDISCOVER_SOON_SECONDS, Poller
from gpuscaler.model.samples import Attribution, AttributionState, GpuIdentity, GpuSample, PodRef
from tests.fakes.fake_nvml import FakeDevice, FakeNvml

POD = PodRef("ml", "infer-0", "main")


class Clock:
    """A monotonic clock a test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Placing:
    """Places fixed DRA device names on each tick's GPUs, as the pod-resources watcher does."""

    def __init__(self, *names: str) -> None:
        self.assignments = []
        for name in names:
            named = dra_name("gpu.nvidia.com", name)
            assert named is not None
            self.assignments.append(Assignment(POD, "gpu.nvidia.com", name, named))
        self.awaiting = False
        self.last: dict[str, tuple[PodRef, ...]] = {}

    def attribute(self, samples: Sequence[GpuSample]) -> tuple[tuple[GpuSample, ...], Attribution]:
        placed = place([sample.gpu for sample in samples], self.assignments)
        self.awaiting, self.last = placed.awaiting, dict(placed.pods)
        return tuple(samples), Attribution(AttributionState.OK, "", placed.unplaced)

    def awaiting_devices(self) -> bool:
        return self.awaiting


def mig(uuid: str, gpu_instance_id: int, profile_id: int, start: int) -> FakeDevice:
    """A MIG instance with that GPU instance, profile id and placement start."""
    return FakeDevice(uuid, gpu_instance_id=gpu_instance_id, gi_profile_id=profile_id, placement_start=start)


class Counting(NvmlCollector):
    """The NVML collector, counting its enumerations."""

    enumerations = 0

    def discover(self) -> Sequence[GpuIdentity]:
        self.enumerations += 1
        return super().discover()


async def started(nvml: FakeNvml, attributor: Placing, clock: Clock) -> tuple[Poller, Counting]:
    """A started poller over ``nvml`` that ``attributor`` attributes and ``clock`` times, and its collector."""
    collector = Counting(node="n", nvml=nvml)
    collector.open()
    poller = Poller(
        collector,
        History(history_seconds=60, poll_interval_seconds=0.5),
        poll_interval_seconds=0.5,
        attributor=attributor,
        clock=clock,
    )
    await poller.start()
    return poller, collector


async def test_a_mig_instance_made_for_a_pod_is_placed_after_one_rediscovery_tick() -> None:
    """A DRA driver makes the pod's MIG instance after the agent enumerated: one tick later the name is placed."""
    nvml = FakeNvml([FakeDevice("GPU-p", minor=2, mig_instances=[mig("MIG-old", 1, 19, 0), None])])
    attributor = Placing("gpu-2-mig-1g10gb-15-4")
    clock = Clock()
    poller, collector = await started(nvml, attributor, clock)
    assert collector.enumerations == 1
    nvml.create_mig(0, mig("MIG-new", 7, 15, 4))
    clock.now += REDISCOVER_SOON_SECONDS

    unplaced = await poller.tick()
    assert [u.device for u in unplaced.attribution.unplaced] == ["gpu.nvidia.com device 'gpu-2-mig-1g10gb-15-4'"]
    placed = await poller.tick()

    assert placed.attribution.unplaced == ()
    assert collector.enumerations == 2
    assert attributor.last == {"MIG-new": (POD,)}


async def test_names_that_never_place_enumerate_at_most_once_per_interval() -> None:
    """Names no device will carry enumerate the devices once per REDISCOVER_SOON_SECONDS, not every tick."""
    nvml = FakeNvml([FakeDevice("GPU-a", minor=0)])
    attributor = Placing(*(f"gpu-{minor}" for minor in range(1, 20)))
    clock = Clock()
    poller, collector = await started(nvml, attributor, clock)
    assert collector.enumerations == 1

    for _ in range(41):  # ticks every 0.25 s, at 0 s to 10 s after the first enumeration
        await poller.tick()
        clock.now += 0.25

    assert collector.enumerations == 1 + int(10 / REDISCOVER_SOON_SECONDS)
