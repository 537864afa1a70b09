"""KEDA's ``fallback`` holds a busy Deployment when gpuscaler cannot see its GPUs, instead of scaling it in.

"I don't know" must reach KEDA as an error: a made-up 0 or ``false`` would take the Deployment to 0 after the
cooldown. Each test first scales to a count different from the fallback's, then takes the signal away and expects
the fallback count, held past the cooldown and several polling intervals.
"""

from __future__ import annotations

import signal
import time

from e2e.keda.scenario import Scenario, expected_replicas, scaled_object
from e2e.support.process import Process
from gpuscaler.client.hpa import MetricType

POLLING_SECONDS = 2
COOLDOWN_SECONDS = 5
FAILURE_THRESHOLD = 2
# Above every count the tests reach first: the HPA scales up at once, but holds a scale-down for 5 minutes.
FALLBACK_REPLICAS = 7
TARGET = 40.0
# Long enough for a wrong 0 to show: the cooldown plus several polls past the moment fallback applied.
HOLD_SECONDS = COOLDOWN_SECONDS + 4 * POLLING_SECONDS


async def scale_up_then_lose(scenario: Scenario, scaler: Process, metadata: dict[str, str], value: float) -> float:
    """Applies the ScaledObject, waits for the HPA's count from ``value``; returns that count's time."""
    history = await scenario.deployment("trainer")
    await scenario.apply(
        scaled_object(
            "trainer",
            trigger="external",
            metadata=metadata,
            polling_seconds=POLLING_SECONDS,
            cooldown_seconds=COOLDOWN_SECONDS,
            fallback={"failureThreshold": FAILURE_THRESHOLD, "replicas": FALLBACK_REPLICAS},
        )
    )
    await scenario.wait_ready("trainer")
    measured = await scenario.wait_value(scaler, metadata, value)
    expected = expected_replicas(MetricType.AVERAGE_VALUE, value=measured, target=TARGET, current=1, maximum=10)
    assert expected < FALLBACK_REPLICAS, "choose a value whose count is below the fallback's"
    return await history.wait_equal(expected, 90)


async def expect_fallback(scenario: Scenario, since: float) -> None:
    """The Deployment reaches the fallback count within 60 s of ``since`` and holds it past the cooldown."""
    history = scenario.histories[0]
    reached = await history.wait_equal(FALLBACK_REPLICAS, 60, after=since)
    await history.hold(FALLBACK_REPLICAS, HOLD_SECONDS)
    scenario.record(f"fallback {FALLBACK_REPLICAS} {reached - since:.1f} s after the signal went; {history.describe()}")


async def test_a_killed_agent_holds_the_replicas(scenario: Scenario) -> None:
    """SIGKILL the only agent: KEDA cannot connect, and the Deployment keeps its count past the cooldown.

    Not the fallback count: with the scaler unreachable, KEDA 2.21 gets no metric spec, so neither the HPA's fallback
    metric nor its polling loop apply ``fallback`` (pkg/scaling/scale_handler.go); the HPA keeps the count it had.
    The fallback count needs a scaler that answers with an error: the two tests below.
    """
    agent = await scenario.agent("node-1")
    metadata = {"scalerAddress": f"127.0.0.1:{agent.port}", "metric": "gpu_utilization", "targetValue": f"{TARGET:g}"}
    await scenario.fake_set(agent, "all", gpu_utilization=90)
    await scale_up_then_lose(scenario, agent, metadata, 180.0)
    history = scenario.histories[0]
    held = history.current
    assert held is not None
    scenario.kill(agent)
    await history.hold(held, HOLD_SECONDS)
    scenario.record(f"agent killed: held at {held} for {HOLD_SECONDS} s; {history.describe()}")


async def test_a_lost_gpu_answers_unavailable_and_gets_the_fallback(scenario: Scenario) -> None:
    """A GPU that stops reading on a live agent is UNAVAILABLE to KEDA, never 0: the fallback count applies."""
    agent = await scenario.agent("node-1")
    metadata = {
        "scalerAddress": f"127.0.0.1:{agent.port}",
        "metric": "gpu_utilization",
        "gpuUUID": "GPU-fake-node-1-0",
        "targetValue": f"{TARGET:g}",
    }
    await scenario.fake_set(agent, 0, gpu_utilization=95)
    await scale_up_then_lose(scenario, agent, metadata, 95.0)
    lost = time.monotonic()
    await scenario.fake_fail(agent, 0, "lost")
    await expect_fallback(scenario, lost)
    # What KEDA got, asked the same way: an error that names the GPU, never a 0.
    answer = await scenario.query(agent, metadata)
    assert answer["get_metrics"]["code"] == "UNAVAILABLE", answer["get_metrics"]
    assert "GPU-fake-node-1-0" in answer["get_metrics"]["message"], answer["get_metrics"]


async def test_a_silent_busy_node_behind_the_gateway_gets_the_fallback(scenario: Scenario) -> None:
    """The only busy node's agent goes silent (SIGSTOP) behind the gateway: fallback, not 0 (issue 9's fix)."""
    busy = await scenario.agent("node-busy")
    idle = await scenario.agent("node-idle")
    gateway = await scenario.gateway([busy, idle])
    metadata = {
        "scalerAddress": f"127.0.0.1:{gateway.port}",
        "metric": "gpu_utilization",
        "targetValue": f"{TARGET:g}",
    }
    await scenario.fake_set(busy, "all", gpu_utilization=95)
    await scale_up_then_lose(scenario, gateway, metadata, 190.0)
    lost = time.monotonic()
    scenario.pause(busy, signal.SIGSTOP)
    try:
        await expect_fallback(scenario, lost)
    finally:
        scenario.pause(busy, signal.SIGCONT)
