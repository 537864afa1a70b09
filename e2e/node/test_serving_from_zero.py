"""A model server at zero replicas is woken by its first request, held by the real EPP (GIE v1.5.0, flow control on)
running as a pod on the node: pushed by the gateway (``profile: epp-wake``) and, in the same run, polled by KEDA's own
``prometheus`` trigger on a real Prometheus scraping the same EPP, at the shipped defaults and at the fastest sane
settings.

The objects are the chart's example ``examples/serving-from-zero/vllm-from-zero.yaml``: its Deployment (the engine
container replaced by the dev stack's fake vLLM, as the engine journey does), its InferencePool and its
ScaledObject, with a 15 s cooldown and a fallback of 2 replicas so that each is seen in minutes. The EPP is this
suite's (``e2e/node/serving.py``). A request reaches the EPP over Envoy's ext_proc protocol from the host
(``e2e/keda/eppclient``), which prints the endpoint the EPP picks. The timings are recorded, never asserted; of
their order, the test asserts that KEDA's step to 1 comes after the request and the EPP's dispatch after that step.
Each record ends with the host's load average.
"""

from __future__ import annotations

import asyncio
import copy
import os
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import yaml

from e2e.keda.control_plane import Json, free_port, namespace
from e2e.keda.scenario import ReplicaHistory
from e2e.monitoring import prometheus as prometheus_process
from e2e.node.chart import Release, query, wait_scaled_object_ready
from e2e.node.cluster import CHART_IMAGE, Deadline, NodeCluster, in_thread
from e2e.node.conftest import record
from e2e.node.engines import config_map, set_requests, with_fake_engine
from e2e.node.product_image import chart_version
from e2e.node.serving import (
    EPP_GRPC_PORT,
    EXAMPLE,
    Moments,
    active_stream,
    epp_deployment,
    epp_page,
    epp_selector,
    epp_service,
    first_true,
    scaled_object_active,
    watch,
)
from e2e.support.epp import QUEUE_SERIES, EppRequest, install_crds
from gpuscaler.model.engines import Engine
from tests.chart import chart_tools
from tests.tools import locate

NS = "serving-from-zero"
MODEL = "m"
COOLDOWN_SECONDS = 15
SATURATED_MAX = 4
BUSY_REQUESTS = 36.0  # 16 run and 20 wait in the fake vLLM
SERVER_PORT = 8000  # the example InferencePool's targetPorts
FALLBACK_REPLICAS = 2
STEP_TIMEOUT_SECONDS = 180.0
# The interval of the ServiceMonitor GIE v1.5.0's inferencepool chart ships for the EPP (its values'
# inferenceExtension.monitoring.interval: what scrapes the EPP) and KEDA's default pollingInterval; then the fastest
# either side sanely runs.
SHIPPED = {"scrape": "10s", "polling": 30}
FASTEST = {"scrape": "1s", "polling": 1}


def _load() -> str:
    """The host's 1, 5 and 15 minute load averages, for a record."""
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f} {five:.2f} {fifteen:.2f}"


async def _unavailable(address: str, asked: dict[str, str], scaled_object: str) -> Json:
    """Asks the gateway until its answer to ``asked`` is UNAVAILABLE (the pods it reads change as it watches them)."""
    deadline = time.monotonic() + STEP_TIMEOUT_SECONDS
    while True:
        answer = await query(address, asked, scaled_object=scaled_object)
        if not answer["get_metrics"]["ok"] and answer["get_metrics"]["code"] == "UNAVAILABLE":
            return answer
        assert time.monotonic() < deadline, f"not UNAVAILABLE within {STEP_TIMEOUT_SECONDS:g} s: {answer}"
        await asyncio.sleep(0.5)


def _example() -> tuple[Json, Json, Json]:
    documents = [d for d in yaml.safe_load_all(EXAMPLE.read_text()) if isinstance(d, dict)]
    (deployment,) = [d for d in documents if d["kind"] == "Deployment"]
    (pool,) = [d for d in documents if d["kind"] == "InferencePool"]
    (scaled,) = [d for d in documents if d["kind"] == "ScaledObject"]
    for document in (deployment, pool, scaled):
        document["metadata"]["namespace"] = NS
    return deployment, pool, scaled


