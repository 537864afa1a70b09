"""The real HPA scales on engine signals and a combined one to the replica count docs/hpa.md's rule gives.

Deployment ``llm`` has two pods whose engines the gateway reads (its static pod directory gives each a loopback
address): pod A runs two data-parallel vLLM engines (two label sets), pod B one. Other Deployments are scaled on
triggers that select ``workload: llm``, so what the gateway answers stays the same while they scale. The expected
counts come from ``rule_*`` below, written from the documented rule, never from gpuscaler's own arithmetic:

- a pod's usage share (KV cache) is the mean over its label sets, its queue their sum (docs/engines.md);
- a standalone signal combines the pods by its default (queue: sum, usage: average); a combined signal sums each
  signal over the pods and answers the most ``value / target`` any signal asks for, with a target of 1;
- the HPA: ``AverageValue`` gives ``ceil(value / target)``, ``Value`` gives ``ceil(ready * value / target)``, both
  keep the count within 10% of the target, clamped by the ScaledObject's bounds.

Each case's replicas by the rule and by the real HPA end up in the suite's measurements, named as docs/hpa.md's
worked cases are.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from e2e.keda.control_plane import Json
from e2e.keda.scenario import Scenario, directory_entry, scaled_object
from e2e.keda.test_engines import FAST_BOTH_WAYS
from e2e.support.process import Process
from gpuscaler.client.hpa import MetricType
from gpuscaler.model.engines import Engine
from tests.fakes.fake_engine import FakeEngine

TOLERANCE = 0.1  # the HPA's default: no change while value / target is within 10% of 1
MIN_REPLICAS = 1
MAX_REPLICAS = 10
# Pod A's two data-parallel engines and pod B's one: (requests waiting, KV cache as a 0-1 fraction).
POD_A = ((3.0, 0.5), (4.0, 0.7))
POD_B = ((5.0, 0.9),)
QUEUE_TARGET = 4.0
CACHE_TARGET = 50.0
COMBINED = {"vllm_queue": 8.0, "vllm_kv_cache": 40.0}


@dataclass
class DataParallelVllm(FakeEngine):
    """A vLLM pod whose engine runs one data-parallel rank per entry of ``ranks``: one label set per rank
    (``engine="N"``, as vLLM labels them) of the queue and the KV cache."""

    ranks: tuple[tuple[float, float], ...] = ()

    def page(self) -> str:
        lines = []
        for index, name in enumerate(("vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")):
            lines += [f"# HELP {name} {name}.", f"# TYPE {name} gauge"]
            lines += [f'{name}{{engine="{r}",model_name="m"}} {rank[index]}' for r, rank in enumerate(self.ranks)]
        return "\n".join(lines) + "\n"


# --- the documented rule, by hand -----------------------------------------------------------------------------


def rule_pod_queue(ranks: Sequence[tuple[float, float]]) -> float:
    """A pod's queue: the sum over its label sets."""
    return sum(waiting for waiting, _ in ranks)


def rule_pod_cache(ranks: Sequence[tuple[float, float]]) -> float:
    """A pod's KV cache in %: the mean over its label sets (each data-parallel engine has a pool of one size)."""
    return 100 * sum(cache for _, cache in ranks) / len(ranks)


def rule_hpa(metric_type: MetricType, *, value: float, target: float, current: int) -> int:
    """Kubernetes' replica calculator for an external metric, all pods Ready, clamped by the bounds."""
    ratio = value / (target * current) if metric_type is MetricType.AVERAGE_VALUE else value / target
    desired = current if abs(1 - ratio) <= TOLERANCE else math.ceil(ratio * current)
    return max(MIN_REPLICAS, min(MAX_REPLICAS, desired))


# --- the world ------------------------------------------------------------------------------------------------


@pytest.fixture
async def llm(scenario: Scenario, tmp_path: Path) -> AsyncIterator[Process]:
    """Deployment llm's two pods served by POD_A's and POD_B's engines, and the gateway that reads them."""
    await scenario.deployment("llm", replicas=2)
    pods = await scenario.wait_pods("llm", 2)
    engines = [await DataParallelVllm(Engine.VLLM, ranks=ranks).start() for ranks in (POD_A, POD_B)]
    try:
        entries = [
            {**directory_entry(pod, "llm"), "ip": "127.0.0.1", "annotations": {"prometheus.io/port": str(e.port)}}
            for pod, e in zip(pods, engines, strict=True)
        ]
        pods_file = tmp_path / "pods.yaml"
        pods_file.write_text(yaml.safe_dump({"pods": entries}))
        agent = await scenario.agent("node-1")
        gateway = await scenario.gateway([agent], pod_directory=pods_file)
        yield gateway
    finally:
        for engine in engines:
            await engine.stop()


def scaled_on_llm(name: str, gateway: Process, metadata: dict[str, str], metric_type: MetricType | None = None) -> Json:
    """A ScaledObject for Deployment ``name`` whose trigger reads workload llm, each way as fast as the HPA."""
    document = scaled_object(
        name,
        trigger="external",
        metadata={**metadata, "scalerAddress": f"127.0.0.1:{gateway.port}", "workload": "llm"},
        metric_type=metric_type,
        min_replicas=MIN_REPLICAS,
        max_replicas=MAX_REPLICAS,
    )
    document["spec"]["advanced"] = FAST_BOTH_WAYS
    return document


async def hpa_desired(scenario: Scenario, name: str) -> int | None:
    """The real HPA's ``status.desiredReplicas`` for ScaledObject ``name``, as the API server holds it."""
    path = f"/apis/autoscaling/v2/namespaces/{scenario.namespace}/horizontalpodautoscalers/keda-hpa-{name}"
    hpa = await scenario.get(path)
    desired = ((hpa or {}).get("status") or {}).get("desiredReplicas")
    return None if desired is None else int(desired)


