"""The real KEDA and HPA scale a Deployment on its engine's queue, read by the gateway from the Deployment's own pods.

The Deployment's pod is the real one its ReplicaSet created in the API server; the gateway's static pod directory
gives it a loopback IP and a ``prometheus.io/port`` annotation where a fake vLLM serves its metrics page in this
test's event loop (no kubelet runs pods here). The ScaledObject names no URL: only ``workload`` and the signal.
"""

from __future__ import annotations

import asyncio
import math
import time
from pathlib import Path

import yaml

from e2e.keda.control_plane import Json, free_port
from e2e.keda.scenario import Scenario, directory_entry, expected_replicas, scaled_object
from e2e.keda.test_fallback import FALLBACK_REPLICAS, expect_fallback
from e2e.support.process import Process
from gpuscaler.client.hpa import MetricType
from gpuscaler.model.engines import Engine
from tests.fakes.fake_engine import FakeEngine

TARGET = 8.0
QUEUED = 20.0
POLLING_SECONDS = 2
COOLDOWN_SECONDS = 5
# Both ways as fast as the HPA computes: a step is one sync (1 s here), so the latency measured is gpuscaler's
# and KEDA's, not the HPA's default 15 s scale-up period or 5 min scale-down window.
FAST_BOTH_WAYS = {
    "horizontalPodAutoscalerConfig": {
        "behavior": {
            direction: {
                "stabilizationWindowSeconds": 0,
                "policies": [{"type": "Percent", "value": 1000, "periodSeconds": 1}],
            }
            for direction in ("scaleUp", "scaleDown")
        }
    }
}


async def serving_llm(scenario: Scenario, tmp_path: Path, engine: FakeEngine) -> tuple[Process, dict[str, str]]:
    """Deployment llm with one pod whose engine is ``engine``, a gateway that knows the pod, and the trigger's
    metadata: the signal and the workload, no URL."""
    (pod,) = await scenario.wait_pods("llm", 1)
    entry = {**directory_entry(pod, "llm"), "ip": "127.0.0.1", "annotations": {"prometheus.io/port": str(engine.port)}}
    pods_file = tmp_path / "pods.yaml"
    pods_file.write_text(yaml.safe_dump({"pods": [entry]}))
    agent = await scenario.agent("node-1")
    gateway = await scenario.gateway([agent], pod_directory=pods_file)
    metadata = {
        "scalerAddress": f"127.0.0.1:{gateway.port}",
        "metric": "vllm_queue",
        "workload": "llm",
        "targetValue": f"{TARGET:g}",
    }
    return gateway, metadata


def llm_scaled_object(trigger: str, metadata: dict[str, str]) -> Json:
    """A ScaledObject for Deployment llm, from 1 replica, scaling each way as fast as the HPA computes."""
    document = scaled_object(
        "llm",
        trigger=trigger,
        metadata=metadata,
        min_replicas=1,
        polling_seconds=POLLING_SECONDS,
        cooldown_seconds=COOLDOWN_SECONDS,
    )
    document["spec"]["advanced"] = FAST_BOTH_WAYS
    return document


async def test_the_queue_scales_the_deployment_to_its_total_over_the_target_and_back(
    scenario: Scenario, tmp_path: Path
) -> None:
    """20 requests waiting at 8 per replica: the HPA gives ceil(20 / 8) = 3; an empty queue takes it back to 1."""
    history = await scenario.deployment("llm", replicas=1)
    engine = await FakeEngine(Engine.VLLM, {"waiting": 0.0}).start()
    try:
        gateway, metadata = await serving_llm(scenario, tmp_path, engine)
        await scenario.apply(llm_scaled_object("external-push", metadata))
        await scenario.wait_ready("llm")
        await history.hold(1, 3)  # an empty queue asks for nothing more

        queued = time.monotonic()
        engine.values["waiting"] = QUEUED
        value = await scenario.wait_value(gateway, {**metadata, "namespace": scenario.namespace}, QUEUED)
        expected = expected_replicas(MetricType.AVERAGE_VALUE, value=value, target=TARGET, current=1, maximum=10)
        assert expected == math.ceil(QUEUED / TARGET)
        reached = await history.wait_equal(expected, 60, after=queued)
        await history.hold(expected, 4)

        emptied = time.monotonic()
        engine.values["waiting"] = 0.0
        back = await history.wait_equal(1, 60, after=emptied)
        scenario.record(
            f"vllm_queue {QUEUED:g} at target {TARGET:g}: {expected} replicas {reached - queued:.1f} s after the queue "
            f"grew, 1 again {back - emptied:.1f} s after it emptied (pollingInterval {POLLING_SECONDS} s, scrape 1 s, "
            f"HPA sync 1 s); {history.describe()}"
        )
    finally:
        await engine.stop()


async def test_combined_signals_give_the_most_replicas_any_signal_asks_for(scenario: Scenario, tmp_path: Path) -> None:
    """vllm-saturation, docs/hpa.md's rows: 4 waiting and the cache at 90% ask for ceil(90 / 80) = 2 replicas
    (the cache wins); 20 waiting ask for ceil(20 / 8) = 3 (the queue wins)."""
    history = await scenario.deployment("llm", replicas=1)
    engine = await FakeEngine(Engine.VLLM, {"waiting": 4.0, "kv": 0.9}).start()
    try:
        gateway, metadata = await serving_llm(scenario, tmp_path, engine)
        combined = {"scalerAddress": metadata["scalerAddress"], "profile": "vllm-saturation", "workload": "llm"}
        await scenario.apply(llm_scaled_object("external", combined))
        await scenario.wait_ready("llm")
        steps = []
        for waiting, answer in ((4.0, 90 / 80), (20.0, 20 / 8)):
            engine.values["waiting"] = waiting
            value = await scenario.wait_value(gateway, {**combined, "namespace": scenario.namespace}, answer)
            expected = expected_replicas(MetricType.AVERAGE_VALUE, value=value, target=1.0, current=1, maximum=10)
            assert expected == math.ceil(answer)
            await history.wait_equal(expected, 60)
            steps.append(f"{waiting:g} waiting -> {value:g} -> {expected}")
        scenario.record(f"vllm-saturation: {'; '.join(steps)}; {history.describe()}")
    finally:
        await engine.stop()


