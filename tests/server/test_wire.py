"""wire: domain samples to gpuscaler.v1 messages (betterproto2) and back (the gateway's protobuf decoder), as bytes."""

from __future__ import annotations

import math
import re
from dataclasses import replace
from pathlib import Path

import pytest

from gpuscaler.client.explain import Answer, Report
from gpuscaler.client.render import left_out_lines, unlisted_line
from gpuscaler.gateway.decoding import MalformedSnapshot, SnapshotDecoder
from gpuscaler.generated.gpuscaler import v1 as pb
from gpuscaler.model.aggregation import WindowFunction
from gpuscaler.model.columns import WindowColumns
from gpuscaler.model.gpu_metrics import READING_FIELDS, Metric
from gpuscaler.model.samples import (
    DEVICE_FIELD,
    Attribution,
    AttributionState,
    GpuIdentity,
    GpuSample,
    PodRef,
    ProcessUsage,
    ReadError,
    ReadErrorKind,
    Snapshot,
    UnplacedDevice,
)
from gpuscaler.model.windows import Windowed, WindowKey, WindowValues
from gpuscaler.query.metadata import Limits, parse_metadata
from gpuscaler.server.wire import MAX_EXPLAINED_GPUS, explanation_to_wire, sample_to_wire, snapshot_to_wire
from gpuscaler.signals.evaluation import evaluate
from gpuscaler.signals.outcome import Contribution, Evaluation, ListedContributions
from tests.builders import ClusterSource, cluster, decoded, failed_sample, gpu_sample, gpu_trigger, history_of, snapshot

GPU_1 = GpuIdentity(1, "GPU-11111111-test", "Test GPU")


def through_the_wire(original: Snapshot, decoder: SnapshotDecoder | None = None) -> Snapshot:
    """``original`` as an agent sends it and as a gateway reads it, with the gateway's clock at 999."""
    return decoded(snapshot_to_wire(original, poll_interval_seconds=0.5), decoder, monotonic=999.0)


def round_trip(sample: GpuSample) -> GpuSample:
    """``sample`` after a trip through the wire in a snapshot of its own."""
    (received,) = through_the_wire(snapshot(1, 0.0, (sample,))).samples
    return received


SAMPLES = [
    pytest.param(
        gpu_sample(
            3,
            util=87.5,
            mem_util=41.0,
            used=12 * 1024**3,
            total=80 * 1024**3,
            temperature=66.0,
            power=612.25,
            limit=700.0,
        ),
        id="every-value",
    ),
    pytest.param(
        gpu_sample(0, util=0.0, mem_util=0.0, used=0, total=1, temperature=0.0, power=0.0, limit=0.0),
        id="zeros-stay-zeros",
    ),
    pytest.param(gpu_sample(1), id="nothing-read-stays-none"),
    pytest.param(gpu_sample(1, util=50.0, power=None, limit=700.0), id="some-absent"),
    pytest.param(
        gpu_sample(
            2, errors=(ReadError(DEVICE_FIELD, ReadErrorKind.GPU_LOST, "nvmlDeviceGetUUID(gpu 2): GPU is lost"),)
        ),
        id="lost",
    ),
    pytest.param(
        gpu_sample(
            0,
            util=10.0,
            errors=(
                ReadError("power_draw_watts", ReadErrorKind.NOT_SUPPORTED, "Not Supported"),
                ReadError("temperature", ReadErrorKind.TIMEOUT, "hung"),
                ReadError("memory_used_bytes", ReadErrorKind.OTHER, "Unknown Error"),
            ),
        ),
        id="every-error-kind",
    ),
    pytest.param(
        gpu_sample(
            3,
            errors=(
                ReadError(DEVICE_FIELD, ReadErrorKind.GPU_LOST, "GPU is lost", 1_700_000_123.25),
                ReadError("temperature", ReadErrorKind.TIMEOUT, "hung", 0.0),
            ),
        ),
        id="last-read-stamps",
    ),
    pytest.param(
        gpu_sample(
            0,
            util=90.0,
            pods=(PodRef("ml", "vllm-0", "server"), PodRef("ml", "vllm-1", "server")),
        ),
        id="pods",
    ),
    pytest.param(
        gpu_sample(
            4,
            uuid="MIG-9f1c0d2e-aaaa-bbbb-cccc-0123456789ab",
            mig_parent="GPU-5c1f0a2b-aaaa-bbbb-cccc-0123456789ab",
            used=5 * 1024**3,
            total=10 * 1024**3,
            errors=(ReadError("gpu_utilization", ReadErrorKind.NOT_SUPPORTED, "MIG"),),
        ),
        id="mig-instance",
    ),
    pytest.param(
        gpu_sample(0, sm_active=35.5, sm_occupancy=0.0, tensor_active=12.25, dram_bandwidth=48.0, energy=123456.789),
        id="gpm-and-energy",
    ),
    pytest.param(
        gpu_sample(0, energy=5.0, pcie_tx=512.0, pcie_rx=1048.576, nvlink_tx=52428.8, nvlink_rx=0.0),
        id="pcie-and-nvlink-after-energy",
    ),
    pytest.param(gpu_sample(0, util=50.0, processes=()), id="processes-read-none-running"),
    pytest.param(
        gpu_sample(
            0,
            util=70.0,
            processes=(
                ProcessUsage(101, "1b4e2a3c-1111-2222-3333-444455556666", "a" * 64, 30.0, 12.0, 2 * 1024**3),
                ProcessUsage(301, "", None, 0.0, 0.0, 64 * 1024**2),
                ProcessUsage(999, None, None, None, None, None),
            ),
        ),
        id="processes-pod-host-unknown",
    ),
]


