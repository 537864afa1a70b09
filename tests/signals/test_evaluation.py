"""evaluate() over a hand-filled History: windows, GPU selection, and the errors KEDA must get instead of a 0."""

from __future__ import annotations

import pytest

from gpuscaler.agent.history import History
from gpuscaler.model.aggregation import Aggregation, WindowFunction
from gpuscaler.model.errors import GpuscalerError, InvalidMetadata, Unavailable, Unsupported
from gpuscaler.model.gpu_metrics import Metric
from gpuscaler.model.samples import GpuSample, ReadError, ReadErrorKind
from gpuscaler.query.query import DEFAULT_MAX_UNREADABLE, GpuQuery, GpuSelection, UnreadableTolerance
from gpuscaler.signals.evaluation import evaluate
from gpuscaler.signals.outcome import Evaluation
from tests.builders import (
    NODE,
    failed_sample,
    gpu_sample,
    history_of,
    series,
    snapshot,
    unsupported_sample,
    utilizations,
    uuid_of,
)

STALE_AFTER = 3.0


def query(
    *,
    metric: Metric = Metric.GPU_UTILIZATION,
    aggregation: Aggregation = Aggregation.SUM,
    selection: GpuSelection | None = None,
    window: float | None = None,
    function: WindowFunction = WindowFunction.AVG,
    max_unreadable: UnreadableTolerance = DEFAULT_MAX_UNREADABLE,
) -> GpuQuery:
    """A value query: by default the sum of gpu_utilization over every GPU, latest sample."""
    return GpuQuery(metric, aggregation, selection or GpuSelection(), window, function, max_unreadable=max_unreadable)


def run(value_query: GpuQuery, history: History, *, now: float | None = None) -> Evaluation:
    """Evaluate as of the latest snapshot's time unless ``now`` is given."""
    latest = history.latest
    at = now if now is not None else (latest.monotonic if latest else 0.0)
    return evaluate(value_query, history, now=at, stale_after=STALE_AFTER)


def failure(evaluation: Evaluation) -> GpuscalerError:
    """The error of an evaluation that has no value, checking that value_or_raise raises it."""
    assert evaluation.value is None
    assert evaluation.error is not None
    with pytest.raises(GpuscalerError):
        evaluation.value_or_raise()
    return evaluation.error


def test_latest_sample_is_the_default() -> None:
    """Without a window only the newest snapshot counts: older ticks do not move the value."""
    history = series([(90.0, 90.0), (10.0, 20.0)])
    evaluation = run(query(), history)
    assert evaluation.value_or_raise() == 30.0
    assert [c.sample_count for c in evaluation.contributions] == [1, 1]
    assert evaluation.snapshot is history.latest


SPIKE = [(10.0,)] * 4 + [(100.0,)] + [(10.0,)] * 5  # ten ticks 1 s apart, one spike in the middle


@pytest.mark.parametrize(
    ("function", "window", "expected", "samples"),
    [
        pytest.param(WindowFunction.AVG, 10.0, 19.0, 10, id="avg-10s"),
        pytest.param(WindowFunction.MAX, 10.0, 100.0, 10, id="max-10s"),
        pytest.param(WindowFunction.MIN, 10.0, 10.0, 10, id="min-10s"),
        pytest.param(WindowFunction.LAST, 10.0, 10.0, 10, id="last-10s"),
        pytest.param(WindowFunction.MAX, 4.0, 10.0, 5, id="max-4s-misses-the-spike"),
        pytest.param(WindowFunction.MAX, 5.0, 100.0, 6, id="max-5s-reaches-the-spike"),
        pytest.param(WindowFunction.AVG, 0.5, 10.0, 1, id="window-shorter-than-a-tick"),
    ],
)
def test_window_reduces_each_gpu_over_time(
    function: WindowFunction, window: float, expected: float, samples: int
) -> None:
    """A one-sample spike barely lifts a 10 s avg but does lift the max; the window ends at the latest tick."""
    evaluation = run(query(window=window, function=function), series(SPIKE))
    assert evaluation.value_or_raise() == pytest.approx(expected)
    [contribution] = evaluation.contributions
    assert contribution.sample_count == samples


