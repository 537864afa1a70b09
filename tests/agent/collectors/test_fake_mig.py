"""FakeCollector in MIG mode: a scenario's `mig` instances are enumerated, read and set as NVML's would be."""

from __future__ import annotations

import asyncio
import textwrap
from typing import Any

import pytest
import yaml

from gpuscaler.agent.attribution.devices import Assignment, dra_name, place
from gpuscaler.agent.collectors import scenario as scenario_module
from gpuscaler.agent.collectors.fake import Failure, FakeCollector
from gpuscaler.agent.collectors.scenario import parse_scenario
from gpuscaler.agent.process import Agent
from gpuscaler.cli import main
from gpuscaler.model.errors import ConfigError
from gpuscaler.model.gpu_metrics import Metric
from gpuscaler.model.samples import DEVICE_FIELD, GpuIdentity, GpuSample, PodRef, ReadErrorKind
from tests.conftest import serve_settings
from tests.server.test_external_scaler import next_tick

GIB = 1024**3
POD = PodRef("ml", "infer-0", "main")
# Four GPUs: 0 and 3 whole, 1 and 2 in MIG mode (so minors, counted down from the last index, are 2 and 1).
SCENARIO: dict[str, Any] = {
    "defaults": {"values": {"gpu_utilization": 5, "power_draw": 300}},
    "gpus": {
        1: {
            "values": {"temperature": 61, "gpu_utilization": 90},
            "mig": [
                {
                    "profile": "1g.10gb",
                    "profile_id": 19,
                    "placement_start": 0,
                    "values": {"gpu_utilization": 40, "memory_used_percent": 50, "sm_active": 30},
                },
                {"profile": "3g.40gb", "profile_id": 9, "placement_start": 4, "gpu_instance_id": 5},
            ],
        },
        2: {
            "mig": [
                {"profile": "1g.10gb+me", "profile_id": 20, "placement_start": 6, "uuid": "MIG-set-by-scenario"},
            ],
        },
    },
}


@pytest.fixture
def collector() -> FakeCollector:
    """Four fake GPUs on node-a, two of them in MIG mode."""
    return FakeCollector(node="node-a", gpu_count=4, scenario=parse_scenario(SCENARIO, gpu_count=4))


def device(collector: FakeCollector, uuid: str) -> GpuIdentity:
    """The enumerated device with ``uuid``."""
    return next(gpu for gpu in collector.discover() if gpu.uuid == uuid)


def second_read(collector: FakeCollector, uuid: str) -> GpuSample:
    """A read of ``uuid`` after a first one, once GPM has two samples, as from the poll loop's second tick."""
    gpu = device(collector, uuid)
    collector.read(gpu)
    return collector.read(gpu)


def errors_by_field(sample: GpuSample) -> dict[str, ReadErrorKind]:
    """Each field the sample has an error for, with its kind."""
    return {error.field: error.kind for error in sample.errors}


def test_mig_gpus_are_enumerated_as_their_instances(collector: FakeCollector) -> None:
    """A GPU with `mig` is listed as its instances in its place, with its index, minor and each one's placement."""
    found = [
        (
            gpu.index,
            gpu.uuid,
            gpu.name,
            gpu.mig_parent_uuid,
            gpu.minor,
            gpu.gpu_instance_id,
            gpu.gpu_instance_profile_id,
            gpu.placement_start,
            gpu.mig_slot,
        )
        for gpu in collector.discover()
    ]
    assert found == [
        (0, "GPU-fake-node-a-0", "Fake GPU", None, 3, None, None, None, None),
        (1, "MIG-fake-node-a-1-0", "Fake GPU MIG 1g.10gb", "GPU-fake-node-a-1", 2, 1, 19, 0, 0),
        (1, "MIG-fake-node-a-1-1", "Fake GPU MIG 3g.40gb", "GPU-fake-node-a-1", 2, 5, 9, 4, 1),
        (2, "MIG-set-by-scenario", "Fake GPU MIG 1g.10gb+me", "GPU-fake-node-a-2", 1, 1, 20, 6, 0),
        (3, "GPU-fake-node-a-3", "Fake GPU", None, 0, None, None, None, None),
    ]


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("gpu-2-mig-1g10gb-19-0", "MIG-fake-node-a-1-0"),
        ("gpu-2-mig-3g40gb-9-4", "MIG-fake-node-a-1-1"),
        ("gpu-1-mig-1g10gb-me-20-6", "MIG-set-by-scenario"),
        ("gpu-3", "GPU-fake-node-a-0"),
        ("gpu-2-mig-1g10gb-19-2", None),  # no instance at that placement
        ("gpu-2", None),  # a GPU in MIG mode is not handed out whole
    ],
)
def test_dra_names_place_on_the_instances(collector: FakeCollector, name: str, expected: str | None) -> None:
    """NVIDIA's DRA driver's names for the fake MIG instances land on them, by parent minor, profile and placement."""
    named = dra_name("gpu.nvidia.com", name)
    assert named is not None
    placed = place(collector.discover(), [Assignment(POD, "gpu.nvidia.com", "claim", named)])
    assert next(iter(placed.pods), None) == expected


