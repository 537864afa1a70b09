"""KEDA's operator and the HPA scale GPU workloads on the real node, off the chart's gateway, at the Service address
the docs name.

The chart is installed as the README says (namespace gpuscaler labelled for Pod Security "privileged", then helm),
with ``chart.BASE_SETS`` and the documented ``agent.podResources.enabled: true``: the agent reads the real kubelet's
PodResources. Workloads are busybox Deployments whose pods request ``nvidia.com/gpu``; the fake device plugin gives
each the UUID of one of the agent's fake GPUs. ``gpuscaler fake set`` on the agent pod makes GPUs busy or idle.
The engine examples bring their own Deployment, whose engine container runs the dev stack's fake engine
(``e2e/node/engines.py``); a request to that fake makes its queue rise.
"""

from __future__ import annotations

import copy
import time
from typing import Any

import pytest
import yaml

from e2e.keda.control_plane import Json, namespace
from e2e.keda.scenario import ReplicaHistory, expected_replicas, scaled_object
from e2e.node.chart import (
    EXAMPLES,
    Release,
    fake_set,
    held,
    metric_value,
    query,
    uuid_index,
    wait_counted,
    wait_scaled_object_ready,
)
from e2e.node.cluster import (
    CHART_IMAGE,
    GPU_RESOURCE,
    REPOSITORY_ROOT,
    Deadline,
    eventually,
    gpu_deployment,
    in_thread,
    pod_resources,
)
from e2e.node.conftest import FAKE_GPUS, record
from e2e.node.engines import EXAMPLES as ENGINE_EXAMPLES
from e2e.node.engines import (
    config_map,
    engine_of,
    engine_query,
    included_pods,
    label_selector,
    one_busy_pod_value,
    set_requests,
    with_fake_engine,
)
from e2e.node.product_image import chart_version
from e2e.node.serving import SERVING_FROM_ZERO
from gpuscaler.client.hpa import MetricType
from gpuscaler.query.keys import asks_in_scaled_object_namespace
from tests.test_docs import EXTERNAL_TRIGGERS, YAML_SOURCES

# Every percent reading a profile or metric may scale on, at 100 (busy) or 0 (idle); NVLink traffic (MB/s, for
# distributed-training) at twice its profile's per-replica target.
BUSY = {"gpu_utilization": 100.0, "memory_utilization": 100.0, "sm_active": 100.0, "sm_occupancy": 100.0}
BUSY |= {"tensor_active": 100.0, "dram_bandwidth": 100.0, "nvlink_tx": 100000.0}
IDLE = dict.fromkeys(BUSY, 0.0)
SETTLE_SECONDS = 5.0
STEP_TIMEOUT_SECONDS = 180.0
# The requests one engine pod is given: 16 run and 20 wait in the fake's model, which puts every profile's answer
# between two whole numbers of replicas (2.5 for a queue, 1.125 for the cache, 250 ms for Triton's wait, 80/s).
BUSY_REQUESTS = 36.0
# How close the gateway's answer must come to the fake's model: a rate's two reads are timed by the gateway.
VALUE_TOLERANCE = 0.05