@pytest.mark.parametrize("sample", SAMPLES)
def test_sample_round_trips(sample: GpuSample) -> None:
    """A sample survives to_wire, serialisation and from_wire unchanged: None stays None and 0 stays 0."""
    assert round_trip(sample) == sample


def test_absent_value_is_absent_on_the_wire() -> None:
    """An unread value is NaN in the packed readings, not a 0, so a reader in another language sees it absent."""
    message = snapshot_to_wire(snapshot(1, 0.0, (gpu_sample(0, util=0.0),)), poll_interval_seconds=0.5)
    assert message.readings[READING_FIELDS.index("gpu_utilization_percent")] == 0.0
    assert math.isnan(message.readings[READING_FIELDS.index("temperature_celsius")])


def test_processes_not_read_differ_from_none_running() -> None:
    """An agent that read no processes sends processes_read false; the receiver keeps None, not an empty tuple."""
    assert round_trip(gpu_sample(0)).processes is None
    assert sample_to_wire(gpu_sample(0, processes=())).processes_read is True
    assert round_trip(gpu_sample(0, processes=())).processes == ()


def test_whole_gpu_has_no_mig_parent_on_either_side() -> None:
    """A whole GPU has an empty mig_parent_uuid on the wire and None in the domain."""
    message = sample_to_wire(gpu_sample(0))
    assert message.mig_parent_uuid == ""
    assert round_trip(gpu_sample(0)).gpu.mig_parent_uuid is None


def test_unspecified_error_kind_reads_as_other() -> None:
    """An error kind the reader does not know (or unset) becomes OTHER rather than being dropped."""
    message = pb.Snapshot(
        node="n",
        gpus=[pb.GpuSample(index=0, uuid="GPU-x", errors=[pb.ReadError(field="temperature", detail="?")])],
        attribution=pb.Attribution(state=pb.AttributionState.OFF),
        readings=[math.nan] * len(READING_FIELDS),
    )
    assert decoded(message).samples[0].errors == (ReadError("temperature", ReadErrorKind.OTHER, "?"),)


def test_a_snapshot_only_another_version_sends_is_refused() -> None:
    """Readings packed for another number of GPUs, no attribution state, a window this gateway cannot name: no
    agent of its version sends them, so the subscriber drops the stream saying so rather than guess (one GPU's
    readings read as another's, a node's pods as unknown, a window as never sent)."""

    def two_gpus() -> pb.Snapshot:
        return snapshot_to_wire(snapshot(1, 0.0, (gpu_sample(0, util=1.0), gpu_sample(1))), poll_interval_seconds=1.0)

    short, unattributed, unnamed = two_gpus(), two_gpus(), two_gpus()
    short.readings = short.readings[: len(READING_FIELDS)]
    unattributed.attribution = pb.Attribution()
    unnamed.windows = [pb.WindowedValues(window=pb.WindowSpec(metric="flops", seconds=1.0, function="max"))]
    for message, complaint in (
        (
            short,
            f"has {len(READING_FIELDS)} readings for 2 GPUs; each GPU has {len(READING_FIELDS)} here, and at least",
        ),
        (unattributed, "has no pod attribution state"),
        (unnamed, "names a window this gateway cannot read: window metric 'flops' is not a metric"),
    ):
        with pytest.raises(MalformedSnapshot, match=re.escape(complaint)):
            decoded(message)


