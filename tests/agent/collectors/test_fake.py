"""FakeCollector: identities, live values, and NVML's failures (lost, not supported, a hung call) on demand."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

from gpuscaler.agent.collectors.fake import Failure, FakeCollector
from gpuscaler.agent.collectors.scenario import parse_scenario
from gpuscaler.model.gpu_metrics import GPM_READINGS, METRICS, READING_FIELDS, Metric, Reading
from gpuscaler.model.samples import DEVICE_FIELD, GpuIdentity, GpuSample, ReadErrorKind

# How long a read must stay blocked to count as hung, and how long a released one may take (generous).
STILL_BLOCKED_SECONDS = 0.2
RELEASED_WITHIN_SECONDS = 10.0

FIELDS = READING_FIELDS


@pytest.fixture
def collector() -> FakeCollector:
    """Three idle fake GPUs on node-a."""
    return FakeCollector(node="node-a", gpu_count=3)


def read(collector: FakeCollector, index: int) -> GpuSample:
    """A read of GPU ``index`` as the poll loop makes it."""
    return collector.read(collector.discover()[index])


def values_of(sample: GpuSample) -> list[object]:
    """The sample's readings in READING_FIELDS order, to compare samples reading by reading."""
    return [getattr(sample, name) for name in FIELDS]


class BackgroundRead:
    """One read on its own thread, as the poll loop does it, so a hung read can be watched from outside."""

    def __init__(self, collector: FakeCollector, gpu: GpuIdentity) -> None:
        self.result: GpuSample | None = None
        self._thread = threading.Thread(target=self._run, args=(collector, gpu), daemon=True)
        self._thread.start()

    def _run(self, collector: FakeCollector, gpu: GpuIdentity) -> None:
        self.result = collector.read(gpu)

    def done_within(self, seconds: float) -> bool:
        self._thread.join(seconds)
        return not self._thread.is_alive()


def test_identities(collector: FakeCollector) -> None:
    """Fake GPUs are indexed from 0, named `Fake GPU`, with UUID `GPU-fake-<node>-<index>`, no MIG parent."""
    assert list(collector.discover()) == [
        GpuIdentity(index=i, uuid=f"GPU-fake-node-a-{i}", name="Fake GPU", mig_parent_uuid=None) for i in range(3)
    ]
    assert collector.node == "node-a"
    assert read(collector, 2).node == "node-a"


def test_minor_numbers_count_down_from_the_last_index(collector: FakeCollector) -> None:
    """A fake GPU's minor number differs from its index unless a scenario sets it, as on renumbered GPUs."""
    assert [(gpu.index, gpu.minor) for gpu in collector.discover()] == [(0, 2), (1, 1), (2, 0)]
    scenario = parse_scenario({"gpus": {0: {"minor": 0}, 2: {"minor": 2}}}, gpu_count=3)
    set_by_scenario = FakeCollector(node="node-a", gpu_count=3, scenario=scenario)
    assert [gpu.minor for gpu in set_by_scenario.discover()] == [0, 1, 2]


def test_no_gpus() -> None:
    """--fake-gpus 0 gives a node without GPUs."""
    assert list(FakeCollector(node="n", gpu_count=0).discover()) == []


@pytest.mark.parametrize(
    ("values", "check", "expected"),
    [
        pytest.param({Metric.GPU_UTILIZATION: 95.0}, lambda s: s.gpu_utilization_percent, 95.0, id="gpu_utilization"),
        pytest.param({Metric.MEMORY_UTILIZATION: 40.0}, lambda s: s.memory_utilization_percent, 40.0, id="mem-util"),
        pytest.param({Metric.TEMPERATURE: 81.5}, lambda s: s.temperature_celsius, 81.5, id="temperature"),
        pytest.param({Metric.POWER_DRAW: 450.0}, lambda s: s.power_draw_watts, 450.0, id="power_draw"),
        pytest.param({Metric.POWER_PERCENT: 50.0}, lambda s: s.power_draw_watts, 350.0, id="power_percent-of-700w"),
        pytest.param(
            {Metric.MEMORY_USED_PERCENT: 25.0}, lambda s: s.memory_used_bytes, 20 * 1024**3, id="memory_used_percent"
        ),
        pytest.param({Metric.MEMORY_USED_PERCENT: 25.0}, lambda s: s.value(Metric.MEMORY_USED_PERCENT), 25.0, id="pct"),
    ],
)
def test_set_values_on_one_gpu(
    collector: FakeCollector, values: dict[Metric, float], check: Callable[[GpuSample], object], expected: float
) -> None:
    """Setting a metric on one GPU changes that GPU's reading, in the field's unit, and no other GPU's."""
    for index in range(3):
        read(collector, index)  # the first read has no GPM values, as on NVML
    idle = _without_energy(values_of(read(collector, 0)))
    collector.set_values(1, values)
    assert check(read(collector, 1)) == pytest.approx(expected)
    assert _without_energy(values_of(read(collector, 0))) == idle
    assert _without_energy(values_of(read(collector, 2))) == idle