def test_an_instance_reads_what_docs_mig_md_says_it_has(collector: FakeCollector) -> None:
    """Its own utilisation, memory and GPM; its GPU's temperature; no power, energy, memory time or traffic."""
    sample = second_read(collector, "MIG-fake-node-a-1-0")
    assert sample.gpu_utilization_percent == 40.0
    assert sample.sm_active_percent == 30.0
    assert sample.memory_total_bytes == 10 * GIB
    assert sample.memory_used_bytes == 5 * GIB
    assert sample.temperature_celsius == 61.0
    absent = (
        "power_draw_watts",
        "power_limit_watts",
        "energy_joules",
        "memory_utilization_percent",
        "pcie_tx_megabytes_per_second",
        "pcie_rx_megabytes_per_second",
        "nvlink_tx_megabytes_per_second",
        "nvlink_rx_megabytes_per_second",
    )
    assert [getattr(sample, name) for name in absent] == [None] * len(absent)
    assert errors_by_field(sample) == dict.fromkeys(absent, ReadErrorKind.NOT_SUPPORTED)
    whole = second_read(collector, "GPU-fake-node-a-0")
    assert (whole.power_draw_watts, whole.errors) == (300.0, ())
    assert whole.energy_joules is not None


def test_an_instance_has_no_utilisation_on_its_first_read(collector: FakeCollector) -> None:
    """An instance's utilisation is GPM's graphics activity, a rate between two samples: absent at first, not 0."""
    sample = collector.read(device(collector, "MIG-fake-node-a-1-0"))
    assert (sample.gpu_utilization_percent, sample.sm_active_percent) == (None, None)
    assert errors_by_field(sample)["gpu_utilization_percent"] is ReadErrorKind.OTHER
    assert sample.memory_used_bytes == 5 * GIB


def test_an_instance_takes_the_defaults_and_its_memory_from_its_profile(collector: FakeCollector) -> None:
    """Unset, an instance's values are the defaults' (then idle); a profile larger than its GPU gets the GPU's."""
    sample = second_read(collector, "MIG-fake-node-a-1-1")
    assert sample.gpu_utilization_percent == 5.0
    assert sample.memory_total_bytes == 40 * GIB
    small = parse_scenario(
        {
            "gpus": {
                0: {
                    "memory_total_bytes": 8 * GIB,
                    "mig": [{"profile": "7g.80gb", "profile_id": 0, "placement_start": 0}],
                }
            }
        },
        gpu_count=1,
    )
    only = FakeCollector(node="n", gpu_count=1, scenario=small)
    assert only.read(only.discover()[0]).memory_total_bytes == 8 * GIB


def test_setting_a_gpu_by_index_sets_its_instances(collector: FakeCollector) -> None:
    """`fake set` with a MIG GPU's index sets each instance's own metrics, and the temperature they share."""
    collector.set_values(1, {Metric.GPU_UTILIZATION: 77.0, Metric.TEMPERATURE: 70.0, Metric.POWER_DRAW: 500.0})
    for uuid in ("MIG-fake-node-a-1-0", "MIG-fake-node-a-1-1"):
        sample = second_read(collector, uuid)
        assert (sample.gpu_utilization_percent, sample.temperature_celsius) == (77.0, 70.0)
        assert sample.power_draw_watts is None
    assert second_read(collector, "MIG-set-by-scenario").gpu_utilization_percent == 5.0
    states = {gpu.uuid: values for gpu, values, _ in collector.state()}
    assert [gpu.uuid for gpu, _, _ in collector.state()] == [gpu.uuid for gpu in collector.discover()]
    assert states["MIG-fake-node-a-1-1"][Metric.GPU_UTILIZATION] == 77.0
    assert states["MIG-fake-node-a-1-1"][Metric.TEMPERATURE] == 70.0
    assert Metric.POWER_DRAW not in states["MIG-fake-node-a-1-1"]