async def test_a_pod_whose_engine_stops_answering_gets_the_fallback_not_a_scale_in(
    scenario: Scenario, tmp_path: Path
) -> None:
    """The only pod's engine dies with 20 queued: KEDA gets UNAVAILABLE naming the pod and applies the fallback."""
    history = await scenario.deployment("llm", replicas=1)
    engine = await FakeEngine(Engine.VLLM, {"waiting": QUEUED}).start()
    try:
        gateway, metadata = await serving_llm(scenario, tmp_path, engine)
        await scenario.apply(
            scaled_object(
                "llm",
                trigger="external",
                metadata=metadata,
                min_replicas=1,
                polling_seconds=POLLING_SECONDS,
                cooldown_seconds=COOLDOWN_SECONDS,
                fallback={"failureThreshold": 2, "replicas": FALLBACK_REPLICAS},
            )
        )
        await scenario.wait_ready("llm")
        expected = math.ceil(QUEUED / TARGET)
        assert expected < FALLBACK_REPLICAS
        await history.wait_equal(expected, 90)
    finally:
        await engine.stop()
    died = time.monotonic()
    await expect_fallback(scenario, died)
    answer = await scenario.query(gateway, {**metadata, "namespace": scenario.namespace})
    assert answer["get_metrics"]["code"] == "UNAVAILABLE", answer["get_metrics"]
    assert f"pod {scenario.namespace}/" in answer["get_metrics"]["message"], answer["get_metrics"]


async def test_the_pod_watch_reads_each_pod_at_the_ip_the_api_server_gives_it(scenario: Scenario) -> None:
    """No static directory: the gateway watches the real API server. The pods of Deployment llm get their IPs in
    ``status.podIP`` (127.1.x.y, from the suite's stand-in for the kubelet), and a fake vLLM listens at each IP on
    the one port the pod template's ``prometheus.io/port`` names. 12 waiting on each of 2 pods give
    ceil(24 / 8) = 3 replicas; the third pod's engine starts empty, so the total and the count hold; an empty queue
    then takes the Deployment to 1, and the deleted pods leave the answer."""
    port = free_port()
    engines: dict[str, FakeEngine] = {}

    async def serve_pods(count: int, waiting: float) -> list[Json]:
        pods = await scenario.wait_pod_ips("llm", count)
        for pod in pods:
            name, ip = pod["metadata"]["name"], pod["status"]["podIP"]
            if name not in engines:
                engines[name] = await FakeEngine(Engine.VLLM, {"waiting": waiting}).start(ip, port)
        return pods

    try:
        history = await scenario.deployment("llm", replicas=2, annotations={"prometheus.io/port": str(port)})
        await serve_pods(2, 12.0)
        agent = await scenario.agent("node-1")
        gateway = await scenario.gateway([agent], pod_directory="kubernetes")
        metadata = {
            "scalerAddress": f"127.0.0.1:{gateway.port}",
            "metric": "vllm_queue",
            "workload": "llm",
            "targetValue": f"{TARGET:g}",
        }
        asked = {**metadata, "namespace": scenario.namespace}
        value = await scenario.wait_value(gateway, asked, 24.0)
        await scenario.apply(llm_scaled_object("external-push", metadata))
        await scenario.wait_ready("llm")
        expected = expected_replicas(MetricType.AVERAGE_VALUE, value=value, target=TARGET, current=2, maximum=10)
        assert expected == 3
        await history.wait_equal(expected, 60)
        pods = await serve_pods(3, 0.0)
        await scenario.wait_value(gateway, asked, 24.0)
        answer = await scenario.query(gateway, asked)
        rows = {row["pod"]: row for row in answer["explanation"]["pods"]}
        assert {name: (row["included"], row["value"]) for name, row in rows.items()} == {
            pod["metadata"]["name"]: (True, engines[pod["metadata"]["name"]].values["waiting"]) for pod in pods
        }, rows
        await history.hold(expected, 3)

        emptied = time.monotonic()
        for engine in engines.values():
            engine.values["waiting"] = 0.0
        await history.wait_equal(1, 60, after=emptied)
        # The ReplicaSet deletes two pods; the watch shows it a moment later. Until then the answer may still
        # list them (their engines still serve), so wait for the API and then the answer to hold one pod.
        deadline = time.monotonic() + 60
        while len(remaining := await scenario.pods("llm")) != 1 or [
            row["pod"] for row in (await scenario.query(gateway, asked))["explanation"]["pods"]
        ] != [remaining[0]["metadata"]["name"]]:
            assert time.monotonic() < deadline, f"still {[p['metadata']['name'] for p in remaining]} after 60 s"
            await asyncio.sleep(0.5)
        assert await scenario.metric_value(gateway, asked) == 0.0
        scenario.record(
            f"pod watch: pods at {', '.join(p['status']['podIP'] for p in pods)} port {port} read 12 + 12 + 0 -> "
            f"{expected} replicas; empty -> 1 and the deleted pods left the answer; {history.describe()}"
        )
    finally:
        for engine in engines.values():
            await engine.stop()