def _without_energy(values: list[object]) -> list[object]:
    """The readings but the energy counter, which grows between any two reads."""
    return [value for name, value in zip(FIELDS, values, strict=True) if name != "energy_joules"]


@pytest.mark.parametrize("reading", GPM_READINGS, ids=lambda reading: reading.field)
def test_gpm_metrics_are_absent_on_the_first_read_then_follow_their_setting(
    collector: FakeCollector, reading: Reading
) -> None:
    """A GPM reading is absent with its reason on a GPU's first read (a rate needs two samples), then has its value."""
    metric = next(m for m, info in METRICS.items() if info.reading == reading.field)
    collector.set_values(0, {metric: 42.5})
    first = read(collector, 0)
    assert getattr(first, reading.field) is None
    error = first.error_for(metric)
    assert error is not None
    assert "first" in error.detail
    assert getattr(read(collector, 0), reading.field) == 42.5
    collector.fail(0, Failure.LOST)
    read(collector, 0)
    collector.heal(0)
    assert getattr(read(collector, 0), reading.field) is None  # after a loss, NVML's previous sample is gone too


def test_energy_counts_the_power_drawn_between_reads(collector: FakeCollector) -> None:
    """The energy counter grows by at least power x the time between two reads, and never falls."""
    collector.set_values(0, {Metric.POWER_DRAW: 500.0})
    first = read(collector, 0).energy_joules
    started = time.monotonic()
    time.sleep(0.05)
    second = read(collector, 0).energy_joules
    elapsed = time.monotonic() - started
    assert first is not None
    assert second is not None
    assert second - first >= 500.0 * 0.05
    assert second - first <= 500.0 * (elapsed + 0.05)


def test_set_values_on_every_gpu(collector: FakeCollector) -> None:
    """Index None sets every GPU."""
    collector.set_values(None, {Metric.GPU_UTILIZATION: 70.0})
    assert [read(collector, i).gpu_utilization_percent for i in range(3)] == [70.0, 70.0, 70.0]


def test_power_draw_and_power_percent_replace_each_other(collector: FakeCollector) -> None:
    """The last of power_draw and power_percent set decides the watts."""
    collector.set_values(0, {Metric.POWER_PERCENT: 50.0})
    assert read(collector, 0).power_draw_watts == 350.0
    collector.set_values(0, {Metric.POWER_DRAW: 100.0})
    assert read(collector, 0).power_draw_watts == 100.0
    collector.set_values(0, {Metric.POWER_PERCENT: 10.0})
    assert read(collector, 0).power_draw_watts == pytest.approx(70.0)


def test_lost_gpu_reads_as_a_device_error(collector: FakeCollector) -> None:
    """A lost GPU has no values and one device-wide GPU_LOST error with NVML's words."""
    collector.fail(1, Failure.LOST)
    sample = read(collector, 1)
    assert values_of(sample) == [None] * len(FIELDS)
    [error] = sample.errors
    assert error.field == DEVICE_FIELD
    assert error.kind is ReadErrorKind.GPU_LOST
    assert "GPU is lost" in error.detail
    for metric in Metric:
        assert sample.value(metric) is None
        assert sample.error_for(metric) == error
    read(collector, 0)  # GPM needs a previous sample
    assert read(collector, 0).errors == ()


def test_not_supported_gpu_reads_every_field_as_not_supported(collector: FakeCollector) -> None:
    """A not_supported GPU has every field absent with its own NOT_SUPPORTED error, and no device error."""
    collector.fail(0, Failure.NOT_SUPPORTED)
    sample = read(collector, 0)
    assert values_of(sample) == [None] * len(FIELDS)
    assert sorted(e.field for e in sample.errors) == sorted(FIELDS)
    assert {e.kind for e in sample.errors} == {ReadErrorKind.NOT_SUPPORTED}
    for metric in Metric:
        error = sample.error_for(metric)
        assert error is not None
        assert error.kind is ReadErrorKind.NOT_SUPPORTED