async def test_fake_set_by_a_gpus_index_reaches_its_instances(capsys: pytest.CaptureFixture[str]) -> None:
    """`gpuscaler fake set --gpu 1` on an agent sets GPU 1's MIG instances; the agent's next snapshot reads it."""
    collector = FakeCollector(node="node-a", gpu_count=4, scenario=parse_scenario(SCENARIO, gpu_count=4))
    agent = await Agent.start(serve_settings("--fake-gpus", "4", "--poll-interval", "0.1"), collector)
    try:
        argv = ["fake", "set", "--address", f"127.0.0.1:{agent.port}", "--gpu", "1", "gpu_utilization=66"]
        assert await asyncio.to_thread(main, argv, {}) == 0
        listed = [line.split(" ")[2] for line in capsys.readouterr().out.splitlines()]
        assert listed == [gpu.uuid for gpu in collector.discover()]
        await next_tick(agent)  # a second read since the change: GPM has its two samples
        latest = agent.evaluator.source.latest
        assert latest is not None
        read = {sample.gpu.uuid: sample.gpu_utilization_percent for sample in latest.samples}
        assert read == {
            "GPU-fake-node-a-0": 5.0,
            "MIG-fake-node-a-1-0": 66.0,
            "MIG-fake-node-a-1-1": 66.0,
            "MIG-set-by-scenario": 5.0,
            "GPU-fake-node-a-3": 5.0,
        }
    finally:
        await agent.stop()


def test_failing_a_gpu_by_index_fails_its_instances(collector: FakeCollector) -> None:
    """A lost MIG GPU loses every instance; heal brings them back; other GPUs read on."""
    collector.fail(1, Failure.LOST)
    for uuid in ("MIG-fake-node-a-1-0", "MIG-fake-node-a-1-1"):
        assert errors_by_field(collector.read(device(collector, uuid))) == {DEVICE_FIELD: ReadErrorKind.GPU_LOST}
    assert [failure for _, _, failure in collector.state()] == [None, Failure.LOST, Failure.LOST, None, None]
    assert not second_read(collector, "GPU-fake-node-a-0").errors
    collector.heal(1)
    assert second_read(collector, "MIG-fake-node-a-1-0").gpu_utilization_percent == 40.0


def test_a_gpu_in_mig_mode_without_instances_enumerates_nothing() -> None:
    """`mig: []` is MIG mode before any instance is made: NVML lists nothing for that GPU."""
    scenario = parse_scenario({"gpus": {0: {"mig": []}}}, gpu_count=2)
    assert [gpu.uuid for gpu in FakeCollector(node="n", gpu_count=2, scenario=scenario).discover()] == ["GPU-fake-n-1"]