async def value_of(scenario: Scenario, gateway: Process, metadata: dict[str, str], expected: float) -> float:
    """The gateway's answer for ``metadata`` over workload llm, once it is ``expected``."""
    asked = {**metadata, "scalerAddress": f"127.0.0.1:{gateway.port}", "workload": "llm"}
    return await scenario.wait_value(gateway, {**asked, "namespace": scenario.namespace}, expected)


# --- the cases ------------------------------------------------------------------------------------------------


async def test_engine_usage_mean_and_queue_sum_scale_to_the_documented_counts(scenario: Scenario, llm: Process) -> None:
    """engine queue sum: 3 + 4 + 5 waiting at 4 per replica give ceil(12 / 4) = 3 from 1 (AverageValue), and
    hold. engine usage mean: pod A's engines at 50% and 70% make 60%, pod B is at 90%, their average 75 against
    50 with metricType Value gives ceil(2 * 75 / 50) = 3 from 2 Ready replicas (the HPA's first step; Value
    then keeps multiplying while the value stays, as docs/hpa.md says)."""
    queue_value = rule_pod_queue(POD_A) + rule_pod_queue(POD_B)
    cache_value = (rule_pod_cache(POD_A) + rule_pod_cache(POD_B)) / 2
    queue_rule = rule_hpa(MetricType.AVERAGE_VALUE, value=queue_value, target=QUEUE_TARGET, current=1)
    cache_rule = rule_hpa(MetricType.VALUE, value=cache_value, target=CACHE_TARGET, current=2)
    assert MIN_REPLICAS < queue_rule < MAX_REPLICAS
    assert MIN_REPLICAS < cache_rule < MAX_REPLICAS

    queue_metadata = {"metric": "vllm_queue", "targetValue": f"{QUEUE_TARGET:g}"}
    cache_metadata = {"metric": "vllm_kv_cache", "targetValue": f"{CACHE_TARGET:g}"}
    queue_seen = await value_of(scenario, llm, queue_metadata, queue_value)
    cache_seen = await value_of(scenario, llm, cache_metadata, cache_value)
    by_queue = await scenario.deployment("by-queue", replicas=1)
    by_cache = await scenario.deployment("by-cache", replicas=2)
    await scenario.wait_pod_ips("by-cache", 2)  # both Ready before the HPA's first sync counts them
    await scenario.apply(scaled_on_llm("by-queue", llm, queue_metadata))
    await scenario.apply(scaled_on_llm("by-cache", llm, cache_metadata, MetricType.VALUE))

    await by_queue.wait_equal(queue_rule, 60)
    await by_queue.hold(queue_rule, 4)
    queue_hpa = await hpa_desired(scenario, "by-queue")
    assert queue_hpa == queue_rule, f"the HPA's desiredReplicas {queue_hpa}; steps: {by_queue.describe()}"

    _, cache_first = await by_cache.wait_for(lambda replicas: replicas != 2, 60, "other than 2")
    assert cache_first == cache_rule, f"the HPA's first step from 2 Ready replicas; steps: {by_cache.describe()}"
    scenario.record(
        f"engine queue sum (vllm_queue {queue_value:g} = 3 + 4 + 5, target {QUEUE_TARGET:g}, AverageValue): "
        f"rule {queue_rule}, real HPA {queue_hpa}; {by_queue.describe()}"
    )
    scenario.record(
        f"engine usage mean (vllm_kv_cache: pod A 50%/70% -> 60, pod B 90, average {cache_value:g}, target "
        f"{CACHE_TARGET:g}, Value from 2): rule {cache_rule}, real HPA first step {cache_first}; "
        f"{by_cache.describe()}"
    )
    print(f"engine queue sum: value {queue_seen:g}, rule {queue_rule}, real HPA {queue_hpa}")
    print(f"engine usage mean: value {cache_seen:g}, rule {cache_rule}, real HPA {cache_first}")


async def test_a_combined_signal_scales_to_the_most_any_signal_asks_for(scenario: Scenario, llm: Process) -> None:
    """combined: vllm_queue:8 asks for 12 / 8 = 1.5; vllm_kv_cache:40 for (60 + 90) / 40 = 3.75, each pod's
    cache the mean of its engines and the pods summed; the answer 3.75 gives ceil(3.75) = 4 (AverageValue),
    and holds."""
    queue_asks = (rule_pod_queue(POD_A) + rule_pod_queue(POD_B)) / COMBINED["vllm_queue"]
    cache_asks = (rule_pod_cache(POD_A) + rule_pod_cache(POD_B)) / COMBINED["vllm_kv_cache"]
    answer = max(queue_asks, cache_asks)
    expected = rule_hpa(MetricType.AVERAGE_VALUE, value=answer, target=1.0, current=1)
    assert MIN_REPLICAS < expected < MAX_REPLICAS

    signals = {"signals": ",".join(f"{metric}:{target:g}" for metric, target in COMBINED.items())}
    seen = await value_of(scenario, llm, signals, answer)
    history = await scenario.deployment("by-combined", replicas=1)
    await scenario.apply(scaled_on_llm("by-combined", llm, signals))
    await history.wait_equal(expected, 60)
    await history.hold(expected, 4)
    real = await hpa_desired(scenario, "by-combined")
    assert real == expected, f"the HPA's desiredReplicas {real}; steps: {history.describe()}"
    scenario.record(
        f"combined (vllm_queue:8 asks {queue_asks:g}, vllm_kv_cache:40 asks {cache_asks:g} from pods at 60 and 90, "
        f"answer {answer:g}): rule {expected}, real HPA {real}; {history.describe()}"
    )
    print(f"combined: value {seen:g}, rule {expected}, real HPA {real}")
