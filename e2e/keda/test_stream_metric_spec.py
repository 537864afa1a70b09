"""What KEDA 2.21's StreamMetricSpec changes when every gateway is unreachable: measured for both trigger types.

Our gateway serves StreamMetricSpec. Each test scales a Deployment to a known count through a real gateway, either
directly ("streamed": KEDA opens the gateway's own StreamMetricSpec) or behind a test-only scaler that passes the
other calls through and answers StreamMetricSpec UNIMPLEMENTED, as the gateway did before ("unimplemented",
e2e/support/stream_metric_spec.py), then makes every scaler unreachable and watches the Deployment's replicas and
the ScaledObject's fallback condition and failure count over a bounded window, with the failureThreshold of
test_fallback.py (2) and with 0. The outcomes are the same in every case but one: external-push, streamed,
failureThreshold 0, where the fallback applies. docs/gateway.md gives the table; these tests fail if a KEDA release
(or the gateway) changes any of the eight.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from dataclasses import dataclass, field

import pytest

from e2e.keda.scenario import Scenario, expected_replicas, scaled_object
from e2e.support.process import Process
from gpuscaler.client.hpa import MetricType

POLLING_SECONDS = 2
COOLDOWN_SECONDS = 5
FAILURE_THRESHOLD = 2
# Above the count the tests reach first, as in test_fallback.py: a fallback that applied would show as a step up.
FALLBACK_REPLICAS = 7
TARGET = 40.0
VALUE = 180.0
# The cooldown plus several polls and HPA syncs: long enough for a fallback, a scale-in or a growing failure count.
WINDOW_SECONDS = COOLDOWN_SECONDS + 4 * POLLING_SECONDS
SAMPLE_SECONDS = 0.25


@dataclass
class Observed:
    """What the window saw: every replica count, every Fallback condition status, the most failures counted."""

    replicas: set[int] = field(default_factory=set)
    fallback: set[str] = field(default_factory=set)
    most_failures: int = 0
    conditions: dict[str, str] = field(default_factory=dict)

    def describe(self) -> str:
        return (
            f"replicas {sorted(self.replicas)}, Fallback {sorted(self.fallback)}, "
            f"numberOfFailures up to {self.most_failures}, conditions at the end {self.conditions}"
        )


async def observe(scenario: Scenario, name: str, seconds: float) -> Observed:
    """Samples the Deployment's replicas and the ScaledObject's status for ``seconds``: a bounded hold."""
    history = scenario.histories[0]
    seen = Observed()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if history.current is not None:
            seen.replicas.add(history.current)
        status = ((await scenario.scaled_object(name)) or {}).get("status") or {}
        seen.conditions = {str(c.get("type")): str(c.get("status")) for c in status.get("conditions") or []}
        seen.fallback.add(seen.conditions.get("Fallback", "absent"))
        for health in (status.get("health") or {}).values():
            seen.most_failures = max(seen.most_failures, int(health.get("numberOfFailures") or 0))
        await asyncio.sleep(SAMPLE_SECONDS)
    return seen


@pytest.mark.parametrize("streamed", [False, True], ids=["unimplemented", "streamed"])
@pytest.mark.parametrize("trigger", ["external", "external-push"])
@pytest.mark.parametrize("threshold", [FAILURE_THRESHOLD, 0], ids=lambda value: f"threshold-{value}")
async def test_unreachable_scalers_with_and_without_stream_metric_spec(
    scenario: Scenario, trigger: str, streamed: bool, threshold: int
) -> None:
    """Every scaler unreachable: the HPA keeps its count, but for external-push, streamed, failureThreshold 0."""
    agent = await scenario.agent("node-1")
    gateway = await scenario.gateway([agent])
    refusing = None if streamed else await unimplemented_scaler(scenario, gateway)
    port = (refusing or gateway).port
    metadata = {"scalerAddress": f"127.0.0.1:{port}", "metric": "gpu_utilization", "targetValue": f"{TARGET:g}"}
    await scenario.fake_set(agent, "all", gpu_utilization=90)
    held = await scale_up(scenario, gateway, trigger, metadata, threshold)
    if trigger == "external-push":
        # KEDA has the spec (streamed) or has given the stream up (UNIMPLEMENTED) before the scalers die.
        await wait_event(gateway if streamed else refusing, "spec_stream_opened" if streamed else "stream_refused")
    # Every scaler KEDA can reach dies at once, as in test_fallback.py's killed agent.
    lost = time.monotonic()
    scenario.kill(gateway)
    if refusing is not None:
        scenario.kill(refusing)
    seen = await observe(scenario, "trainer", WINDOW_SECONDS)
    opened = len(gateway.events("spec_stream_opened")) + (
        0 if refusing is None else len(refusing.events("stream_refused"))
    )
    scenario.record(
        f"{trigger}, failureThreshold {threshold}, StreamMetricSpec {'streamed' if streamed else 'unimplemented'} "
        f"({opened} streams opened): "
        f"{time.monotonic() - lost:.1f} s unreachable: {seen.describe()}; {scenario.histories[0].describe()}"
    )
    # KEDA opens the stream only for external-push (pkg/scalers/external_scaler.go: only externalPushScaler runs it).
    assert (opened > 0) == (trigger == "external-push"), f"{trigger}: {opened} StreamMetricSpec streams"
    if trigger == "external-push" and streamed and threshold == 0:
        # The one outcome StreamMetricSpec changes: KEDA still holds the streamed spec, so it asks for the metric,
        # counts the failure, and with failureThreshold 0 applies the fallback at once; a fallback is no error, so
        # KEDA does not clear the scalers cache and the spec stays: every poll after it counts one more failure.
        assert max(seen.replicas) == FALLBACK_REPLICAS, seen.describe()
        assert min(seen.replicas) == held, seen.describe()
        assert "True" in seen.fallback, seen.describe()
        assert seen.most_failures > 2, seen.describe()
    else:
        # Every other case: the count the HPA had. At most one failure is counted: the call in flight when the
        # scalers died (a spec fetched just before), or the streamed spec's first use; the error then clears KEDA's
        # scalers cache and, with no spec, nothing more is counted. At threshold 0 that one failure sets the
        # Fallback condition (seen once in two runs without a stream) but the HPA never gets the fallback count.
        assert seen.replicas == {held}, seen.describe()
        assert seen.most_failures <= 1, seen.describe()
        if threshold > 0:
            assert "True" not in seen.fallback, seen.describe()


async def scale_up(scenario: Scenario, gateway: Process, trigger: str, metadata: dict[str, str], threshold: int) -> int:
    """Applies the ScaledObject and waits for the HPA's count from ``VALUE``, below the fallback's; returns it."""
    history = await scenario.deployment("trainer")
    await scenario.apply(
        scaled_object(
            "trainer",
            trigger=trigger,
            metadata=metadata,
            polling_seconds=POLLING_SECONDS,
            cooldown_seconds=COOLDOWN_SECONDS,
            fallback={"failureThreshold": threshold, "replicas": FALLBACK_REPLICAS},
        )
    )
    await scenario.wait_ready("trainer")
    direct = {**metadata, "scalerAddress": f"127.0.0.1:{gateway.port}"}
    measured = await scenario.wait_value(gateway, direct, VALUE)
    expected = expected_replicas(MetricType.AVERAGE_VALUE, value=measured, target=TARGET, current=1, maximum=10)
    assert expected < FALLBACK_REPLICAS, "choose a value whose count is below the fallback's"
    await history.wait_equal(expected, 90)
    return expected


async def unimplemented_scaler(scenario: Scenario, gateway: Process) -> Process:
    """The test-only scaler in front of ``gateway`` that answers StreamMetricSpec UNIMPLEMENTED, as a process of
    this scenario."""
    argv = [sys.executable, "-m", "e2e.support.stream_metric_spec", "--upstream-port", str(gateway.port)]
    process = Process(
        argv, scenario.directory / "unimplemented-scaler.log", dict(os.environ), "unimplemented_spec_scaler_started"
    )
    await asyncio.to_thread(process.start)
    scenario.processes.append(process)
    return process


async def wait_event(process: Process | None, event: str) -> None:
    """Waits until ``process`` has logged ``event`` (KEDA's StreamMetricSpec opened or refused), within 30 s."""
    assert process is not None
    deadline = time.monotonic() + 30
    while not process.events(event):
        assert time.monotonic() < deadline, f"KEDA's StreamMetricSpec: no {event} within 30 s"
        await asyncio.sleep(0.1)