def _scale(cluster: NodeCluster, deployment: str, replicas: int) -> None:
    path = f"/apis/apps/v1/namespaces/{NS}/deployments/{deployment}"
    cluster.kube.request("PATCH", path, {"spec": {"replicas": replicas}}, content_type="application/merge-patch+json")


def _scraped(server: prometheus_process.Prometheus) -> list[Json]:
    """The targets ``server`` scraped and found up."""
    return [t for t in server.api("targets")["activeTargets"] if t["health"] == "up"]


def _pods_ready(cluster: NodeCluster, selector: str) -> Callable[[], bool]:
    return lambda: bool(cluster.running_pods(NS, selector))


async def _reset(cluster: NodeCluster, history: ReplicaHistory, manifest: Json, selector: str) -> None:
    """The ScaledObject gone, the model server back at 0 with no pod left."""
    await in_thread(cluster.delete, manifest)
    await in_thread(cluster.wait_gone, manifest)
    target = manifest["spec"]["scaleTargetRef"]["name"]
    await in_thread(_scale, cluster, target, 0)
    await in_thread(cluster.wait_running, NS, selector, 0)
    if history.current != 0:
        await history.wait_equal(0, 30)


async def _wake(
    cluster: NodeCluster,
    history: ReplicaHistory,
    name: str,
    selector: str,
    epp_address: str,
    extra: Callable[[Moments], list[asyncio.Task[None]]] = lambda moments: [],
) -> tuple[Moments, EppRequest]:
    """Sends one request to the EPP with the pool at zero and marks: the ScaledObject Active, the Deployment at 1, its
    first pod Ready, and the EPP's dispatch to that pod; returns them and the open request."""
    assert history.current == 0, history.describe()
    moments = Moments()
    request = EppRequest()
    moments.sent = time.monotonic()
    await in_thread(request.send_to, epp_address, MODEL)
    tasks = [
        asyncio.create_task(
            watch("ScaledObject Active", moments, lambda: scaled_object_active(cluster, NS, name), 300)
        ),
        asyncio.create_task(watch("pod Ready", moments, _pods_ready(cluster, selector), 300)),
        *extra(moments),
    ]
    try:
        at, _ = await history.wait_for(lambda replicas: replicas >= 1, 300, "at least 1", after=moments.sent)
        moments.seen["Deployment 0 -> 1"] = at
        picked = await in_thread(request.wait_line, "headers", 300)
        moments.mark("EPP dispatched")
        await asyncio.gather(*tasks)
        # Causal order, each time taken where it happens: KEDA scales after the request, and the EPP dispatches
        # after the Deployment grew, to the pod it grew (the pod-Ready time is a poll of the API's, recorded only).
        assert moments.sent < moments.seen["Deployment 0 -> 1"] < moments.seen["EPP dispatched"], moments.describe()
        (pod,) = await in_thread(cluster.running_pods, NS, selector)
        assert picked == f"headers {pod['status']['podIP']}:{SERVER_PORT}", request.lines
    except BaseException:
        for task in tasks:
            task.cancel()
        request.close()
        raise
    return moments, request


