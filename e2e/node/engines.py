"""The chart's engine examples as the node suite runs them: the engine container replaced by the dev stack's fake.

Each example of ``examples/engines/`` is a Deployment of a real inference server and the ScaledObject that scales it.
No GPU, model or registry is here, so the suite applies the Deployment as written except for what its engine
container runs: the gpuscaler image (imported, as the chart runs it) starts ``dev/fake_engines.py`` from a ConfigMap,
in its one-pod mode, as the example's engine on every port the container declares. The labels, the annotations, the
ports, the readiness probe and the GPU request are the example's own; ``PUT /fake/requests`` on the pod's IP makes
its queue rise.
"""

from __future__ import annotations

import copy
from typing import Any

import aiohttp

from e2e.keda.control_plane import Json
from e2e.node.cluster import REPOSITORY_ROOT
from gpuscaler.model.aggregation import Aggregation
from gpuscaler.model.engines import ENGINE_SIGNALS, Engine, EngineMetric
from gpuscaler.query.metadata import Limits, parse_metadata
from gpuscaler.query.query import CombinedQuery, EngineQuery
from tests import dev_scripts

FAKE_ENGINE = REPOSITORY_ROOT / "dev" / "fake_engines.py"
EXAMPLES = REPOSITORY_ROOT / "charts" / "gpuscaler" / "examples" / "engines"
CONFIG_MAP = "gpuscaler-e2e-fake-engine"
MOUNT = "/fake-engine"
REQUEST_TIMEOUT_SECONDS = 10.0


fake_engines = dev_scripts.load("fake_engines")


def engine_query(scaled_object: Json) -> EngineQuery | CombinedQuery | None:
    """The query of the ScaledObject's one external trigger when it reads an engine signal; None for a GPU one."""
    (trigger,) = scaled_object["spec"]["triggers"]
    query = parse_metadata(
        trigger["metadata"],
        Limits(history_seconds=600, cluster=True),
        namespace=scaled_object["metadata"].get("namespace", "default"),
        name=scaled_object["metadata"]["name"],
    )
    value = query.value
    if isinstance(value, EngineQuery):
        return value
    if isinstance(value, CombinedQuery) and any(isinstance(part.query, EngineQuery) for part in value.signals):
        return value
    return None


def signals(query: EngineQuery | CombinedQuery) -> list[EngineMetric]:
    """The engine signals a query reads."""
    if isinstance(query, EngineQuery):
        return [query.metric]
    return [part.query.metric for part in query.signals if isinstance(part.query, EngineQuery)]


def engine_of(query: EngineQuery | CombinedQuery) -> Engine:
    """The one engine whose pages the query reads."""
    (engine,) = {ENGINE_SIGNALS[metric].engine for metric in signals(query)}
    return engine


def config_map(namespace: str) -> Json:
    """The fake engine's program, for the pods to run from a volume."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": CONFIG_MAP, "namespace": namespace},
        "data": {FAKE_ENGINE.name: FAKE_ENGINE.read_text()},
    }


def with_fake_engine(deployment: Json, engine: Engine, image: str) -> Json:
    """The example's Deployment with its engine container running the fake ``engine`` from ``image`` on every port
    the container declares; everything else as written."""
    replaced = copy.deepcopy(deployment)
    spec: dict[str, Any] = replaced["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    ports = [str(port["containerPort"]) for port in container["ports"]]
    container["image"] = image
    container["imagePullPolicy"] = "Never"  # imported: there is no registry
    container["command"] = ["python", f"{MOUNT}/{FAKE_ENGINE.name}"]
    container["args"] = ["--engine", engine.value, *(arg for port in ports for arg in ("--port", port))]
    container.setdefault("volumeMounts", []).append({"name": "fake-engine", "mountPath": MOUNT, "readOnly": True})
    spec.setdefault("volumes", []).append({"name": "fake-engine", "configMap": {"name": CONFIG_MAP}})
    return replaced


def label_selector(deployment: Json) -> str:
    """The Deployment's pods, as a label selector."""
    labels = deployment["spec"]["selector"]["matchLabels"]
    return ",".join(f"{key}={value}" for key, value in labels.items())


async def set_requests(pod: Json, requests: float) -> None:
    """Makes the fake engine of ``pod`` hold ``requests`` (``PUT /fake/requests`` on its first declared port)."""
    (container,) = pod["spec"]["containers"]
    url = f"http://{pod['status']['podIP']}:{container['ports'][0]['containerPort']}{fake_engines.REQUESTS_PATH}"
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_SECONDS)
    async with aiohttp.ClientSession(timeout=timeout) as session, session.put(url, data=f"{requests:g}") as answer:
        assert answer.status == 204, f"PUT {url}: {answer.status} {await answer.text()}"


def busy_pod(metric: EngineMetric, requests: float) -> float:
    """What the fake engine's page gives ``metric`` in a pod holding ``requests`` (dev/fake_engines.py's model)."""
    running = min(requests, fake_engines.BATCH_SLOTS)
    waiting = requests - running
    rate = running / fake_engines.SECONDS_PER_REQUEST
    values = {
        EngineMetric.VLLM_QUEUE: waiting,
        EngineMetric.SGLANG_QUEUE: waiting,
        EngineMetric.VLLM_KV_CACHE: 100 * round(running / fake_engines.BATCH_SLOTS * fake_engines.KV_CACHE_FULL, 3),
        EngineMetric.TRITON_REQUEST_RATE: rate,
        EngineMetric.TRITON_QUEUE_WAIT: 1000 * waiting / rate if rate else 0.0,
    }
    return float(values[metric])


def one_busy_pod_value(query: EngineQuery | CombinedQuery, requests: float, ready: int) -> float:
    """The gateway's answer when one of ``ready`` Ready pods holds ``requests`` and the others none: for one signal
    the pods' sum or average, for a combined query the most replicas any signal asks for (its sum over the target)."""
    if isinstance(query, EngineQuery):
        busy = busy_pod(query.metric, requests)
        return busy / ready if query.aggregation is Aggregation.AVG else busy
    return max(
        busy_pod(part.query.metric, requests) / part.target
        for part in query.signals
        if isinstance(part.query, EngineQuery)
    )


def included_pods(answer: Json) -> set[str]:
    """The pods (namespace/name) the answer's explanation counted, whatever signal each row is for."""
    rows = (answer.get("explanation") or {}).get("pods", [])
    return {f"{row['namespace']}/{row['pod']}" for row in rows if row.get("included")}