def test_an_older_or_newer_agent_is_read_in_this_gateways_layout() -> None:
    """A rolling upgrade mixes versions: an older agent packs a prefix of the readings (the first 12), a newer one
    appends more. The older one's missing readings are absent with an error that says why (never 0); a newer one's
    extra readings are dropped; the rest land where they belong."""
    original = snapshot(1, 0.0, (gpu_sample(0, util=42.0), gpu_sample(1, util=7.0)))
    older, newer = (snapshot_to_wire(original, poll_interval_seconds=1.0) for _ in range(2))
    ours = len(READING_FIELDS)
    older.readings = [value for gpu in range(2) for value in older.readings[gpu * ours : gpu * ours + 12]]
    newer.readings = [value for gpu in range(2) for value in [*newer.readings[gpu * ours : (gpu + 1) * ours], 9.0]]
    for message in (older, newer):
        samples = decoded(message).samples
        assert [sample.gpu_utilization_percent for sample in samples] == [42.0, 7.0]
        assert samples[1].energy_joules == original.samples[1].energy_joules
    assert decoded(newer).samples == decoded(snapshot_to_wire(original, poll_interval_seconds=1.0)).samples
    sample = decoded(older).samples[0]
    for name in READING_FIELDS[12:]:
        assert getattr(sample, name) is None
        (error,) = [error for error in sample.errors if error.field == name]
        # Unknown (OTHER), not NOT_SUPPORTED, which would leave the GPU out of a sum as if it had no such reading.
        assert error.kind is ReadErrorKind.OTHER
        assert "is an older gpuscaler, which does not read" in error.detail


def test_the_packed_readings_keep_their_wire_order() -> None:
    """Snapshot.readings is positional, and agents and gateways of two versions read each other's (agent.proto):
    a reading is only ever appended. This list is the wire format; change it only by adding at its end."""
    assert READING_FIELDS == (
        "gpu_utilization_percent",
        "memory_utilization_percent",
        "memory_used_bytes",
        "memory_total_bytes",
        "temperature_celsius",
        "power_draw_watts",
        "power_limit_watts",
        "sm_active_percent",
        "sm_occupancy_percent",
        "tensor_active_percent",
        "dram_bandwidth_percent",
        "energy_joules",
        "pcie_tx_megabytes_per_second",
        "pcie_rx_megabytes_per_second",
        "nvlink_tx_megabytes_per_second",
        "nvlink_rx_megabytes_per_second",
    )


def test_snapshot_round_trips() -> None:
    """A snapshot's node, sequence, wall-clock time and samples survive; the receiver supplies its own clock."""
    original = snapshot(
        41,
        12.5,
        (gpu_sample(0, util=10.0), gpu_sample(1, errors=(ReadError(DEVICE_FIELD, ReadErrorKind.TIMEOUT, "hung"),))),
    )
    message = pb.Snapshot.parse(bytes(snapshot_to_wire(original, poll_interval_seconds=0.5)))
    assert message.poll_interval_seconds == 0.5
    received = through_the_wire(original)
    assert received.monotonic == 999.0
    assert (received.node, received.sequence, received.taken_at) == (
        original.node,
        original.sequence,
        original.taken_at,
    )
    assert received.samples == original.samples


def test_the_devices_no_gpu_carries_reach_the_gateway() -> None:
    """The devices a node's pods hold that the agent could not place travel with its attribution, each with its pod,
    name, kind and why: the gateway answers for those pods as unknown, not by leaving them out."""
    unplaced = (
        UnplacedDevice(
            PodRef("ml", "llm-0", "server"), "gpu.nvidia.com/gpu-1-mig-1g10gb-19-0", ReadErrorKind.OTHER, "no such GPU"
        ),
        UnplacedDevice(
            PodRef("vm", "win-0", "compute"), "gpu.nvidia.com/gpu-vfio-0", ReadErrorKind.NOT_SUPPORTED, "vm"
        ),
    )
    original = replace(
        snapshot(3, 1.0, (gpu_sample(0),)), attribution=Attribution(AttributionState.OK, unplaced=unplaced)
    )
    assert through_the_wire(original).attribution.unplaced == unplaced


