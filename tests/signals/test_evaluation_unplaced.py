"""Pod queries over devices a node could not tie to a GPU: unknown shares, never left out; a VM's GPU, left out."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace

import pytest

from gpuscaler.agent.attribution.devices import VFIO_DETAIL
from gpuscaler.agent.attribution.podresources import PodResourcesWatcher
from gpuscaler.agent.collectors.nvml import NvmlCollector
from gpuscaler.model.errors import Unavailable, Unsupported
from gpuscaler.model.pods import PodInfo
from gpuscaler.model.samples import Attribution, AttributionState, PodRef, ReadErrorKind, Snapshot, UnplacedDevice
from gpuscaler.query.metadata import Limits, parse_metadata
from gpuscaler.signals.evaluation import evaluate
from gpuscaler.signals.outcome import Evaluation
from tests.builders import cluster, gpu_sample, gpu_trigger, silent, snapshot, source_of
from tests.fakes.fake_kubelet import DraAssignment, FakeKubelet, short_socket_path
from tests.fakes.fake_nvml import FakeDevice, FakeNvml
from tests.signals.test_evaluation_workloads import Directory

GPU9 = "gpu.nvidia.com device 'gpu-9'"
VFIO = "gpu.nvidia.com device 'gpu-vfio-0'"
DIRECTORY = Directory(
    *(PodInfo("ml", name, {}, "trainer", "Deployment") for name in ("trainer-a", "trainer-b", "trainer-c")),
    PodInfo("vm", "guest", {}, "guest", "VirtualMachineInstance"),
)


def unplaced(
    name: str, device: str, kind: ReadErrorKind = ReadErrorKind.OTHER, namespace: str = "ml"
) -> UnplacedDevice:
    """Pod ``name``'s main container holding ``device``, which no GPU carries."""
    detail = VFIO_DETAIL if kind is ReadErrorKind.NOT_SUPPORTED else "no whole GPU on this node has minor number 9"
    return UnplacedDevice(PodRef(namespace, name, "main"), device, kind, detail)


def node(name: str, gpus: tuple[tuple[float, str], ...], *devices: UnplacedDevice) -> Snapshot:
    """Node ``name``: one GPU per (utilisation, pod holding it), and ``devices`` its attribution could not place."""
    samples = tuple(
        gpu_sample(i, util=util, pods=(PodRef("ml", holder, "main"),), node=name, uuid=f"GPU-{name}-{i}")
        for i, (util, holder) in enumerate(gpus)
    )
    return replace(snapshot(1, 0.0, samples, node=name), attribution=Attribution(AttributionState.OK, "", devices))


def run(view: Snapshot, **metadata: str) -> Evaluation:
    """The gateway's evaluation of a workload query (``metadata``) from a ScaledObject in ml over ``view``."""
    query = gpu_trigger(parse_metadata(metadata, Limits(history_seconds=600), namespace="ml"))
    return evaluate(query.value, source_of(view), now=0.0, stale_after=5.0, directory=DIRECTORY)


def test_an_unplaced_device_beside_readable_gpus_is_unavailable_naming_pod_and_device() -> None:
    """A replica's unplaced device counts as an unreadable GPU: beyond maxUnreadable, UNAVAILABLE naming it."""
    view = cluster(node("node-a", ((40.0, "trainer-a"), (30.0, "trainer-b")), unplaced("trainer-b", GPU9)))

    strict = run(view, workload="trainer")

    assert isinstance(strict.error, Unavailable)
    assert "cannot be read on 1 of the 3 selected GPUs" in strict.error.message
    assert f"unplaced {GPU9}" in strict.error.message
    assert "pod ml/trainer-b holds it, and no GPU on 'node-a' does" in strict.error.message
    tolerant = run(view, workload="trainer", maxUnreadable="1")
    assert tolerant.value == pytest.approx(40.0 + 30.0)  # trainer-b: avg of its one readable GPU


def test_a_silent_node_whose_pod_held_only_an_unplaced_device_keeps_the_answer_unavailable() -> None:
    """The node last sent a replica's unplaced device, then went quiet: unknown still, not the other replica's 40."""
    view = cluster(
        node("node-a", ((40.0, "trainer-a"),)),
        absent=[silent(node("node-b", (), unplaced("trainer-c", GPU9)))],
    )

    evaluation = run(view, workload="trainer")

    assert isinstance(evaluation.error, Unavailable), (evaluation.value, evaluation.error)
    assert "node 'node-b'" in evaluation.error.message
    assert "ml/trainer-c" in evaluation.error.message