async def test_keda_scales_a_gpu_workload_on_exactly_its_own_gpus(installed: Release) -> None:
    """trainer's pods hold one GPU each. Its busy GPUs scale it 1 -> 2 -> 3 (AverageValue, target 60), each new pod
    starts on an idle GPU of its own, and the gateway counts exactly the GPUs trainer's pods hold; idle, it goes back
    to 1 and the deleted pods' GPUs leave the count; a pod deleted and replaced is replaced in the count too."""
    cluster, ns, app = installed.cluster, "scaling", "trainer"
    await in_thread(cluster.apply, namespace(ns))
    await in_thread(cluster.apply, gpu_deployment(app, ns, replicas=1))
    history = ReplicaHistory(cluster.plane, ns, app)
    agent, address = await in_thread(installed.agent_address), await in_thread(installed.service_address)
    await fake_set(agent, "all", **IDLE)
    metadata = {"scalerAddress": address, "workload": app, "metric": "gpu_utilization", "targetValue": "60"}
    asked = {**metadata, "namespace": ns}  # what KEDA's ScaledObjectRef implies

    async def step(replicas: int, busy: int) -> dict[str, str]:
        """Waits for ``replicas`` Ready pods, holding distinct GPUs that the gateway counts, and for the value to be
        ``busy`` x 90; returns the GPUs."""
        pods = await in_thread(cluster.wait_running, ns, f"app={app}", replicas)
        gpus = await held(cluster, ns, app, pods)
        assert len(gpus) == replicas, f"{replicas} pods hold {gpus}"
        answer, _ = await wait_counted(cluster, address, asked, gpus)
        assert metric_value(answer) == pytest.approx(90.0 * busy), answer["get_metrics"]
        return gpus

    gpus = await step(1, 0)
    manifest = scaled_object(app, trigger="external", metadata=metadata, min_replicas=1, max_replicas=FAKE_GPUS)
    manifest["metadata"]["namespace"] = ns
    await in_thread(cluster.apply, manifest)
    await in_thread(wait_scaled_object_ready, cluster, ns, app)

    busy: list[str] = []
    for replicas in (2, 3):
        # Make the newest pod's GPU busy: the sum rises by 90, and ceil(sum / 60) asks for one more replica.
        newest = sorted(set(gpus) - set(busy))[0]
        busy.append(newest)
        await fake_set(agent, uuid_index(newest), gpu_utilization=90)
        expected = expected_replicas(
            MetricType.AVERAGE_VALUE, value=90.0 * len(busy), target=60, current=replicas - 1, maximum=FAKE_GPUS
        )
        assert expected == replicas
        await history.wait_equal(replicas, STEP_TIMEOUT_SECONDS)
        gpus = await step(replicas, len(busy))
        await history.hold(replicas, SETTLE_SECONDS)

    # Idle: the HPA goes back to minReplicaCount; the deleted pods' GPUs leave the count.
    await fake_set(agent, "all", gpu_utilization=0)
    await history.wait_equal(1, STEP_TIMEOUT_SECONDS)
    (survivor,) = await in_thread(cluster.wait_running, ns, f"app={app}", 1)
    remaining = await held(cluster, ns, app, [survivor])
    await wait_counted(cluster, address, asked, remaining)
    assert set(remaining) <= set(gpus)

    # KEDA lets go (its HPA goes with the ScaledObject); a pod deleted by hand is replaced in the count.
    await in_thread(cluster.delete, manifest)
    await in_thread(cluster.wait_gone, manifest)
    await in_thread(cluster.kube.delete, {"apiVersion": "v1", "kind": "Pod", "metadata": survivor["metadata"]})
    replacement = await in_thread(cluster.wait_replacement, ns, app, survivor["metadata"]["name"], STEP_TIMEOUT_SECONDS)
    await wait_counted(cluster, address, asked, await held(cluster, ns, app, [replacement]))
    record(f"workload journey ({ns}/{app}, external, target 60): replicas {history.describe()}")
    history.stop()
    await in_thread(cluster.delete, gpu_deployment(app, ns, replicas=0))
    await in_thread(cluster.wait_running, ns, f"app={app}", 0)
    await wait_counted(cluster, address, asked, {})


# --- the documented ScaledObjects ------------------------------------------------------------------------


def documented() -> list[Any]:
    """Every ScaledObject on GPU signals of README.md and the chart's examples, read from the files when collected
    (the engine examples have a journey of their own, below, and serving-from-zero's, whose pool needs the EPP,
    is applied by test_serving_from_zero.py)."""
    cases = []
    for source in YAML_SOURCES:
        if source.path != REPOSITORY_ROOT / "README.md" and not source.path.is_relative_to(EXAMPLES):
            continue
        if source.path.is_relative_to(SERVING_FROM_ZERO):
            continue
        for document in yaml.safe_load_all(source.text):
            if isinstance(document, dict) and document.get("kind") == "ScaledObject" and not engine_query(document):
                cases.append(pytest.param(document, id=f"{source.id}:{document['metadata']['name']}"))
    return cases


