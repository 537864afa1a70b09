"""The poll loop stamps each failing reading with when it last read fine, so every evaluator can say so."""

from __future__ import annotations

from gpuscaler.agent.last_reads import LastReads
from gpuscaler.model.samples import DEVICE_FIELD, GpuSample, ReadError, ReadErrorKind
from tests.builders import gpu_sample


def lost(index: int) -> GpuSample:
    """GPU ``index`` lost: its whole device failed."""
    return gpu_sample(index, errors=(ReadError(DEVICE_FIELD, ReadErrorKind.GPU_LOST, "lost"),))


def field_failed(index: int, field: str = "power_draw_watts") -> GpuSample:
    """GPU ``index`` read, but ``field`` failed."""
    return gpu_sample(index, util=10.0, errors=(ReadError(field, ReadErrorKind.OTHER, "unknown error"),))


def stamps(sample: GpuSample) -> dict[str, float | None]:
    """Each error's field and its last-read stamp."""
    return {error.field: error.last_read_at for error in sample.errors}


def test_a_gpu_lost_after_reading_fine_keeps_the_tick_it_last_read() -> None:
    """Lost at tick 3 after two good ticks: every later error names tick 2, however long it stays lost."""
    last_reads = LastReads()
    last_reads.stamp([gpu_sample(0, util=1.0)], 1.0)
    last_reads.stamp([gpu_sample(0, util=1.0)], 2.0)
    for tick in (3.0, 4.0, 50.0):
        [stamped] = last_reads.stamp([lost(0)], tick)
        assert stamps(stamped) == {DEVICE_FIELD: 2.0}


def test_a_gpu_failing_since_the_agent_started_was_never_read() -> None:
    """Lost from the first tick: no tick read it."""
    last_reads = LastReads()
    for tick in (1.0, 2.0):
        [stamped] = last_reads.stamp([lost(0)], tick)
        assert stamps(stamped) == {DEVICE_FIELD: None}


def test_a_gpu_that_recovers_and_fails_again_names_its_newest_good_tick() -> None:
    """Lost, back, lost again: the stamp is the tick it was back, not the first good one."""
    last_reads = LastReads()
    last_reads.stamp([gpu_sample(0, util=1.0)], 1.0)
    last_reads.stamp([lost(0)], 2.0)
    last_reads.stamp([gpu_sample(0, util=1.0)], 3.0)
    [stamped] = last_reads.stamp([lost(0)], 4.0)
    assert stamps(stamped) == {DEVICE_FIELD: 3.0}


def test_a_field_keeps_its_own_last_read_through_a_device_failure() -> None:
    """Power failed from tick 2; the GPU was lost at tick 4 and came back at 5 with power still failing: power
    last read at tick 1, not when the GPU last answered."""
    last_reads = LastReads()
    last_reads.stamp([gpu_sample(0, util=1.0, power=100.0)], 1.0)
    last_reads.stamp([field_failed(0)], 2.0)
    last_reads.stamp([field_failed(0)], 3.0)
    [during] = last_reads.stamp([lost(0)], 4.0)
    assert stamps(during) == {DEVICE_FIELD: 3.0}
    [after] = last_reads.stamp([field_failed(0)], 5.0)
    assert stamps(after) == {"power_draw_watts": 1.0}


def test_a_field_that_fails_after_its_gpu_was_lost_was_read_at_best_when_the_gpu_last_answered() -> None:
    """The GPU comes back with power failing: power was last read, at best, before the GPU was lost."""
    last_reads = LastReads()
    last_reads.stamp([gpu_sample(0, util=1.0, power=100.0)], 1.0)
    last_reads.stamp([lost(0)], 2.0)
    [stamped] = last_reads.stamp([field_failed(0)], 3.0)
    assert stamps(stamped) == {"power_draw_watts": 1.0}


def test_a_gpu_discovered_this_tick_was_never_read() -> None:
    """GPU 1 appears (rediscovery) already failing: no earlier tick read it."""
    last_reads = LastReads()
    last_reads.stamp([gpu_sample(0, util=1.0)], 1.0)
    _, stamped = last_reads.stamp([gpu_sample(0, util=1.0), lost(1)], 2.0)
    assert stamps(stamped) == {DEVICE_FIELD: None}


def test_not_supported_is_never_stamped_and_samples_without_errors_pass_through() -> None:
    """NOT_SUPPORTED has no last read; a sample without errors is returned as it came."""
    last_reads = LastReads()
    good = gpu_sample(0, util=1.0)
    unsupported = gpu_sample(1, errors=(ReadError("energy_joules", ReadErrorKind.NOT_SUPPORTED, "n/a"),))
    last_reads.stamp([good, unsupported], 1.0)
    same_good, same_unsupported = last_reads.stamp([good, unsupported], 2.0)
    assert same_good is good
    assert stamps(same_unsupported) == {"energy_joules": None}