@pytest.mark.parametrize(
    ("aggregation", "expected"),
    [
        pytest.param(Aggregation.SUM, 80.0, id="sum"),
        pytest.param(Aggregation.MAX, 60.0, id="max-of-averages-not-of-samples"),
        pytest.param(Aggregation.MIN, 20.0, id="min"),
    ],
)
def test_window_reduces_over_time_first_then_across_gpus(aggregation: Aggregation, expected: float) -> None:
    """Each GPU's window is reduced on its own, then GPUs combine: max(avg) is 60 here, not the sample max 70."""
    history = series([(10.0, 50.0), (30.0, 70.0)])
    assert run(query(aggregation=aggregation, window=10.0), history).value_or_raise() == expected


def test_a_window_that_has_not_filled_answers_from_its_readings_and_says_how_much_it_covers() -> None:
    """An agent 5 s old asked for a 2-minute average answers its readings' average, not an error (KEDA would keep
    or fall back on every agent restart: docs/metadata.md), and each GPU says its window covers 5 s of 120."""
    history = series([[40.0, 80.0]] * 4 + [[60.0, 80.0]])
    evaluation = run(query(window=120.0), history)
    assert evaluation.value_or_raise() == 44.0 + 80.0
    assert [(c.sample_count, c.covered_seconds) for c in evaluation.contributions] == [(5, 5.0), (5, 5.0)]
    assert [c.sample.gpu.index for c in evaluation.filling_windows()] == [0, 1]
    assert run(query(), history).filling_windows() == []  # the latest sample has no window to fill


def test_window_skips_failed_reads_instead_of_counting_zero() -> None:
    """A tick where the GPU could not be read is left out of its window, never averaged in as 0."""
    history = history_of(
        snapshot(1, 0.0, utilizations(60.0)),
        snapshot(2, 1.0, (failed_sample(0, ReadErrorKind.TIMEOUT),)),
        snapshot(3, 2.0, utilizations(80.0)),
    )
    evaluation = run(query(window=10.0), history)
    assert evaluation.value_or_raise() == 70.0
    assert evaluation.contributions[0].sample_count == 2


@pytest.mark.parametrize(
    ("selection", "expected", "indices"),
    [
        pytest.param(GpuSelection(), 100.0 + 200.0 + 300.0 + 400.0, [0, 1, 2, 3], id="all"),
        pytest.param(GpuSelection(indices=(0, 2)), 100.0 + 300.0, [0, 2], id="indices"),
        pytest.param(GpuSelection(indices=(3,)), 400.0, [3], id="one-index"),
        pytest.param(GpuSelection(uuids=(uuid_of(1),)), 200.0, [1], id="uuid"),
        pytest.param(GpuSelection(uuids=(uuid_of(1).upper(), uuid_of(3).lower())), 600.0, [1, 3], id="uuid-any-case"),
    ],
)
def test_selection_picks_the_named_gpus(selection: GpuSelection, expected: float, indices: list[int]) -> None:
    """gpuIndex and gpuUUID (case-insensitive) restrict the query to those GPUs."""
    samples = tuple(gpu_sample(i, power=100.0 * (i + 1)) for i in range(4))
    evaluation = run(query(metric=Metric.POWER_DRAW, selection=selection), history_of(snapshot(1, 0.0, samples)))
    assert evaluation.value_or_raise() == expected
    assert [c.sample.gpu.index for c in evaluation.contributions] == indices