def test_the_decoder_reuses_a_nodes_gpus_and_pods_between_ticks() -> None:
    """One decoder gives equal samples each tick, sharing the objects that did not change (cheaper at scale)."""
    decoder = SnapshotDecoder()
    pods = (PodRef("ml", "vllm-0", "server"),)
    first = through_the_wire(snapshot(1, 0.0, (gpu_sample(0, util=10.0, pods=pods),)), decoder).samples[0]
    second = through_the_wire(snapshot(2, 0.5, (gpu_sample(0, util=20.0, pods=pods),)), decoder).samples[0]
    assert (first.gpu_utilization_percent, second.gpu_utilization_percent) == (10.0, 20.0)
    assert second.gpu is first.gpu
    assert second.pods is first.pods


def test_a_sample_lists_its_readings_in_the_metric_tables_order() -> None:
    """The decoder builds samples by position: GpuSample's readings follow gpu_metrics.READINGS."""
    assert GpuSample._fields[2:-3] == READING_FIELDS


def test_packed_readings_are_nan_where_absent_and_keep_bytes_whole() -> None:
    """The packed array has one value per reading of each GPU, NaN for an absent one; bytes come back as integers."""
    sample = gpu_sample(0, util=0.0, used=12 * 1024**3, total=80 * 1024**3)
    message = snapshot_to_wire(snapshot(1, 0.0, (sample, gpu_sample(1, util=7.0))), poll_interval_seconds=0.5)
    assert len(message.readings) == 2 * len(READING_FIELDS)
    assert message.readings[READING_FIELDS.index("gpu_utilization_percent")] == 0.0
    assert message.readings[len(READING_FIELDS) + READING_FIELDS.index("gpu_utilization_percent")] == 7.0
    assert math.isnan(message.readings[READING_FIELDS.index("temperature_celsius")])
    received = round_trip(sample)
    assert received.memory_used_bytes == 12 * 1024**3
    assert isinstance(received.memory_used_bytes, int)


def test_the_protos_packed_order_is_the_metric_tables() -> None:
    """agent.proto names the packed readings' order in words; it is gpu_metrics.READINGS' order."""
    proto = (Path(__file__).parents[2] / "protos" / "gpuscaler" / "v1" / "agent.proto").read_text()
    words = re.search(r"Each GPU's readings, in this order: (.*?)\.", proto, re.S)
    assert words is not None
    assert tuple(name.strip(" /\n") for name in re.sub(r"\s*//\s*", " ", words[1]).split(",")) == READING_FIELDS


def test_an_explanation_over_many_gpus_lists_a_few_hundred_and_counts_the_rest() -> None:
    """Past MAX_EXPLAINED_GPUS rows an explanation lists the unreadable GPUs first and says how many it left
    unlisted; `gpuscaler query` prints that count and counts them in its left-out line."""
    samples = [gpu_sample(index, util=50.0, node=f"node-{index // 8}") for index in range(MAX_EXPLAINED_GPUS + 44)]
    samples[-1] = failed_sample(299, ReadErrorKind.GPU_LOST)._replace(node="node-37")  # the last, listed first
    cluster_view = snapshot(1, 1.0, tuple(samples))
    query = parse_metadata({}, Limits(history_seconds=60)).value
    contributions = ListedContributions(
        Contribution(s, None, 0, "lost") if s.errors else Contribution(s, s.gpu_utilization_percent, 1) for s in samples
    )
    evaluation = Evaluation(query, contributions, 50.0 * (len(samples) - 1), None, cluster_view)
    explanation = explanation_to_wire(
        parse_metadata({}, Limits(history_seconds=60)), evaluation, active=True, now=1.0, error_code=""
    )
    assert len(explanation.gpus) == MAX_EXPLAINED_GPUS
    assert explanation.gpus_omitted == 44
    assert [g.included for g in explanation.gpus[:2]] == [False, True]  # the lost GPU first
    assert explanation.gpus[0].index == 299

    fields = explanation.to_dict()
    report = Report({}, Answer(True), Answer(True), Answer(True), Answer(True), fields, None, 1)
    assert unlisted_line(report).startswith("44 more GPU(s) are in the answer but not listed")
    assert left_out_lines(report)[0] == "The value leaves out 1 of 300 GPU(s); their share is not in it:"


