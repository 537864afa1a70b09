"""Defaults per workload profile (a metric's own defaults are in ``gpu_metrics.METRICS``); the docs' tables match.

KEDA's default metricType is AverageValue, where the HPA computes desired = ceil(value / target)
regardless of the current replica count. So the defaults return the SUM over the selected GPUs and
the target is what ONE GPU (one replica) should carry: 4 GPUs at 90% with target 70 give
ceil(360 / 70) = 6 replicas. A max or an average of percentages would cap the HPA at
ceil(100 / target) replicas, which is the prior art's bug. Temperature is the exception: a sum of
temperatures means nothing, so it takes the max and is meant for `metricType: Value` or as a guard.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from gpuscaler.aggregation import Aggregation, WindowFunction
from gpuscaler.gpu_metrics import Metric

DEFAULT_METRIC = Metric.GPU_UTILIZATION


@dataclass(frozen=True, slots=True)
class Profile:
    """A workload's defaults. Any metadata key overrides them (activationThreshold alone sets both thresholds)."""

    name: str
    metric: Metric
    aggregation: Aggregation
    target: float
    activation_threshold: float
    deactivation_threshold: float
    window_seconds: float | None
    window_function: WindowFunction
    why: str


PROFILES: Mapping[str, Profile] = {
    profile.name: profile
    for profile in (
        Profile(
            name="vllm-inference",
            metric=Metric.GPU_UTILIZATION,
            aggregation=Aggregation.SUM,
            target=70.0,
            activation_threshold=5.0,
            deactivation_threshold=1.0,
            window_seconds=30.0,
            window_function=WindowFunction.AVG,
            why=(
                "vLLM pre-allocates ~90% of VRAM at start, so memory never follows load; SM busy time does, "
                "and a 30 s average smooths the duty cycle of continuous batching"
            ),
        ),
        Profile(
            name="triton-inference",
            metric=Metric.GPU_UTILIZATION,
            aggregation=Aggregation.SUM,
            target=75.0,
            activation_threshold=10.0,
            deactivation_threshold=2.0,
            window_seconds=15.0,
            window_function=WindowFunction.AVG,
            why=(
                "Triton's dynamic batching keeps models resident (memory is flat) and turns request rate "
                "into SM busy time; a shorter window follows bursty traffic"
            ),
        ),
        Profile(
            name="training",
            metric=Metric.GPU_UTILIZATION,
            aggregation=Aggregation.SUM,
            target=90.0,
            activation_threshold=10.0,
            deactivation_threshold=1.0,
            window_seconds=120.0,
            window_function=WindowFunction.AVG,
            why=(
                "a healthy training job keeps GPUs near 100%; a 2 min average rides out evaluation and "
                "checkpoint pauses so workers are not removed mid-epoch"
            ),
        ),
        Profile(
            name="batch",
            metric=Metric.GPU_UTILIZATION,
            aggregation=Aggregation.SUM,
            target=85.0,
            activation_threshold=1.0,
            deactivation_threshold=0.0,
            window_seconds=60.0,
            window_function=WindowFunction.MAX,
            why=(
                "batch wants GPUs packed and stays active while any GPU did any work in the last minute, "
                "so a queue's workers are not scaled to zero between items"
            ),
        ),
    )
}