async def test_the_first_request_wakes_the_pool_from_zero_by_push_and_by_prometheus(
    installed: Release, tmp_path: Path
) -> None:
    """With the model server at 0 and the EPP holding nothing, KEDA leaves it at 0 and the gateway pushes only
    inactive. One request: the gateway pushes active, KEDA scales 0 -> 1 after the request was sent, and the EPP
    dispatches the request after that step, to the pod KEDA started. While the request's stream is open the pool
    stays at 1 through the cooldown; once it closes, the pool goes back to 0. With the EPP's pod gone the wake
    trigger becomes UNAVAILABLE and KEDA applies the fallback and keeps it past the cooldown, never scaling in. The
    same request through KEDA's prometheus trigger, at the shipped and at the fastest settings, wakes the pool too;
    every step's time is recorded beside the push path's. Last, a saturated pool (one server's queue full) scales
    out on ``epp_saturation`` and back once its requests are gone."""
    cluster = installed.cluster
    address = await in_thread(installed.service_address)
    deployment, pool, example = _example()
    name = example["metadata"]["name"]
    target = deployment["metadata"]["name"]
    selector = ",".join(f"{k}={v}" for k, v in deployment["spec"]["selector"]["matchLabels"].items())
    epp_name = pool["spec"]["endpointPickerRef"]["name"]
    pool_name = pool["metadata"]["name"]
    assert pool["spec"]["endpointPickerRef"]["port"]["number"] == EPP_GRPC_PORT
    space = namespace(NS)
    space["metadata"]["labels"] = {"pod-security.kubernetes.io/enforce": "privileged"}  # the EPP's hostPath
    await in_thread(cluster.apply, space)
    await in_thread(
        install_crds, cluster.kube, lambda what, ready: Deadline(what, 60).until(ready, bool, cluster.check_alive)
    )
    await in_thread(cluster.apply, config_map(NS))
    server = with_fake_engine(deployment, Engine.VLLM, f"{CHART_IMAGE}:{chart_version()}")
    assert server["spec"]["replicas"] == 0
    await in_thread(cluster.apply, server)
    await in_thread(cluster.apply, pool)
    await in_thread(cluster.apply, epp_service(epp_name, NS))
    await in_thread(cluster.apply, epp_deployment(epp_name, NS, pool_name))
    history = ReplicaHistory(cluster.plane, NS, target)
    prometheus: prometheus_process.Prometheus | None = None
    try:
        (epp_pod,) = await in_thread(cluster.wait_running, NS, epp_selector(epp_name), 1)
        epp_ip = epp_pod["status"]["podIP"]
        epp_address = f"{epp_ip}:{EPP_GRPC_PORT}"
        page = await in_thread(epp_page, epp_ip)
        assert "inference_extension_info{" in page, page[:2000]

        # --- push ---------------------------------------------------------------------------------------------
        manifest = copy.deepcopy(example)
        manifest["spec"]["cooldownPeriod"] = COOLDOWN_SECONDS
        manifest["spec"]["fallback"] = {"failureThreshold": 2, "replicas": FALLBACK_REPLICAS}
        wake = next(t for t in manifest["spec"]["triggers"] if t["type"] == "external-push")
        assert wake["metadata"]["scalerAddress"] == address, "the documented address is the chart's Service"
        asked = {**wake["metadata"], "namespace": NS}
        await in_thread(cluster.apply, manifest)
        await in_thread(wait_scaled_object_ready, cluster, NS, name)
        await history.wait_for(lambda replicas: True, 30, "recorded")
        async with active_stream(address, dict(wake["metadata"]), NS, f"{name}-timing") as received:
            await history.hold(0, 5)  # an idle EPP: 0, and KEDA leaves the pool at 0
            idle = [received.get_nowait()[1] for _ in range(received.qsize())]
            assert idle, "the gateway's stream sent nothing while the EPP was idle"
            assert all(state is False for state in idle), f"the stream went active while the EPP was idle: {idle}"
            moments, request = await _wake(
                cluster,
                history,
                name,
                selector,
                epp_address,
                lambda moments: [asyncio.create_task(first_true(received, moments, "gateway pushed active", 300))],
            )
        try:
            record(f"serving from zero, push (epp-wake, real kubelet, real EPP): {moments.describe()}; {_load()}")

            # Running, not queued: the wake trigger stays active through the cooldown while the stream is open.
            answer = await query(address, asked, scaled_object=f"{NS}/{name}")
            assert answer["is_active"]["ok"], answer["is_active"]
            assert answer["is_active"]["fields"]["result"], answer["is_active"]
            await history.hold(1, COOLDOWN_SECONDS + 10)
            answer = await query(address, asked, scaled_object=f"{NS}/{name}")
            assert answer["is_active"]["fields"]["result"], answer
        finally:
            request.close()
        closed = time.monotonic()
        at = await history.wait_equal(0, STEP_TIMEOUT_SECONDS, after=closed)
        record(
            f"serving from zero, push: held at 1 for {COOLDOWN_SECONDS + 10} s while the request ran "
            f"(cooldown {COOLDOWN_SECONDS} s); back to 0 {at - closed:.1f} s after its stream ended; {_load()}"
        )

        # --- the EPP gone -----------------------------------------------------------------------------------------
        # Wake the pool again, then take the EPP away (its Deployment to 0: no Ready EPP pod, the state between a
        # killed pod and its Ready replacement, held open): UNAVAILABLE, and KEDA's fallback, never a scale-in. The
        # fallback count is held for the cooldown and 10 s more from the moment the EPP's pod was gone (the request
        # closed before), the last moment the wake trigger could have read active: a scale-in would show there.
        await in_thread(cluster.wait_running, NS, selector, 0)
        moments, request = await _wake(cluster, history, name, selector, epp_address)
        request.close()
        at_death = history.current
        assert at_death is not None, history.describe()
        assert at_death >= 1, history.describe()
        died = time.monotonic()
        await in_thread(_scale, cluster, epp_name, 0)
        await in_thread(cluster.wait_running, NS, epp_selector(epp_name), 0)
        gone = time.monotonic()
        await _unavailable(address, asked, f"{NS}/{name}")
        fallback_at, reached = await history.wait_for(
            lambda replicas: replicas == FALLBACK_REPLICAS, STEP_TIMEOUT_SECONDS, f"{FALLBACK_REPLICAS}", after=died
        )
        # ``during`` below covers any time already past; the hold covers the rest (at least a second).
        await history.hold(FALLBACK_REPLICAS, max(gone + COOLDOWN_SECONDS + 10 - time.monotonic(), 1.0))
        during = [replicas for at, replicas in history.changes if at >= died]
        assert min(during) >= at_death, history.describe()
        record(
            f"serving from zero, EPP gone: gateway UNAVAILABLE; KEDA fallback {at_death} -> {reached} "
            f"{fallback_at - died:.1f} s after the EPP was taken away; held at {reached} until "
            f"{COOLDOWN_SECONDS + 10} s after its pod was gone (cooldown {COOLDOWN_SECONDS} s), never below "
            f"{at_death}; {_load()}"
        )
        await in_thread(_scale, cluster, epp_name, 1)
        (epp_pod,) = await in_thread(cluster.wait_running, NS, epp_selector(epp_name), 1)
        epp_ip = epp_pod["status"]["podIP"]
        epp_address = f"{epp_ip}:{EPP_GRPC_PORT}"
        await _reset(cluster, history, manifest, selector)

        # --- Prometheus -------------------------------------------------------------------------------------------
        expression = f'sum({QUEUE_SERIES}{{inference_pool="{pool_name}"}})'
        for label, settings in (("shipped defaults", SHIPPED), ("fastest", FASTEST)):
            folder = tmp_path / f"prometheus-{settings['scrape']}"
            folder.mkdir()
            port = free_port()
            job = {
                "job_name": "epp",
                "scrape_interval": settings["scrape"],
                "static_configs": [{"targets": [f"{epp_ip}:9090"]}],
            }
            prometheus = await in_thread(
                prometheus_process.start, locate(chart_tools.PROMETHEUS), folder, [job], [], port
            )
            await in_thread(
                prometheus.wait,
                "Prometheus scraping the EPP",
                partial(_scraped, prometheus),
                60,
            )
            polled = copy.deepcopy(example)
            polled["spec"].pop("fallback")
            polled["spec"]["cooldownPeriod"] = COOLDOWN_SECONDS
            polled["spec"]["pollingInterval"] = settings["polling"]
            polled["spec"]["triggers"] = [
                {
                    "type": "prometheus",
                    "metadata": {
                        "serverAddress": f"http://127.0.0.1:{port}",
                        "query": expression,
                        "threshold": "8",
                        "activationThreshold": "0",
                    },
                }
            ]
            await in_thread(cluster.apply, polled)
            await in_thread(wait_scaled_object_ready, cluster, NS, name)
            await history.hold(0, 5)

            def queued(server: prometheus_process.Prometheus = prometheus) -> bool:
                return any(float(r["value"][1]) > 0 for r in server.query(expression))

            moments, request = await _wake(
                cluster,
                history,
                name,
                selector,
                epp_address,
                lambda moments: [asyncio.create_task(watch("Prometheus has the queue", moments, queued, 300))],
            )
            request.close()
            record(
                f"serving from zero, prometheus trigger ({label}: scrape {settings['scrape']}, pollingInterval "
                f"{settings['polling']} s): {moments.describe()}; {_load()}"
            )
            await _reset(cluster, history, polled, selector)
            prometheus.stop()
            prometheus = None

        # --- saturation ---------------------------------------------------------------------------------------
        # The EPP gates on the pool's saturation, which it computes from the model servers' pages (GIE v1.5.0's
        # utilization detector: each server's waiting requests over 5, or its KV cache over 80%, the larger, averaged
        # over the pool). One server whose fake vLLM holds 36 requests (20 waiting) saturates the pool; the HPA
        # scales out on it (Value: Ready servers x saturation / 100%) and back once the requests are gone.
        saturated = copy.deepcopy(example)
        saturated["spec"].pop("fallback")
        saturated["spec"]["cooldownPeriod"] = COOLDOWN_SECONDS
        saturated["spec"]["minReplicaCount"] = 1
        saturated["spec"]["maxReplicaCount"] = SATURATED_MAX
        saturation = {
            "scalerAddress": address,
            "metric": "epp_saturation",
            "inferencePool": pool_name,
            "podSelector": wake["metadata"]["podSelector"],
            "targetValue": "100",
        }
        saturated["spec"]["triggers"] = [
            wake,
            {"type": "external-push", "metricType": "Value", "metadata": saturation},
        ]
        applied = time.monotonic()
        await in_thread(cluster.apply, saturated)
        await in_thread(wait_scaled_object_ready, cluster, NS, name)
        await history.wait_equal(1, STEP_TIMEOUT_SECONDS, after=applied)
        (pod,) = await in_thread(cluster.wait_running, NS, selector, 1)
        busy_at = time.monotonic()
        await set_requests(pod, BUSY_REQUESTS)
        at, reached = await history.wait_for(
            lambda replicas: replicas > 1, STEP_TIMEOUT_SECONDS, "more than 1", after=busy_at
        )
        answer = await query(address, {**saturation, "namespace": NS}, scaled_object=f"{NS}/{name}")
        read = (
            answer["get_metrics"]["fields"]["metricValues"][0]["metricValueFloat"]
            if answer["get_metrics"]["ok"]
            else answer["get_metrics"]
        )
        await set_requests(pod, 0)
        idle_at = time.monotonic()
        back = await history.wait_equal(1, STEP_TIMEOUT_SECONDS, after=idle_at)
        record(
            f"serving from zero, saturation: one server with {BUSY_REQUESTS:g} requests -> 1 -> {reached} "
            f"{at - busy_at:.1f} s later (epp_saturation {read}); back to 1 {back - idle_at:.1f} s after they ended; "
            f"{_load()}"
        )
        await _reset(cluster, history, saturated, selector)
        record(f"serving from zero: replicas {history.describe()}")
    finally:
        history.stop()
        if prometheus is not None:
            prometheus.stop()
        scaled = copy.deepcopy(example)
        await in_thread(cluster.delete, scaled)
        await in_thread(cluster.wait_gone, scaled)
        for document in (server, epp_deployment(epp_name, NS, pool_name), epp_service(epp_name, NS), pool):
            await in_thread(cluster.delete, document)
        await in_thread(cluster.wait_running, NS, selector, 0)
        await in_thread(cluster.wait_running, NS, epp_selector(epp_name), 0)
        await in_thread(cluster.delete, config_map(NS))
        # The namespace too, waited for: the next journey finds none of this one's objects.
        await in_thread(cluster.delete, space)
        await in_thread(cluster.wait_gone, space)
