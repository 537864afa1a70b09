"""Two triggers a user gets wrong, as the real KEDA meets them: each is told apart where the user looks.

An engine signal sent to a node agent can never answer (engines are read by the gateway from the workload's pods),
so the agent refuses it at GetMetricSpec: KEDA makes no HPA, and its log carries the agent's one message. A
workload name nothing carries answers 0, as a workload at zero replicas must; the gateway names the ScaledObject
KEDA asked for (from KEDA's own ScaledObjectRef) in its log and its metric, and the answer KEDA scales on is unchanged.
"""

from __future__ import annotations

import asyncio
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import yaml

from e2e.keda.scenario import Scenario, directory_entry, scaled_object
from e2e.support.process import Process
from gpuscaler.signals.empty_selection import Seen
from tests.fakes.fake_kubelet import Assignment

# How long KEDA is given to (not) make an HPA: its reconcile retries within seconds of a failed one.
NO_HPA_SECONDS = 15.0


async def _wait_for(what: str, found: Callable[[], bool], timeout: float) -> None:
    """Polls ``found`` (off the loop: it reads files and sockets) until true; fails saying ``what`` otherwise."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await asyncio.to_thread(found):
            return
        await asyncio.sleep(0.2)
    raise AssertionError(f"{what} within {timeout:g}s")


async def test_an_engine_signal_at_an_agent_is_refused_before_keda_makes_an_hpa(scenario: Scenario) -> None:
    """GetMetricSpec fails with the agent's message, so KEDA never creates the HPA and says why in its log."""
    history = await scenario.deployment("llm", replicas=1)
    agent = await scenario.agent("node-1")
    metadata = {"scalerAddress": f"127.0.0.1:{agent.port}", "metric": "vllm_queue", "workload": "llm"}
    await scenario.apply(scaled_object("llm", trigger="external", metadata=metadata, min_replicas=1))
    operator = next(daemon for daemon in scenario.plane.daemons if daemon.name == "keda-operator")

    def refused() -> bool:
        return (
            "FailedPrecondition" in operator.log_text()
            and "the gateway reads it from the metrics pages" in operator.log_text()
        )

    await _wait_for("KEDA's operator log did not carry the agent's refusal", refused, NO_HPA_SECONDS)
    await history.hold(1, 3)
    hpa = await scenario.get(
        f"/apis/autoscaling/v2/namespaces/{scenario.namespace}/horizontalpodautoscalers/keda-hpa-llm"
    )
    assert hpa is None, "KEDA made an HPA for a trigger the agent refuses"
    found = await scenario.scaled_object("llm")
    ready = [c for c in (found or {}).get("status", {}).get("conditions", []) if c.get("type") == "Ready"]
    assert ready, found
    assert ready[0]["status"] != "True", ready
    scenario.record(f"engine signal at an agent: no HPA, Ready {ready[0]['status']} ({ready[0].get('reason')})")


def _selection_empty_series(gateway: Process) -> list[str]:
    (started,) = gateway.events("gateway_started")
    with urllib.request.urlopen(f"http://127.0.0.1:{started['metrics_port']}/metrics", timeout=5) as response:
        text = response.read().decode()
    return [line for line in text.splitlines() if line.startswith("gpuscaler_gateway_selection_empty{")]


async def test_a_workload_name_nothing_carries_is_named_for_keda_s_scaled_object(
    scenario: Scenario, tmp_path: Path
) -> None:
    """workload: trainr holds at 0 replicas, as KEDA must; the gateway logs and exports ScaledObject trainer by the
    name KEDA sent, with trainer as the name it may have meant; fixing the name scales it and clears both."""
    trainer_history = await scenario.deployment("trainer", replicas=1)
    (pod,) = await scenario.wait_pods("trainer", 1)
    pods_file = tmp_path / "pods.yaml"
    pods_file.write_text(yaml.safe_dump({"pods": [directory_entry(pod, "trainer")]}))
    kubelet = await scenario.kubelet()
    kubelet.assign([Assignment(scenario.namespace, pod["metadata"]["name"], ("GPU-fake-node-1-0",))])
    agent = await scenario.agent("node-1", gpus=1, kubelet=kubelet)
    gateway = await scenario.gateway([agent], pod_directory=pods_file)
    await scenario.fake_set(agent, 0, gpu_utilization=90)

    # A second Deployment that the typo'd ScaledObject scales, so that "trainer" stays as it is.
    typo_history = await scenario.deployment("typo", replicas=0)
    metadata = {"scalerAddress": f"127.0.0.1:{gateway.port}", "workload": "trainr", "activationThreshold": "10"}
    await scenario.apply(scaled_object("typo", trigger="external", metadata=metadata, target="typo"))
    await scenario.wait_ready("typo")

    def logged() -> bool:
        return any(
            event.get("scaled_object") == f"{scenario.namespace}/typo"
            for event in gateway.events("selection_matches_nothing")
        )

    await _wait_for("the gateway did not log selection_matches_nothing for KEDA's ScaledObject", logged, 30)
    (event,) = [
        e for e in gateway.events("selection_matches_nothing") if e["scaled_object"] == f"{scenario.namespace}/typo"
    ]
    assert event["did_you_mean"] == ["trainer"], event
    series = await asyncio.to_thread(_selection_empty_series, gateway)
    assert any(
        'scaled_object="typo"' in line and f'namespace="{scenario.namespace}"' in line and f'seen="{Seen.NO}"' in line
        for line in series
    ), series
    # KEDA keeps polling: the answer stays 0 (the Deployment at 0) and the log says it once.
    await typo_history.hold(0, 5)
    assert (
        len([e for e in gateway.events("selection_matches_nothing") if e["scaled_object"] == event["scaled_object"]])
        == 1
    )

    await scenario.apply(
        scaled_object("typo", trigger="external", metadata={**metadata, "workload": "trainer"}, target="typo")
    )
    await typo_history.wait_for(lambda replicas: replicas >= 1, 60, "at least 1 once the name is right")

    def cleared() -> bool:
        return not any('scaled_object="typo"' in line for line in _selection_empty_series(gateway))

    # KEDA asks the fixed trigger under a new metric name; the old one's entry goes within a few polling intervals.
    scaled_up = time.monotonic()
    await _wait_for("the gateway still exported the ScaledObject as empty", cleared, 30)
    gone_after = time.monotonic() - scaled_up
    assert [e["metric_name"] for e in gateway.events("selection_no_longer_asked")] == [event["metric_name"]]
    assert trainer_history.current == 1
    scenario.record(
        f"workload trainr: held at 0, logged once, did you mean trainer; fixed: {typo_history.describe()}, "
        f"the old trigger's series gone {gone_after:.1f} s after the scale-up"
    )