def _signal(manifest: Json) -> tuple[str, str]:
    """The workload whose GPUs the ScaledObject's trigger reads: (namespace, Deployment name)."""
    ns = manifest["metadata"].get("namespace", "default")
    triggers = [t for t in manifest["spec"]["triggers"] if t["type"] in EXTERNAL_TRIGGERS]
    assert len(triggers) == 1, f"one external trigger expected: {triggers}"
    metadata = triggers[0]["metadata"]
    if "workload" in metadata:
        return metadata.get("namespace", ns), metadata["workload"]
    if metadata.get("scaleTargetPods") == "true":
        return ns, manifest["spec"]["scaleTargetRef"]["name"]
    raise AssertionError(f"the suite gives pods only to workload or scaleTargetPods triggers, not to {metadata}")


async def _restart_agent(release: Release) -> str:
    """Deletes the agent pod so the next journey starts from a fresh history (windows of up to 2 minutes would carry
    the last journey's load); returns the new pod's address once it is Ready."""
    cluster = release.cluster
    (old,) = await in_thread(release.agent_pods)
    await in_thread(cluster.kube.delete, {"apiVersion": "v1", "kind": "Pod", "metadata": old["metadata"]})
    await in_thread(
        Deadline("the agent's replacement", STEP_TIMEOUT_SECONDS).until,
        release.agent_pods,
        lambda pods: len(pods) == 1 and pods[0]["metadata"]["uid"] != old["metadata"]["uid"],
    )
    await in_thread(release.wait_ready)
    return await in_thread(release.agent_address)


@pytest.mark.parametrize("document", documented())
async def test_a_documented_scaled_object_scales_its_workload(installed: Release, document: Json) -> None:
    """Applied as written: KEDA makes it Ready and leaves its target alone while the GPUs are idle; when the GPUs of
    the workload its trigger names get busy, KEDA and the HPA scale the target up (0 -> 1 for a scale from zero),
    and the gateway counts exactly the GPUs the kubelet gave that workload's pods."""
    cluster = installed.cluster
    manifest = copy.deepcopy(document)
    name, ns = manifest["metadata"]["name"], manifest["metadata"].get("namespace", "default")
    spec = manifest["spec"]
    target = spec["scaleTargetRef"]["name"]
    minimum = int(spec.get("minReplicaCount", 0))
    signal_ns, signal = _signal(manifest)
    trigger = next(t for t in spec["triggers"] if t["type"] in EXTERNAL_TRIGGERS)
    asked = {**trigger["metadata"], "namespace": trigger["metadata"].get("namespace", ns)}
    await in_thread(cluster.apply, namespace(ns))
    deployments = [gpu_deployment(target, ns, replicas=max(minimum, 1) if signal == target else 0)]
    if signal != target:
        deployments.append(gpu_deployment(signal, signal_ns, replicas=1))
    try:
        for deployment in deployments:
            await in_thread(cluster.apply, deployment)
        history = ReplicaHistory(cluster.plane, ns, target)
        await in_thread(cluster.wait_running, signal_ns, f"app={signal}", max(minimum, 1))
        # A fresh agent: the windows (up to 2 minutes) must not carry the last journey's load.
        agent = await _restart_agent(installed)
        address = await in_thread(installed.service_address)
        assert trigger["metadata"]["scalerAddress"] == address, "the documented address is the chart's Service"
        await wait_counted(cluster, address, asked, (signal_ns, signal))

        await in_thread(cluster.apply, manifest)
        await in_thread(wait_scaled_object_ready, cluster, ns, name)
        _, start = await history.wait_for(lambda replicas: True, 30, "recorded")
        await history.hold(start, SETTLE_SECONDS)  # idle GPUs: KEDA leaves it where it is
        busy_at = time.monotonic()
        await fake_set(agent, "all", **BUSY)
        at, reached = await history.wait_for(
            lambda replicas: replicas > start, STEP_TIMEOUT_SECONDS, f"more than {start}", after=busy_at
        )
        _, gpus = await wait_counted(cluster, address, asked, (signal_ns, signal))
        record(
            f"{name} ({ns}, {trigger['type']}, min {minimum}, signal {signal_ns}/{signal}): {start} -> {reached} "
            f"{at - busy_at:.1f} s after the GPUs got busy; replicas {history.describe()}; {signal}'s pods hold "
            f"{len(gpus)} GPU(s), all counted"
        )
        history.stop()
    finally:
        await in_thread(cluster.delete, manifest)
        await in_thread(cluster.wait_gone, manifest)
        for deployment in deployments:
            await in_thread(cluster.delete, deployment)
        for deployment in deployments:
            meta = deployment["metadata"]
            await in_thread(cluster.wait_running, meta["namespace"], f"app={meta['name']}", 0)