def test_windows_round_trip_packed_with_their_details_only_where_there_are_some() -> None:
    """Each GPU's value over a window travels once, packed; a reason, pods' shares or a coverage short of the
    window travel beside it only in a window that has one, and the gateway reads back what the agent reduced,
    GPU by GPU and as a column."""
    samples = (gpu_sample(0, util=10.0), gpu_sample(1, util=20.0)._replace(gpu=GPU_1))
    plain = WindowKey(Metric.GPU_UTILIZATION, 5.0, WindowFunction.MAX)
    detailed = WindowKey(Metric.POWER_AVERAGE, 5.0, WindowFunction.AVG)
    failing = WindowKey(Metric.TEMPERATURE, 3600.0, WindowFunction.AVG)
    shared = {
        "1b4e2a3c11112222333344445556666": Windowed(40.0, 5, covered_seconds=1.5),
        "9f8e7d6caaaabbbbccccddddeeeeffff": Windowed(None, 0),
    }
    windows = {
        plain: WindowValues({samples[0].gpu.uuid: Windowed(12.5, 5), samples[1].gpu.uuid: Windowed(None, 0)}),
        detailed: WindowValues(
            {
                samples[0].gpu.uuid: Windowed(None, 0, "the energy counter restarted"),
                GPU_1.uuid: Windowed(7.0, 4, None, shared, covered_seconds=2.0),
            }
        ),
        failing: WindowValues({}, "longer than this agent's --history of 10m"),
    }
    message = snapshot_to_wire(snapshot(1, 0.0, samples), poll_interval_seconds=0.5, windows=windows)
    assert [len(window.details) for window in message.windows] == [0, 2, 0]
    assert [list(window.packed_covered_seconds) for window in message.windows] == [[], [5.0, 2.0], []]
    received = decoded(message)
    assert {key: received.windows[key] for key in windows} == windows
    assert isinstance(received.windows, WindowColumns)
    assert received.windows.column(plain) == ([12.5, None], [5, 0], None)
    assert received.windows.column(detailed) == ([None, 7.0], [0, 4], [None, 2.0])
    assert received.windows.column(failing) is None


@pytest.mark.parametrize(
    ("metadata", "value", "pods"),
    [
        pytest.param({"window": "20s"}, 200.0, set(), id="all-gpus"),
        pytest.param(
            {"window": "20s", "namespace": "ml", "pod": "trainer-*"},
            100.0,
            {("trainer-a", None), ("trainer-b", 3.0)},
            id="pods",
        ),
    ],
)
def test_an_explanation_marks_each_filling_window_and_the_least_covered_one(
    metadata: dict[str, str], value: float, pods: set[tuple[str, float | None]]
) -> None:
    """A cluster answer over a node whose agent restarted 3 s ago: its GPUs' rows and its pod's say their 20 s
    window covers 3 s, the answer says how many GPUs have such a window and names the node of the least; the
    whole node's rows say nothing."""
    refs = {"node-a": PodRef("ml", "trainer-a", "main"), "node-b": PodRef("ml", "trainer-b", "main")}

    def tick(name: str, at: float) -> Snapshot:
        samples = tuple(
            gpu_sample(index, util=50.0, node=name, uuid=f"GPU-{name}-{index}", pods=(refs[name],))
            for index in range(2)
        )
        return replace(snapshot(int(at) + 1, at, samples, node=name), attribution=Attribution(AttributionState.OK))

    steady = [tick("node-a", float(t)) for t in range(31)]
    restarted = [tick("node-b", float(t)) for t in range(28, 31)]
    source = ClusterSource(cluster(steady[-1], restarted[-1], at=30.0), history_of(*steady), history_of(*restarted))
    query = parse_metadata(metadata, Limits(history_seconds=600, cluster=True), namespace="ml")
    evaluation = evaluate(gpu_trigger(query).value, source, now=30.0, stale_after=5.0)
    explanation = explanation_to_wire(query, evaluation, active=True, now=30.0, error_code="")
    assert evaluation.value == value
    assert (explanation.least_covered_seconds, explanation.gpus_filling) == (3.0, 2)
    assert explanation.least_covered_node == "node-b"
    assert {(g.node, g.covered_seconds) for g in explanation.gpus} == {("node-a", None), ("node-b", 3.0)}
    assert {(p.pod, p.covered_seconds) for p in explanation.pods} == pods