def test_a_replica_holding_only_an_unplaced_device_leaves_its_node_unknown() -> None:
    """A pod whose only device is unplaced is unknown, not a replica at 0: its node is as if not heard."""
    view = cluster(
        node("node-a", ((40.0, "trainer-a"),)),
        node("node-b", (), unplaced("trainer-c", GPU9)),
    )

    blocked = run(view, workload="trainer")

    assert isinstance(blocked.error, Unavailable)
    assert "node 'node-b' is heard, but none of its 1 selected GPU(s) can be read" in blocked.error.message
    assert GPU9 in blocked.error.message
    assert "it holds ml/trainer-c" in blocked.error.message
    assert run(view, workload="trainer", minNodes="1").value == pytest.approx(40.0)


def test_a_gpu_passed_through_to_a_vm_is_left_out_never_unknown() -> None:
    """A vfio GPU is outside NVML's view: a VM workload is Unsupported (for ever is not UNAVAILABLE); beside
    others it is left out like a GPU without the metric."""
    guest = unplaced("guest", VFIO, ReadErrorKind.NOT_SUPPORTED, namespace="vm")
    view = cluster(
        node("node-a", ((40.0, "trainer-a"),), guest, unplaced("trainer-a", VFIO, ReadErrorKind.NOT_SUPPORTED))
    )

    vm = evaluate(
        gpu_trigger(parse_metadata({"workload": "guest"}, Limits(history_seconds=600), namespace="vm")).value,
        source_of(view),
        now=0.0,
        stale_after=5.0,
        directory=DIRECTORY,
    )
    assert isinstance(vm.error, Unsupported)
    assert f"unplaced {VFIO}" in vm.error.message
    assert "measured inside the guest" in vm.error.message
    assert run(view, workload="trainer").value == pytest.approx(40.0)


def test_on_an_agent_a_pod_query_over_an_unplaced_device_is_unavailable() -> None:
    """An agent's own answer for a pod whose device it could not place is UNAVAILABLE naming the device."""
    alone = node("node-a", ((40.0, "trainer-a"),), unplaced("trainer-b", GPU9))
    query = gpu_trigger(parse_metadata({"pod": "trainer-b"}, Limits(history_seconds=600), namespace="ml"))

    evaluation = evaluate(query.value, source_of(alone), now=0.0, stale_after=5.0)

    assert isinstance(evaluation.error, Unavailable)
    assert GPU9 in evaluation.error.message


@pytest.fixture
async def kubelet() -> AsyncIterator[FakeKubelet]:
    """A fake kubelet serving on a fresh unix socket."""
    fake = await FakeKubelet(short_socket_path()).start()
    yield fake
    await fake.stop()


async def test_a_workload_over_a_dra_device_no_gpu_carries_is_unavailable_naming_it(kubelet: FakeKubelet) -> None:
    """From fake NVML and the kubelet's List through placement to the workload answer: gpu-<minor> lands on the
    GPU with that minor number (not the index), and a MIG device no instance carries makes the answer UNAVAILABLE,
    naming the pod and the device, where leaving it out would give a smaller sum."""
    collector = NvmlCollector(
        node="node-a", nvml=FakeNvml([FakeDevice("GPU-i0", minor=1), FakeDevice("GPU-i1", minor=0)])
    )
    collector.open()
    kubelet.assign(
        [
            DraAssignment("ml", "trainer-a", (("gpu.nvidia.com", "gpu-0"),)),
            DraAssignment(
                "ml", "trainer-b", (("gpu.nvidia.com", "gpu-1"), ("gpu.nvidia.com", "gpu-1-mig-1g10gb-19-0"))
            ),
        ]
    )
    watcher = PodResourcesWatcher(kubelet.socket_path)
    await watcher.refresh()
    samples = [
        gpu_sample(gpu.index, util=util, node="node-a", uuid=gpu.uuid)._replace(gpu=gpu)
        for gpu, util in zip(collector.discover(), (10.0, 70.0), strict=True)
    ]
    tagged, attribution = watcher.attribute(samples)
    watcher.close()
    view = cluster(replace(snapshot(1, 0.0, tagged, node="node-a"), attribution=attribution))

    assert [(s.gpu.uuid, [p.pod for p in s.pods]) for s in tagged] == [
        ("GPU-i0", ["trainer-b"]),
        ("GPU-i1", ["trainer-a"]),
    ]
    failed = run(view, workload="trainer")
    assert isinstance(failed.error, Unavailable)
    assert "unplaced gpu.nvidia.com device 'gpu-1-mig-1g10gb-19-0'" in failed.error.message
    assert "pod ml/trainer-b holds it" in failed.error.message
    assert run(view, workload="trainer", maxUnreadable="1").value == pytest.approx(70.0 + 10.0)
