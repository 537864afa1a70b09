"""desired_replicas: the HPA's arithmetic for AverageValue and Value, its 10% tolerance, KEDA's e2e numbers."""

from __future__ import annotations

import pytest

from gpuscaler.client.hpa import MetricType, desired_replicas


@pytest.mark.parametrize(
    ("value", "target", "current", "expected"),
    [
        # KEDA's own e2e expectations for its sample external scaler (AverageValue, the default).
        pytest.param(10.0, 10.0, 1, 1, id="keda-e2e-10-of-10"),
        pytest.param(20.0, 10.0, 1, 2, id="keda-e2e-20-of-10"),
        pytest.param(0.0, 10.0, 1, 0, id="keda-e2e-zero"),
        # 22.222 / 6.111 is 3.64: the HPA proposes 4, and the e2e's maxReplicaCount 3 caps it (clamps are not ours).
        pytest.param(22.222, 6.111, 1, 4, id="keda-e2e-float"),
        # The sum over GPUs with a per-GPU target: 4 GPUs at 90% with target 70.
        pytest.param(360.0, 70.0, 1, 6, id="sum-of-four-gpus-from-one"),
        pytest.param(360.0, 70.0, 4, 6, id="sum-of-four-gpus-from-four"),
        pytest.param(360.0, 70.0, 6, 6, id="sum-of-four-gpus-settled"),
        pytest.param(360.0, 70.0, 10, 6, id="scale-in"),
        pytest.param(100.0, 70.0, 1, 2, id="one-busy-gpu"),
        pytest.param(100.0, 70.0, 0, 2, id="current-zero-counts-as-one"),
        # Tolerance: within 10% of the target per replica the count is kept.
        pytest.param(105.0, 100.0, 1, 1, id="5pct-over-kept"),
        pytest.param(109.0, 100.0, 1, 1, id="9pct-over-kept"),
        pytest.param(111.0, 100.0, 1, 2, id="11pct-over-scales"),
        pytest.param(280.0, 100.0, 3, 3, id="7pct-under-kept"),
        pytest.param(190.0, 100.0, 3, 2, id="37pct-under-scales"),
        pytest.param(91.0, 100.0, 1, 1, id="9pct-under-kept"),
    ],
)
def test_average_value(value: float, target: float, current: int, expected: int) -> None:
    """AverageValue: ceil(value / target) whatever the current count, unless within the 10% tolerance."""
    assert desired_replicas(MetricType.AVERAGE_VALUE, value=value, target=target, current=current) == expected


@pytest.mark.parametrize(
    ("value", "target", "current", "expected"),
    [
        pytest.param(50.0, 50.0, 3, 3, id="on-target"),
        pytest.param(100.0, 50.0, 2, 4, id="double"),
        pytest.param(25.0, 50.0, 4, 2, id="half"),
        pytest.param(52.0, 50.0, 3, 3, id="4pct-over-kept"),
        pytest.param(56.0, 50.0, 3, 4, id="12pct-over-scales"),
        pytest.param(46.0, 50.0, 5, 5, id="8pct-under-kept"),
        pytest.param(40.0, 50.0, 5, 4, id="20pct-under-scales"),
        pytest.param(90.0, 80.0, 1, 2, id="max-of-percent-from-one"),
        pytest.param(0.0, 50.0, 3, 0, id="zero"),
        pytest.param(100.0, 50.0, 0, 2, id="current-zero-counts-as-one"),
    ],
)
def test_value(value: float, target: float, current: int, expected: int) -> None:
    """Value: ceil(current * value / target), unless value is within 10% of the target."""
    assert desired_replicas(MetricType.VALUE, value=value, target=target, current=current) == expected


@pytest.mark.parametrize("metric_type", list(MetricType), ids=str)
def test_average_value_and_value_agree_at_one_replica(metric_type: MetricType) -> None:
    """From one replica both metric types propose the same count."""
    assert desired_replicas(metric_type, value=250.0, target=70.0, current=1) == 4


@pytest.mark.parametrize("target", [0.0, -1.0])
@pytest.mark.parametrize("metric_type", list(MetricType), ids=str)
def test_target_must_be_positive(metric_type: MetricType, target: float) -> None:
    """A target of 0 or less has no replica count (KEDA refuses such a target too)."""
    with pytest.raises(ValueError, match="target must be > 0"):
        desired_replicas(metric_type, value=10.0, target=target, current=1)
