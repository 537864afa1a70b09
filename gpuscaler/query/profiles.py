"""Defaults per workload profile (a metric's own defaults are in ``gpu_metrics.METRICS``); the docs' tables match.

``PROFILES`` scale on a GPU metric; ``SIGNAL_PROFILES`` on engine signals (docs/engines.md).

The four plain profiles scale on ``gpu_utilization``, which every NVIDIA GPU reports. Each has a ``-gpm`` twin
that scales on GPM's ``sm_active`` instead: a better signal (the share of SMs at work, not a duty cycle that
one small kernel fills), but only on Hopper and newer. A ``-gpm`` profile never falls back to the duty cycle
on an older GPU, because a sum that mixes two metrics with different scales would be a number nobody set a
target for; it fails with FAILED_PRECONDITION naming the plain profile instead (docs/profiles.md).
``distributed-training`` has no twin: it scales on NVLink traffic, which the agent reads from GPM on Hopper and
from NVML's older counters before it, so it is the same metric on every GPU that has NVLink.

KEDA's default metricType is AverageValue, where the HPA computes desired = ceil(value / target)
regardless of the current replica count. So the defaults SUM (``aggregation``) and the target is what ONE
replica should carry (docs/hpa.md, "The rule"). With a pod selection each pod's GPUs are first reduced by
``podAggregation`` (default avg) and the pods' values summed: 2 pods, each on 4 GPUs averaging 90%, give 180,
and with target 70 ceil(180 / 70) = 3 replicas. Without one, each GPU is its own value, one replica's worth
only with one GPU per replica: 4 GPUs at 90% give ceil(360 / 70) = 6. A max or an average of percentages would
cap the HPA at ceil(100 / target) replicas, which is the prior art's bug. Temperature is the exception: a sum
of temperatures means nothing, so it takes the max and is meant for `metricType: Value` or as a guard.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from gpuscaler.model.aggregation import Aggregation, WindowFunction
from gpuscaler.model.engines import EngineMetric
from gpuscaler.model.gpu_metrics import Metric

DEFAULT_METRIC = Metric.GPU_UTILIZATION
GPM_SUFFIX = "-gpm"


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
        # The GPM twins: the same windows and hysteresis, on the share of SMs at work. Targets are lower than
        # the duty cycle's because sm_active reaches 100% only when every SM is busy for the whole interval.
        Profile(
            name="vllm-inference-gpm",
            metric=Metric.SM_ACTIVE,
            aggregation=Aggregation.SUM,
            target=50.0,
            activation_threshold=5.0,
            deactivation_threshold=1.0,
            window_seconds=30.0,
            window_function=WindowFunction.AVG,
            why=(
                "continuous batching keeps one small batch in flight, which already reads ~100% duty cycle; "
                "the share of busy SMs keeps rising with the batch, so replicas follow load, not mere activity"
            ),
        ),
        Profile(
            name="triton-inference-gpm",
            metric=Metric.SM_ACTIVE,
            aggregation=Aggregation.SUM,
            target=55.0,
            activation_threshold=10.0,
            deactivation_threshold=2.0,
            window_seconds=15.0,
            window_function=WindowFunction.AVG,
            why=(
                "dynamic batching turns request rate into larger batches, which fill more SMs rather than more "
                "time; sm_active sees that, the duty cycle saturates at the first steady trickle"
            ),
        ),
        Profile(
            name="training-gpm",
            metric=Metric.SM_ACTIVE,
            aggregation=Aggregation.SUM,
            target=70.0,
            activation_threshold=10.0,
            deactivation_threshold=1.0,
            window_seconds=120.0,
            window_function=WindowFunction.AVG,
            why=(
                "a data-starved job launches small kernels that keep the duty cycle high while most SMs idle; "
                "sm_active tells a job that computes from one that waits"
            ),
        ),
        Profile(
            name="batch-gpm",
            metric=Metric.SM_ACTIVE,
            aggregation=Aggregation.SUM,
            target=65.0,
            activation_threshold=1.0,
            deactivation_threshold=0.0,
            window_seconds=60.0,
            window_function=WindowFunction.MAX,
            why=(
                "the batch profile's packing and minute-long memory, on the share of SMs at work: a worker that "
                "fills a GPU's SMs counts more than one that keeps a single SM busy"
            ),
        ),
        # No -gpm twin: NVLink traffic is one metric whether GPM or the older counters read it.
        Profile(
            name="distributed-training",
            metric=Metric.NVLINK_TX,
            aggregation=Aggregation.SUM,
            target=50000.0,
            activation_threshold=5000.0,
            deactivation_threshold=500.0,
            window_seconds=60.0,
            window_function=WindowFunction.AVG,
            why=(
                "data- and tensor-parallel jobs exchange gradients and activations over NVLink every step, so its "
                "traffic follows the work the job does across GPUs; a 60 s average spans many steps and rides out "
                "the quiet of a checkpoint, and the prior art's target of 50000 MB/s is one replica's share"
            ),
        ),
    )
}


@dataclass(frozen=True, slots=True)
class SignalProfile:
    """Defaults for scaling on engine signals: one signal and its target, or several combined (``signals``)."""

    name: str
    signals: tuple[tuple[Metric | EngineMetric, float], ...]
    activation_threshold: float
    deactivation_threshold: float
    why: str


# Activation at 0: a replica starts with the first request queued, and the last goes when nothing is.
SIGNAL_PROFILES: Mapping[str, SignalProfile] = {
    profile.name: profile
    for profile in (
        SignalProfile(
            "vllm-queue",
            ((EngineMetric.VLLM_QUEUE, 8.0),),
            0.0,
            0.0,
            "requests waiting for a slot in the batch: the load a replica cannot take, whatever VRAM says",
        ),
        SignalProfile(
            "vllm-kv-cache",
            ((EngineMetric.VLLM_KV_CACHE, 80.0),),
            0.0,
            0.0,
            "the KV cache fills before the queue grows when prompts are long; 80% keeps room for preemption",
        ),
        SignalProfile(
            "vllm-saturation",
            ((EngineMetric.VLLM_QUEUE, 8.0), (EngineMetric.VLLM_KV_CACHE, 80.0)),
            0.0,
            0.0,
            "whichever of the queue and the KV cache asks for more replicas: short prompts queue, long ones fill "
            "the cache",
        ),
        SignalProfile(
            "triton-queue-wait",
            ((EngineMetric.TRITON_QUEUE_WAIT, 100.0),),
            0.0,
            0.0,
            "how long a finished request waited before it ran: dynamic batching hides load until it waits",
        ),
        SignalProfile(
            "triton-request-rate",
            ((EngineMetric.TRITON_REQUEST_RATE, 50.0),),
            0.0,
            0.0,
            "requests finished per second, for models whose cost per request is known",
        ),
        SignalProfile(
            "sglang-queue",
            ((EngineMetric.SGLANG_QUEUE, 8.0),),
            0.0,
            0.0,
            "requests in SGLang's waiting queue, as vllm-queue for vLLM",
        ),
        # Waking from zero: read at the EPP, which exists while the pool has no replica. Active while any request
        # is queued or running there, so that KEDA's cooldown cannot take the pool to zero mid-request.
        SignalProfile(
            "epp-wake",
            ((EngineMetric.EPP_QUEUE, 8.0), (EngineMetric.EPP_RUNNING, 32.0)),
            0.0,
            0.0,
            "the pool's demand at its EPP: the first request queued wakes it, and a request still queued or "
            "running keeps it awake",
        ),
    )
}
# The prior art's profile names that mean one of ours.
PROFILE_ALIASES: Mapping[str, str] = {"vllm-queue-depth": "vllm-queue"}