@pytest.mark.parametrize(
    ("selection", "fragments"),
    [
        pytest.param(GpuSelection(indices=(7,)), ["gpuIndex 7", repr(NODE), "its GPUs: 0, 1"], id="index"),
        pytest.param(GpuSelection(indices=(0, 5, 9)), ["gpuIndex 5,9", "its GPUs: 0, 1"], id="indices"),
        pytest.param(
            GpuSelection(uuids=("GPU-nope",)), ["gpuUUID GPU-nope", f"its GPUs: {uuid_of(0)}, {uuid_of(1)}"], id="uuid"
        ),
    ],
)
def test_selecting_a_gpu_the_node_lacks_lists_what_it_has(selection: GpuSelection, fragments: list[str]) -> None:
    """Naming a GPU that is not on the node is INVALID_ARGUMENT listing the node's GPUs."""
    error = failure(run(query(selection=selection), series([(10.0, 20.0)])))
    assert isinstance(error, InvalidMetadata)
    for fragment in fragments:
        assert fragment in error.message


@pytest.mark.parametrize(
    ("values", "listing"),
    [pytest.param((10.0,), "its GPUs: 0", id="one-gpu"), pytest.param((), "its GPUs: none", id="no-gpu")],
)
def test_the_listing_of_a_nodes_gpus_does_not_read_as_a_count(values: tuple[float, ...], listing: str) -> None:
    """With one GPU the message lists index 0 as a GPU ("its GPUs: 0"), not as a count ("it has 0")."""
    error = failure(run(query(selection=GpuSelection(indices=(99,))), series([values])))
    assert isinstance(error, InvalidMetadata)
    assert listing in error.message
    assert "it has" not in error.message


@pytest.mark.parametrize(
    ("kind", "reason"),
    [
        pytest.param(ReadErrorKind.GPU_LOST, "gpu_lost: nvml says no", id="lost"),
        pytest.param(ReadErrorKind.TIMEOUT, "timeout: nvml says no", id="timeout"),
        pytest.param(ReadErrorKind.NOT_SUPPORTED, "not_supported: nvml says no", id="not_supported"),
        pytest.param(ReadErrorKind.OTHER, "other: nvml says no", id="other"),
    ],
)
def test_all_gpu_query_leaves_out_an_unreadable_gpu_with_its_reason(kind: ReadErrorKind, reason: str) -> None:
    """Over all GPUs, one that cannot be read is left out within maxUnreadable (and says why); the others answer."""
    samples = (gpu_sample(0, util=40.0), failed_sample(1, kind, "nvml says no"), gpu_sample(2, util=50.0))
    evaluation = run(query(max_unreadable=UnreadableTolerance(count=1)), history_of(snapshot(1, 0.0, samples)))
    assert evaluation.error is None
    assert evaluation.value == 90.0
    left_out = evaluation.contributions[1]
    assert left_out.value is None
    assert left_out.reason is not None
    assert left_out.reason.startswith(reason)
    assert [c.value for c in evaluation.contributions] == [40.0, None, 50.0]


@pytest.mark.parametrize(
    "kind",
    [ReadErrorKind.GPU_LOST, ReadErrorKind.TIMEOUT, ReadErrorKind.OTHER],
    ids=lambda kind: kind.value,
)
def test_one_unreadable_gpu_of_eight_is_unavailable_by_default(kind: ReadErrorKind) -> None:
    """One node's 8 GPUs, one lost or hung: under the default 5% (0 of 8) the answer is UNAVAILABLE naming it.

    Leaving it out would scale a busy node in by 1/8; with maxUnreadable 1 it is left out, and 0 is strict.
    """
    samples = (*(gpu_sample(i, util=95.0) for i in range(7)), failed_sample(7, kind, "nvml says no"))
    history = history_of(snapshot(1, 0.0, samples))
    error = failure(run(query(), history))
    assert type(error) is Unavailable
    assert error.message.startswith("gpu_utilization cannot be read on 1 of the 8 selected GPUs")
    assert "maxUnreadable 5% (the default) lets an answer leave out 0 of them" in error.message
    assert f"GPU 7 ({uuid_of(7)}): {kind.value}: nvml says no" in error.message
    assert "on node" not in error.message  # an agent's own GPUs
    assert "maxUnreadable 0 lets" in failure(run(query(max_unreadable=UnreadableTolerance(count=0)), history)).message
    tolerant = run(query(max_unreadable=UnreadableTolerance(count=1)), history)
    assert (tolerant.error, tolerant.value) == (None, 7 * 95.0)
    assert [c.sample.gpu.index for c in tolerant.unread] == [7]