# --- the engine examples -------------------------------------------------------------------------------


def engine_examples() -> list[Any]:
    """Each file of examples/engines/: its Deployment and ScaledObject, read when collected."""
    cases = []
    for path in sorted(ENGINE_EXAMPLES.glob("*.yaml")):
        documents = [d for d in yaml.safe_load_all(path.read_text()) if isinstance(d, dict)]
        (deployment,) = [d for d in documents if d["kind"] == "Deployment"]
        (scaled_object,) = [d for d in documents if d["kind"] == "ScaledObject"]
        cases.append(pytest.param(deployment, scaled_object, id=f"engines/{path.name}"))
    return cases


@pytest.mark.parametrize(("deployment", "document"), engine_examples())
async def test_an_engine_example_scales_its_deployment_on_its_engine(
    installed: Release, deployment: Json, document: Json
) -> None:
    """Applied as written, with only what the engine container runs replaced by the fake engine (on the ports it
    declares, answering its readiness probe): KEDA makes the ScaledObject Ready; the gateway finds the pod's metrics
    where the example says and counts exactly the Deployment's Ready pods; KEDA leaves the Deployment alone while the
    queue is empty; when one pod's queue rises, the gateway's answer is the fake's value, and the HPA's first step is
    the example's arithmetic on it (ceil(value / target) for AverageValue, ceil(Ready pods x value / target) for
    Value)."""
    cluster = installed.cluster
    manifest = copy.deepcopy(document)
    name, ns = manifest["metadata"]["name"], manifest["metadata"].get("namespace", "default")
    spec = manifest["spec"]
    assert spec["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    (trigger,) = spec["triggers"]
    metric_type = MetricType(trigger.get("metricType", MetricType.AVERAGE_VALUE.value))
    reads = engine_query(manifest)
    assert reads is not None, f"{name} reads no engine signal"
    engine = engine_of(reads)
    address = await in_thread(installed.service_address)
    assert trigger["metadata"]["scalerAddress"] == address, "the documented address is the chart's Service"
    asked = dict(trigger["metadata"])
    if asks_in_scaled_object_namespace(asked):
        asked.setdefault("namespace", ns)  # what KEDA's ScaledObjectRef implies
    selector = label_selector(deployment)
    minimum, maximum = int(spec.get("minReplicaCount", 0)), int(spec.get("maxReplicaCount", 100))
    assert minimum >= 1, "an engine signal cannot wake a workload from zero: it has no pod to read there"
    image = f"{CHART_IMAGE}:{chart_version()}"
    workload = with_fake_engine(deployment, engine, image)
    await in_thread(cluster.apply, namespace(ns))
    await in_thread(cluster.apply, config_map(ns))
    try:
        await in_thread(cluster.apply, workload)
        history = ReplicaHistory(cluster.plane, ns, deployment["metadata"]["name"])
        pods = await in_thread(cluster.wait_running, ns, selector, deployment["spec"].get("replicas", 1))
        # The ScaledObject first: scaleTargetPods selects the pods of its scaleTargetRef, which the gateway learns
        # from the ScaledObject itself.
        await in_thread(cluster.apply, manifest)
        await in_thread(wait_scaled_object_ready, cluster, ns, name)
        _, start = await history.wait_for(lambda replicas: True, 30, "recorded")
        assert start == len(pods), history.describe()

        async def ask() -> Json:
            return await query(address, asked, scaled_object=f"{ns}/{name}")

        ready = {f"{ns}/{pod['metadata']['name']}" for pod in pods}
        idle = await eventually(
            f"the gateway to read 0 from exactly {sorted(ready)} for {asked}",
            60,
            ask,
            lambda answer: answer["get_metrics"]["ok"] and included_pods(answer) == ready and metric_value(answer) == 0,
        )
        target = float(idle["get_metric_spec"]["fields"]["metricSpecs"][0]["targetSizeFloat"])
        await history.hold(start, SETTLE_SECONDS)  # an empty queue: KEDA leaves it where it is

        busy_at = time.monotonic()
        await set_requests(pods[0], BUSY_REQUESTS)
        value = one_busy_pod_value(reads, BUSY_REQUESTS, start)
        answer = await eventually(
            f"the gateway's answer to reach {value:g} for {asked}",
            60,
            ask,
            lambda answer: (
                answer["get_metrics"]["ok"] and metric_value(answer) == pytest.approx(value, rel=VALUE_TOLERANCE)
            ),
        )
        expected = expected_replicas(metric_type, value=value, target=target, current=start, maximum=maximum)
        assert expected > start, f"{BUSY_REQUESTS:g} requests must ask for more than {start} replicas"
        at, reached = await history.wait_for(
            lambda replicas: replicas != start, STEP_TIMEOUT_SECONDS, f"other than {start}", after=busy_at
        )
        assert reached == expected, f"{name}: the HPA's first step was to {reached}, not {expected}"
        record(
            f"engines/{name} ({trigger['metadata']['profile']}, {metric_type.value}, target {target:g}): value "
            f"{metric_value(answer):.3g}, {start} -> {reached} {at - busy_at:.1f} s after one pod's fake "
            f"{engine.value} got {BUSY_REQUESTS:g} requests; replicas {history.describe()}"
        )
        history.stop()
    finally:
        await in_thread(cluster.delete, manifest)
        await in_thread(cluster.wait_gone, manifest)
        await in_thread(cluster.delete, workload)
        await in_thread(cluster.wait_running, ns, selector, 0)
        await in_thread(cluster.delete, config_map(ns))


async def test_time_sliced_replicas_are_counted_as_the_gpu_they_share(installed: Release) -> None:
    """With NVIDIA's time-slicing naming (GPU 0 offered as two replicas, ``<uuid>::0`` and ``<uuid>::1``), two pods
    share one GPU: each container sees its replica in NVIDIA_VISIBLE_DEVICES, and the gateway counts that GPU once for
    each of the two pods."""
    cluster, ns, app = installed.cluster, "time-slicing", "shared"
    await in_thread(cluster.node.start_device_plugin, 1, 2)
    try:
        await in_thread(cluster.apply, namespace(ns))
        await in_thread(cluster.apply, gpu_deployment(app, ns, replicas=2))
        pods = await in_thread(cluster.wait_running, ns, f"app={app}", 2)
        holdings = [h for h in await pod_resources() if h.namespace == ns and h.resource == GPU_RESOURCE]
        replicas = sorted(device for h in holdings for device in h.device_ids)
        gpu = replicas[0].split("::")[0]
        assert replicas == [f"{gpu}::0", f"{gpu}::1"], holdings
        for holding in holdings:
            log = await in_thread(cluster.log, ns, holding.pod)
            assert f"gpus={holding.device_ids[0]}" in log, log
        address = await in_thread(installed.service_address)
        asked = {"scalerAddress": address, "workload": app, "metric": "gpu_utilization", "namespace": ns}
        names = {f"{ns}/{pod['metadata']['name']}" for pod in pods}

        async def counted() -> list[tuple[str, str]]:
            answer = await query(address, asked)
            gpus = (answer.get("explanation") or {}).get("gpus", [])
            return sorted((g["uuid"], f"{g.get('namespace')}/{g.get('pod')}") for g in gpus if g.get("included"))

        await eventually(
            f"the gateway to count {gpu} once for each of {sorted(names)}",
            60,
            counted,
            lambda found: found == sorted((gpu, name) for name in names),
        )
        record(f"time-slicing: {sorted(names)} hold {replicas}; the gateway counts {gpu} for each")
        await in_thread(cluster.delete, gpu_deployment(app, ns, replicas=0))
        await in_thread(cluster.wait_running, ns, f"app={app}", 0)
    finally:
        await in_thread(cluster.node.start_device_plugin, FAKE_GPUS, 1)
