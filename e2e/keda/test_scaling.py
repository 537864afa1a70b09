"""The real KEDA scales Deployments off gpuscaler: 0 -> 1 on activation, 1 -> N by the HPA, back to 0 after cooldown.

Each test runs two ScaledObjects side by side against one agent (or a gateway in front of it), with no pod selection,
so that each GPU is its own value (docs/hpa.md, "The rule", 2.): one with KEDA's default ``metricType: AverageValue``
on the sum over the GPUs, one with ``metricType: Value`` on their average. The expected
replica counts come from ``gpuscaler.client.hpa`` (the HPA's formula) and the value ``gpuscaler query`` reads, not from
constants.
"""

from __future__ import annotations

import time

import pytest

from e2e.keda.scenario import Scenario, expected_replicas, scaled_object
from gpuscaler.client.hpa import MetricType

# external-push: a long polling interval, so a 0 -> 1 within PUSH_BOUND_SECONDS was the push, not a poll.
PUSH_POLLING_SECONDS = 30
PUSH_BOUND_SECONDS = 5.0
POLL_POLLING_SECONDS = 2
COOLDOWN_SECONDS = 5
BUSY = 95.0
AVERAGE_TARGET = 40.0
VALUE_TARGET = 15.0
VALUE_MAX_REPLICAS = 8
# Scale-up as fast as the HPA computes (its default allows +4 pods or +100% per 15 s), so each step is one sync.
FAST_SCALE_UP = {
    "horizontalPodAutoscalerConfig": {
        "behavior": {
            "scaleUp": {
                "stabilizationWindowSeconds": 0,
                "policies": [{"type": "Percent", "value": 1000, "periodSeconds": 1}],
            }
        }
    }
}


@pytest.mark.parametrize("trigger", ["external-push", "external"])
@pytest.mark.parametrize("via", ["agent", "gateway"])
async def test_activation_hpa_steps_and_cooldown(scenario: Scenario, via: str, trigger: str) -> None:
    """A busy GPU takes both Deployments 0 -> 1 -> the HPA's count; an idle one takes them back to 0."""
    agent = await scenario.agent("node-1")
    scaler = agent if via == "agent" else await scenario.gateway([agent])
    address = f"127.0.0.1:{scaler.port}"
    polling = PUSH_POLLING_SECONDS if trigger == "external-push" else POLL_POLLING_SECONDS
    average_metadata = {
        "scalerAddress": address,
        "metric": "gpu_utilization",
        "targetValue": f"{AVERAGE_TARGET:g}",
        "activationThreshold": "20",
    }
    value_metadata = {**average_metadata, "aggregation": "avg", "targetValue": f"{VALUE_TARGET:g}"}
    summed = await scenario.deployment("summed")
    averaged = await scenario.deployment("averaged")
    for name, metadata, metric_type, maximum in (
        ("summed", average_metadata, MetricType.AVERAGE_VALUE, 10),
        ("averaged", value_metadata, MetricType.VALUE, VALUE_MAX_REPLICAS),
    ):
        document = scaled_object(
            name,
            trigger=trigger,
            metadata=metadata,
            metric_type=metric_type,
            max_replicas=maximum,
            polling_seconds=polling,
            cooldown_seconds=COOLDOWN_SECONDS,
        )
        document["spec"]["advanced"] = FAST_SCALE_UP
        await scenario.apply(document)
    for name in ("summed", "averaged"):
        await scenario.wait_ready(name)
    # Idle GPUs: KEDA has asked (the ScaledObjects are Ready) and left both at zero.
    assert summed.steps == [0], summed.describe()
    assert averaged.steps == [0], averaged.describe()

    invoked = time.monotonic()
    await scenario.fake_set(agent, 0, gpu_utilization=BUSY)
    first_summed, replicas = await summed.wait_for(lambda r: r > 0, polling + 30, "> 0", after=invoked)
    assert replicas == 1, f"KEDA's activation goes to 1 first; steps: {summed.describe()}"
    first_averaged, replicas = await averaged.wait_for(lambda r: r > 0, polling + 30, "> 0", after=invoked)
    assert replicas == 1, f"KEDA's activation goes to 1 first; steps: {averaged.describe()}"
    # From the moment `gpuscaler fake set` starts (its own start-up, ~0.4 s, included): replicas can change before
    # the command has exited, so its return is no useful start.
    latency = max(first_summed, first_averaged) - invoked
    scenario.record(f"0 -> 1 {latency:.2f} s after `gpuscaler fake set` was invoked, pollingInterval {polling} s")
    if trigger == "external-push":
        assert latency < PUSH_BOUND_SECONDS, f"0 -> 1 took {latency:.1f}s: not the push (polling every {polling}s)"

    # AverageValue on the sum: ceil(value / target), whatever the current count, so it settles there.
    summed_value = await scenario.wait_value(scaler, average_metadata, BUSY)
    expected_summed = expected_replicas(
        MetricType.AVERAGE_VALUE, value=summed_value, target=AVERAGE_TARGET, current=1, maximum=10
    )
    await summed.wait_equal(expected_summed, 60, after=first_summed)
    await summed.hold(expected_summed, 4)
    # Value on the average: ceil(ready pods x value / target), so the first step is from one ready pod and it keeps
    # multiplying until maxReplicaCount while the ratio stays above the HPA's tolerance.
    averaged_value = await scenario.wait_value(scaler, value_metadata, BUSY / 2)
    first_step = expected_replicas(
        MetricType.VALUE, value=averaged_value, target=VALUE_TARGET, current=1, maximum=VALUE_MAX_REPLICAS
    )
    await averaged.wait_equal(VALUE_MAX_REPLICAS, 60)
    hpa_steps = averaged.steps[averaged.steps.index(1) + 1 :]
    assert hpa_steps[0] == first_step, f"the HPA's first step from 1 ready pod: {averaged.describe()}"
    assert hpa_steps == sorted(hpa_steps), f"Value only grows under a constant load: {averaged.describe()}"
    scenario.record(
        f"AverageValue (value {summed_value:g}, target {AVERAGE_TARGET:g}): {summed.describe()}; "
        f"Value (value {averaged_value:g}, target {VALUE_TARGET:g}, max {VALUE_MAX_REPLICAS}): {averaged.describe()}"
    )

    idle = time.monotonic()
    await scenario.fake_set(agent, 0, gpu_utilization=0)
    bound = polling + COOLDOWN_SECONDS + 30
    at_zero = [await history.wait_equal(0, bound, after=idle) for history in (summed, averaged)]
    scenario.record(f"back to 0 {max(at_zero) - idle:.1f} s after the GPU went idle (cooldown {COOLDOWN_SECONDS} s)")