def test_a_gpu_without_the_metric_is_left_out_whatever_the_tolerance() -> None:
    """NOT_SUPPORTED is outside the metric's domain, not unknown: left out even with maxUnreadable 0."""
    samples = (gpu_sample(0, util=40.0), unsupported_sample(1))
    evaluation = run(query(max_unreadable=UnreadableTolerance(count=0)), history_of(snapshot(1, 0.0, samples)))
    assert (evaluation.error, evaluation.value) == (None, 40.0)
    assert [c.sample.gpu.index for c in evaluation.unread] == [1]


def test_left_out_gpu_says_when_its_agent_last_read_it() -> None:
    """A GPU that failed after reading fine says when its agent last read it, from the error's stamp (a gateway
    keeps one snapshot per node: the history cannot tell); one never read says so."""
    lost_after_reading = failed_sample(0, ReadErrorKind.GPU_LOST, last_read_at=0.0)
    never_read = failed_sample(1, ReadErrorKind.GPU_LOST)
    evaluation = run(query(), history_of(snapshot(3, 2.0, (lost_after_reading, never_read))))
    reasons = [c.reason or "" for c in evaluation.contributions]
    assert "last read 2023-11-14T22:13:20.000+00:00" in reasons[0]
    assert "last read never since its agent started" in reasons[1]


@pytest.mark.parametrize(
    ("kind", "error_type"),
    [
        pytest.param(ReadErrorKind.GPU_LOST, Unavailable, id="lost-unavailable"),
        pytest.param(ReadErrorKind.TIMEOUT, Unavailable, id="timeout-unavailable"),
        pytest.param(ReadErrorKind.OTHER, Unavailable, id="other-unavailable"),
        pytest.param(ReadErrorKind.NOT_SUPPORTED, Unsupported, id="not_supported-unsupported"),
    ],
)
@pytest.mark.parametrize(
    "selection",
    [
        pytest.param(GpuSelection(indices=(0, 1)), id="by-index"),
        pytest.param(GpuSelection(uuids=(uuid_of(0), uuid_of(1))), id="by-uuid"),
    ],
)
def test_explicitly_selected_unreadable_gpu_fails_the_query(
    kind: ReadErrorKind, error_type: type[GpuscalerError], selection: GpuSelection
) -> None:
    """A GPU the trigger names must be read: if it cannot be, the query fails, naming that GPU and why."""
    samples = (gpu_sample(0, util=40.0), failed_sample(1, kind, "nvml says no"), gpu_sample(2, util=50.0))
    error = failure(run(query(selection=selection), history_of(snapshot(1, 0.0, samples))))
    assert type(error) is error_type
    assert f"GPU 1 ({uuid_of(1)})" in error.message
    assert "nvml says no" in error.message
    assert "gpu_utilization" in error.message
    assert "GPU 0" not in error.message


@pytest.mark.parametrize(
    ("samples", "error_type"),
    [
        pytest.param(
            (failed_sample(0, ReadErrorKind.GPU_LOST), failed_sample(1, ReadErrorKind.GPU_LOST)), Unavailable, id="lost"
        ),
        pytest.param(
            (failed_sample(0, ReadErrorKind.TIMEOUT), unsupported_sample(1)), Unavailable, id="timeout-and-unsupported"
        ),
        pytest.param((unsupported_sample(0), unsupported_sample(1)), Unsupported, id="unsupported"),
        pytest.param((gpu_sample(0), gpu_sample(1)), Unavailable, id="absent-without-reason"),
    ],
)
def test_no_readable_gpu_is_an_error_never_zero(
    samples: tuple[GpuSample, ...], error_type: type[GpuscalerError]
) -> None:
    """When no GPU can be read the query fails (UNAVAILABLE, or FAILED_PRECONDITION if it never can), not 0."""
    error = failure(run(query(), history_of(snapshot(1, 0.0, samples))))
    assert type(error) is error_type
    assert "GPU 0" in error.message
    assert "GPU 1" in error.message