@pytest.mark.parametrize("failure", [Failure.LOST, Failure.NOT_SUPPORTED, Failure.TIMEOUT], ids=lambda f: f.value)
def test_heal_restores_the_values(collector: FakeCollector, failure: Failure) -> None:
    """After heal a GPU reads as before it failed, set values included."""
    collector.set_values(2, {Metric.GPU_UTILIZATION: 33.0})
    read(collector, 2)  # GPM needs a previous sample
    before = _without_energy(values_of(read(collector, 2)))
    collector.fail(2, failure)
    collector.heal(2)
    sample = read(collector, 2)
    assert sample.errors == ()
    assert _without_energy(values_of(sample)) == before


def test_timeout_read_blocks_until_healed(collector: FakeCollector) -> None:
    """A timeout failure hangs the read like a stuck NVML call, until heal releases it with a TIMEOUT error."""
    collector.fail(1, Failure.TIMEOUT)
    hung = BackgroundRead(collector, collector.discover()[1])
    assert not hung.done_within(STILL_BLOCKED_SECONDS)
    read(collector, 0)  # GPM needs a previous sample
    assert read(collector, 0).errors == ()  # other GPUs still answer at once
    collector.heal(1)
    assert hung.done_within(RELEASED_WITHIN_SECONDS)
    assert hung.result is not None
    [error] = hung.result.errors
    assert (error.field, error.kind) == (DEVICE_FIELD, ReadErrorKind.TIMEOUT)
    read(collector, 1)
    assert read(collector, 1).errors == ()


def test_heal_all_releases_every_hung_read(collector: FakeCollector) -> None:
    """heal with no index releases hung reads on every GPU."""
    for index in (0, 2):
        collector.fail(index, Failure.TIMEOUT)
    hung = [BackgroundRead(collector, collector.discover()[i]) for i in (0, 2)]
    assert not any(r.done_within(STILL_BLOCKED_SECONDS) for r in hung)
    collector.heal(None)
    assert all(r.done_within(RELEASED_WITHIN_SECONDS) for r in hung)


def test_close_releases_a_hung_read(collector: FakeCollector) -> None:
    """Closing the collector releases hung reads, so the agent's threads can finish."""
    collector.fail(0, Failure.TIMEOUT)
    hung = BackgroundRead(collector, collector.discover()[0])
    assert not hung.done_within(STILL_BLOCKED_SECONDS)
    collector.close()
    assert hung.done_within(RELEASED_WITHIN_SECONDS)


@pytest.mark.parametrize("second", [Failure.TIMEOUT, Failure.LOST], ids=lambda f: f.value)
def test_heal_releases_a_read_hung_before_a_second_failure(collector: FakeCollector, second: Failure) -> None:
    """A read hung by one timeout is released by heal even if the GPU was failed again meanwhile."""
    collector.fail(0, Failure.TIMEOUT)
    hung = BackgroundRead(collector, collector.discover()[0])
    assert not hung.done_within(STILL_BLOCKED_SECONDS)
    collector.fail(0, second)
    collector.heal(0)
    assert hung.done_within(RELEASED_WITHIN_SECONDS)


def test_a_new_timeout_after_heal_hangs_again(collector: FakeCollector) -> None:
    """After heal, failing with timeout again hangs the next read again."""
    collector.fail(0, Failure.TIMEOUT)
    collector.heal(0)
    collector.fail(0, Failure.TIMEOUT)
    hung = BackgroundRead(collector, collector.discover()[0])
    assert not hung.done_within(STILL_BLOCKED_SECONDS)
    collector.heal(0)
    assert hung.done_within(RELEASED_WITHIN_SECONDS)


def test_state_reports_values_and_failures(collector: FakeCollector) -> None:
    """state() lists every GPU with its current values and failure (what `gpuscaler fake` prints)."""
    collector.set_values(0, {Metric.GPU_UTILIZATION: 12.0})
    collector.fail(1, Failure.LOST)
    state = collector.state()
    assert [identity.index for identity, _, _ in state] == [0, 1, 2]
    assert state[0][1][Metric.GPU_UTILIZATION] == 12.0
    assert [failure for _, _, failure in state] == [None, Failure.LOST, None]


@pytest.mark.parametrize("index", [3, -1, 100])
def test_out_of_range_index_is_refused(collector: FakeCollector, index: int) -> None:
    """Setting, failing or healing a GPU the agent lacks raises naming the range it has."""
    actions: list[Callable[[], None]] = [
        lambda: collector.set_values(index, {Metric.GPU_UTILIZATION: 1.0}),
        lambda: collector.fail(index, Failure.LOST),
        lambda: collector.heal(index),
    ]
    for action in actions:
        with pytest.raises(IndexError, match=rf"gpu {index} is out of range; this agent has GPUs 0-2"):
            action()