ONE = {"profile": "1g.10gb", "profile_id": 19, "placement_start": 0}
BAD: list[tuple[Any, str]] = [
    # (gpus.0's entry on a one-GPU node, the message)
    ({"mig": {"profile": "1g.10gb"}}, "gpus.0.mig must be a list of MIG instances, not dict"),
    ({"mig": [ONE, ONE]}, "gpus.0.mig.1 (profile_id 19, placement_start 0) is gpus.0.mig.0's placement too"),
    ({"mig": [{"profile": "1g.10gb"}]}, "gpus.0.mig.0 lacks profile_id, placement_start"),
    ({"mig": [ONE | {"size": 1}]}, "gpus.0.mig.0 has unknown key 'size'; allowed: gpu_instance_id, placement_start,"),
    ({"mig": [ONE | {"profile": "small"}]}, "gpus.0.mig.0.profile 'small' is not a MIG profile; write it as NVIDIA"),
    ({"mig": [ONE | {"profile": 1}]}, "gpus.0.mig.0.profile 1 is not a MIG profile"),
    ({"mig": [ONE | {"profile_id": -1}]}, "gpus.0.mig.0.profile_id -1 must be a whole number >= 0"),
    ({"mig": [ONE | {"placement_start": "0"}]}, "gpus.0.mig.0.placement_start '0' must be a whole number >= 0"),
    ({"mig": [ONE | {"gpu_instance_id": True}]}, "gpus.0.mig.0.gpu_instance_id True must be a whole number >= 0"),
    (
        {"mig": [ONE, {"profile": "1g.10gb", "profile_id": 19, "placement_start": 1, "gpu_instance_id": 1}]},
        "gpus.0.mig.1.gpu_instance_id 1 is gpus.0.mig.0's too",
    ),
    ({"mig": [ONE | {"uuid": "GPU-x"}]}, "gpus.0.mig.0.uuid 'GPU-x' must start with 'MIG-'"),
    ({"mig": [ONE | {"uuid": ""}]}, "gpus.0.mig.0.uuid '' must be a non-empty string"),
    (
        {"mig": [ONE | {"values": {"power_draw": 100}}]},
        "gpus.0.mig.0.values.power_draw: a MIG instance has no power_draw of its own (docs/mig.md); set one of: "
        "dram_bandwidth, gpu_utilization, memory_used_percent",
    ),
    ({"mig": [ONE | {"values": {"temperature": 50}}]}, "gpus.0.mig.0.values.temperature: a MIG instance has no"),
    ({"mig": [ONE | {"values": {"gpu_utilization": 101}}]}, "gpus.0.mig.0.values.gpu_utilization 101 is a percentage"),
    ({"mig": [ONE | {"values": {"gpu_util": 1}}]}, "gpus.0.mig.0.values: 'gpu_util' is not a metric"),
    ({"mig": ["1g.10gb"]}, "gpus.0.mig.0 must be a mapping, not str"),
]


@pytest.mark.parametrize(("entry", "message"), [pytest.param(e, m, id=str(i)) for i, (e, m) in enumerate(BAD)])
def test_bad_mig_entries_name_the_path(entry: Any, message: str) -> None:
    """Each mistake in a `mig` list is a ConfigError naming its path, the bad value and what is allowed."""
    with pytest.raises(ConfigError) as caught:
        parse_scenario({"gpus": {0: entry}}, gpu_count=1)
    assert str(caught.value).startswith(message)


def test_mig_uuids_are_each_devices_own() -> None:
    """A MIG instance's UUID that another instance or a GPU has is refused, naming both."""
    twice = {"gpus": {0: {"mig": [ONE | {"uuid": "MIG-a"}]}, 1: {"mig": [ONE | {"uuid": "MIG-a"}]}}}
    with pytest.raises(ConfigError, match=r"^gpus\.1\.mig\.0\.uuid 'MIG-a' is gpus\.0\.mig\.0\.uuid's too"):
        parse_scenario(twice, gpu_count=2)
    with pytest.raises(ConfigError, match=r"^gpus\.1\.mig\.0\.uuid 'MIG-a' is gpus\.0\.uuid's too"):
        parse_scenario({"gpus": {0: {"uuid": "MIG-a"}, 1: {"mig": [ONE | {"uuid": "MIG-a"}]}}}, gpu_count=2)
    with pytest.raises(ConfigError, match=r"^defaults has unknown key 'mig'"):
        parse_scenario({"defaults": {"mig": [ONE]}}, gpu_count=1)


def test_the_documented_example_loads() -> None:
    """The scenario format's example (on two GPUs) parses and enumerates two instances in GPU 1's place."""
    doc = scenario_module.__doc__
    assert doc is not None
    example = textwrap.dedent(doc.split("\n\n")[1])
    collector = FakeCollector(node="n", gpu_count=2, scenario=parse_scenario(yaml.safe_load(example), gpu_count=2))
    assert [(gpu.index, gpu.uuid) for gpu in collector.discover()] == [
        (0, "GPU-busy-0"),
        (1, "MIG-busy-1-0"),
        (1, "MIG-fake-n-1-1"),
    ]