def test_no_snapshot_yet_is_unavailable() -> None:
    """Before the first poll there is nothing to answer from."""
    error = failure(run(query(), history_of()))
    assert isinstance(error, Unavailable)
    assert "no sample yet" in error.message


@pytest.mark.parametrize(
    ("age", "fresh"),
    [
        pytest.param(0.0, True, id="new"),
        pytest.param(STALE_AFTER, True, id="at-the-limit"),
        pytest.param(STALE_AFTER + 0.1, False, id="just-stale"),
        pytest.param(3600.0, False, id="an-hour-old"),
    ],
)
def test_stale_snapshot_is_unavailable(age: float, fresh: bool) -> None:
    """A newest sample older than the freshness limit means the poll loop is stalled: UNAVAILABLE, no old value."""
    history = series([(10.0,)])
    evaluation = run(query(), history, now=age)
    if fresh:
        assert evaluation.value_or_raise() == 10.0
    else:
        error = failure(evaluation)
        assert isinstance(error, Unavailable)
        assert "no fresh sample" in error.message
        assert f"{age:.1f}s old" in error.message


def test_node_without_gpus_is_unavailable() -> None:
    """A node that reports no GPUs has no value to give: UNAVAILABLE naming the node, never 0."""
    error = failure(run(query(), history_of(snapshot(1, 0.0, ()))))
    assert isinstance(error, Unavailable)
    assert f"node {NODE!r} reports no GPUs" in error.message


def mig_instance(slot: int, *, used: int) -> GpuSample:
    """A MIG instance as NVML reads it: no utilisation and no power, memory per instance."""
    return gpu_sample(
        0,
        uuid=f"MIG-{slot}",
        mig_parent="GPU-parent",
        used=used,
        total=1000,
        temperature=50.0,
        errors=(
            ReadError("gpu_utilization", ReadErrorKind.NOT_SUPPORTED, "nvmlDeviceGetUtilizationRates: Not Supported"),
            ReadError(
                "memory_utilization", ReadErrorKind.NOT_SUPPORTED, "nvmlDeviceGetUtilizationRates: Not Supported"
            ),
            ReadError("power_draw_watts", ReadErrorKind.NOT_SUPPORTED, "power is per physical GPU"),
            ReadError("power_limit_watts", ReadErrorKind.NOT_SUPPORTED, "power is per physical GPU"),
        ),
    )


def mig_history() -> History:
    """One snapshot: a MIG GPU's two instances (250 and 500 of 1000 bytes used) beside a whole GPU (100 of 1000)."""
    whole = gpu_sample(1, util=30.0, power=200.0, limit=400.0, used=100, total=1000)
    samples = (mig_instance(0, used=250), mig_instance(1, used=500), whole)
    return history_of(snapshot(1, 0.0, samples))


@pytest.mark.parametrize(
    ("value_query", "expected", "included"),
    [
        pytest.param(query(metric=Metric.MEMORY_USED_PERCENT), 85.0, [True, True, True], id="memory-used"),
        pytest.param(query(), 30.0, [False, False, True], id="utilisation-from-the-whole-gpu-only"),
        pytest.param(query(metric=Metric.POWER_PERCENT), 50.0, [False, False, True], id="power-percent"),
    ],
)
def test_mig_instances_without_utilisation(value_query: GpuQuery, expected: float, included: list[bool]) -> None:
    """MIG instances answer memory queries; utilisation and power leave them out as not supported."""
    evaluation = run(value_query, mig_history())
    assert evaluation.value_or_raise() == pytest.approx(expected)
    assert [c.value is not None for c in evaluation.contributions] == included


def test_mig_only_utilisation_query_is_unsupported() -> None:
    """Utilisation over MIG instances alone cannot be read, now or later: FAILED_PRECONDITION, not 0."""
    selection = GpuSelection(uuids=("MIG-0", "MIG-1"))
    error = failure(run(query(selection=selection), mig_history()))
    assert isinstance(error, Unsupported)
    assert "MIG-0" in error.message
    assert "MIG-1" in error.message
