"""The replica count a Kubernetes HPA computes from an external metric (replica_calculator.go).

AverageValue (KEDA's default): desired = ceil(value / target), whatever the current count.
Value: desired = ceil(current * value / target). Both keep the current count while the usage ratio
is within the HPA's 10% tolerance. minReplicas/maxReplicas clamps are the HPA's and are not applied.
"""

from __future__ import annotations

import enum
import math

HPA_TOLERANCE = 0.1


class MetricType(enum.StrEnum):
    """The two target types of an HPA external metric, spelled as a ScaledObject's ``metricType`` spells them."""

    AVERAGE_VALUE = "AverageValue"
    VALUE = "Value"


def desired_replicas(metric_type: MetricType, *, value: float, target: float, current: int) -> int:
    """What the HPA would scale to from ``current`` replicas (``current`` >= 1; KEDA handles 0 -> 1)."""
    if target <= 0:
        raise ValueError("target must be > 0")
    current = max(current, 1)
    if metric_type is MetricType.AVERAGE_VALUE:
        ratio = value / (target * current)
        proposal = math.ceil(value / target)
    else:
        ratio = value / target
        proposal = math.ceil(ratio * current)
    if abs(ratio - 1.0) <= HPA_TOLERANCE:
        return current
    return proposal
