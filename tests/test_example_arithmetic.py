"""Every replica count the chart's examples and docs/hpa.md state follows from their own numbers by the documented rule.

A worked case is ``worked: INPUTS -> value=V replicas=R`` (a YAML comment in an example, a line of a text block in
docs/hpa.md), wrapped over the lines after it if need be. Its inputs:

- ``pods=90x4;90x4``: the selected pods, ``;`` between pods, each pod's GPUs (or, for an engine signal, its page's
  label sets: one per data-parallel engine) ``,`` between them, ``VxN`` for N of them at V; ``gpus=90x4`` instead:
  no pod selection, each GPU its own value;
- ``metric``, ``podAggregation`` (default ``avg``), ``aggregation``, ``target``, ``metricType`` and ``current``
  (the scale target's replicas, all Ready);
- a combined trigger: ``signals=vllm_queue:8,vllm_kv_cache:80`` and ``pods.<signal>=`` for each signal;
- ``inferencePool``: the pool an EPP signal keeps (its pods are the EPP's, ``current`` the model servers').

The rule (docs/hpa.md, "The rule") is implemented here on its own, and each case is checked three ways: the rule
gives the stated value and replica count; an example's own trigger says the same metric, aggregation, target and
metricType as its line; and the real evaluator, over pods built in-process from the line, answers the same value.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
import yaml

from gpuscaler.client.hpa import MetricType, desired_replicas
from gpuscaler.model.aggregation import Aggregation
from gpuscaler.model.engines import DEFAULT_PORTS, ENGINE_SIGNALS, EngineMetric, EnginePage, LabelSets, PodScrape
from gpuscaler.model.engines import SignalKind as EngineKind
from gpuscaler.model.gpu_metrics import Metric
from gpuscaler.model.pods import PodInfo
from gpuscaler.model.samples import Attribution, AttributionState, GpuSample, PodRef, Snapshot
from gpuscaler.query.metadata import Limits, parse_metadata
from gpuscaler.query.query import CombinedQuery, EngineQuery, GpuQuery, Query, SingleQuery
from gpuscaler.signals.combined import evaluate_combined
from gpuscaler.signals.engines.evaluation import evaluate_engine
from gpuscaler.signals.engines.pods import metrics_endpoint
from gpuscaler.signals.engines.source import EngineSource
from gpuscaler.signals.evaluation import evaluate
from gpuscaler.signals.outcome import Evaluation
from tests.builders import cluster, gpu_sample, snapshot, source_of
from tests.signals.test_evaluation_workloads import Directory

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "charts" / "gpuscaler" / "examples").rglob("*.yaml"))
HPA_DOC = ROOT / "docs" / "hpa.md"
WORKED = re.compile(r"^(?:#\s*)?worked:\s*(?P<inputs>.+?)\s*->\s*(?P<outputs>.+?)\s*$")
LIMITS = Limits(history_seconds=600, cluster=True)
NOW = 100.0

# The rule's own tables, written out here rather than read from the code they check.
# A share (of a cache, of a pool's capacity): the mean of a pod's label sets.
USAGE_SIGNALS = frozenset({"vllm_kv_cache", "sglang_token_usage", "epp_saturation"})
HPA_TOLERANCE = 0.1  # the HPA keeps its count while usage / target is within 10% of 1
BUILT_GPU_METRICS = frozenset({"gpu_utilization", "sm_active", "nvlink_tx"})  # those ``gpu`` can build


@dataclass(frozen=True)
class Case:
    """One worked line: where it is, its inputs and what it states."""

    where: str
    inputs: Mapping[str, str]
    value: float
    replicas: int


def worked_lines(text: str, where: str) -> list[Case]:
    """The worked cases in ``text``; a case goes on over the lines after it until its ``->`` (a wrapped comment)."""
    cases = []
    lines = text.splitlines()
    for number, line in enumerate(lines, start=1):
        if not re.match(r"^(?:#\s*)?worked:", line.strip()):
            continue
        whole = line.strip()
        for more in lines[number:]:
            if "->" in whole:
                break
            whole += " " + more.strip().lstrip("#").strip()
        match = WORKED.match(whole)
        assert match is not None, f"{where}:{number}: a worked case without '->'"
        inputs = dict(item.split("=", 1) for item in match["inputs"].split())
        outputs = dict(item.split("=", 1) for item in match["outputs"].split())
        assert set(outputs) == {"value", "replicas"}, f"{where}:{number}: states {sorted(outputs)}"
        cases.append(Case(f"{where}:{number}", inputs, float(outputs["value"]), int(outputs["replicas"])))
    return cases


def groups(text: str) -> list[list[float]]:
    """``90x4;50,70`` as [[90, 90, 90, 90], [50, 70]]."""
    result = []
    for group in text.split(";"):
        values: list[float] = []
        for item in group.split(","):
            value, _, count = item.partition("x")
            values += [float(value)] * (int(count) if count else 1)
        result.append(values)
    return result


def combine(how: str, values: list[float]) -> float:
    """Combine ``values`` as ``how`` (sum, avg, max, min) says."""
    if how == "sum":
        return math.fsum(values)
    if how == "avg":
        return math.fsum(values) / len(values)
    return {"max": max, "min": min}[how](values)


def signal_value(metric: str, inputs: Mapping[str, str], pods_key: str, aggregation: str) -> float:
    """The value the gateway answers for one signal: each pod's value, then the pods combined."""
    if "gpus" in inputs:  # no pod selection: each GPU is its own value
        return combine(aggregation, groups(inputs["gpus"])[0])
    per_pod = []
    for values in groups(inputs[pods_key]):
        if metric in {m.value for m in Metric}:
            per_pod.append(combine(inputs.get("podAggregation", "avg"), values))  # the pod's GPUs
        else:
            per_pod.append(combine("avg" if metric in USAGE_SIGNALS else "sum", values))  # the pod's label sets
    return combine(aggregation, per_pod)


def hpa(metric_type: str, value: float, target: float, current: int) -> int:
    """The HPA's replica calculator for an external metric, in its milli-units (replica_calculator.go)."""
    usage, goal = math.ceil(value * 1000 - 1e-6), round(target * 1000)
    if metric_type == "AverageValue":
        ratio, proposal = usage / (goal * current), math.ceil(usage / goal)
    else:
        ratio = usage / goal
        proposal = math.ceil(ratio * current)
    return current if abs(1.0 - ratio) <= HPA_TOLERANCE else proposal


def rule(inputs: Mapping[str, str]) -> tuple[float, int]:
    """The value and replica count the documented rule gives for one worked line's inputs."""
    if "signals" in inputs:
        asked = [
            signal_value(name, inputs, f"pods.{name}", "sum") / float(target)
            for name, target in (pair.split(":") for pair in inputs["signals"].split(","))
        ]
        value = max(asked)
    else:
        value = signal_value(inputs["metric"], inputs, "pods", inputs["aggregation"])
    target = float(inputs.get("target", "1"))
    return value, hpa(inputs["metricType"], value, target, int(inputs["current"]))


def clamp(replicas: int, spec: Mapping[str, Any]) -> int:
    """``replicas`` within a ScaledObject's minReplicaCount and maxReplicaCount."""
    return max(int(spec.get("minReplicaCount", 0)), min(int(spec.get("maxReplicaCount", 100)), replicas))


def example_cases() -> Iterator[tuple[Path, Mapping[str, Any], Case]]:
    """Each example's ScaledObject with each of its worked cases."""
    for path in EXAMPLES:
        text = path.read_text(encoding="utf-8")
        objects = [doc for doc in yaml.safe_load_all(text) if doc and doc.get("kind") == "ScaledObject"]
        for case in worked_lines(text, str(path.relative_to(ROOT))):
            yield path, objects[0], case


DOC_CASES = worked_lines(HPA_DOC.read_text(encoding="utf-8"), "docs/hpa.md")
EXAMPLE_CASES = list(example_cases())


def test_every_example_that_scales_past_one_replica_works_a_case() -> None:
    """An example whose ScaledObject may run more than one replica states a worked case: its comments say what
    its numbers ask for, so the reasoning is there to check."""
    worked = {path for path, _, _ in EXAMPLE_CASES}
    for path in EXAMPLES:
        for scaled in yaml.safe_load_all(path.read_text(encoding="utf-8")):
            if scaled and scaled.get("kind") == "ScaledObject" and scaled["spec"].get("maxReplicaCount", 100) > 1:
                assert path in worked, f"{path.relative_to(ROOT)} states no 'worked:' line"


@pytest.mark.parametrize("case", DOC_CASES, ids=[c.where for c in DOC_CASES])
def test_the_docs_worked_cases_follow_the_rule(case: Case) -> None:
    """docs/hpa.md's value and replica count for each case are what the rule gives from its inputs."""
    value, replicas = rule(case.inputs)
    assert value == pytest.approx(case.value), case.where
    assert replicas == case.replicas, case.where


@pytest.mark.parametrize(("path", "scaled", "case"), EXAMPLE_CASES, ids=[c.where for _, _, c in EXAMPLE_CASES])
def test_each_examples_replica_count_follows_from_its_own_numbers(
    path: Path, scaled: Mapping[str, Any], case: Case
) -> None:
    """An example's stated value and replicas are the rule's from its inputs, within its min and max replicas, and
    the inputs are its trigger's: the same metric, aggregation, target and metricType."""
    value, replicas = rule(case.inputs)
    assert value == pytest.approx(case.value), case.where
    assert clamp(replicas, scaled["spec"]) == case.replicas, case.where
    trigger = scaled["spec"]["triggers"][0]
    assert case.inputs["metricType"] == trigger.get("metricType", "AverageValue"), case.where
    query = parse(trigger["metadata"], scaled["metadata"])
    if isinstance(query.value, CombinedQuery):
        stated = dict(pair.split(":") for pair in case.inputs["signals"].split(","))
        assert {part.query.metric.value: part.target for part in query.value.signals} == {
            name: float(target) for name, target in stated.items()
        }, case.where
        return
    assert query.value.metric.value == case.inputs["metric"], case.where
    assert query.value.aggregation.value == case.inputs["aggregation"], case.where
    assert query.target == float(case.inputs["target"]), case.where
    pods = query.value.pods
    assert pods is not None, case.where
    if isinstance(query.value, GpuQuery):
        assert pods.pod_aggregation.value == case.inputs.get("podAggregation", "avg"), case.where


def parse(metadata: Mapping[str, str], scaled_metadata: Mapping[str, str]) -> Query:
    """A trigger's metadata as the gateway parses it for its ScaledObject."""
    return parse_metadata(
        {key: str(value) for key, value in metadata.items()},
        LIMITS,
        namespace=scaled_metadata.get("namespace", "default"),
        name=scaled_metadata["name"],
    )


def doc_query(inputs: Mapping[str, str]) -> Query:
    """The trigger a docs case describes: its metric, aggregations and target, over workload w's pods if it has
    pods."""
    if "signals" in inputs:
        return parse({"signals": inputs["signals"], "workload": "w"}, {"name": "w"})
    keys = ("metric", "aggregation", "podAggregation", "inferencePool")
    metadata = {key: inputs[key] for key in keys if key in inputs}
    metadata["targetValue"] = inputs["target"]
    if "pods" in inputs:
        metadata["workload"] = "w"
    return parse(metadata, {"name": "w"})


def gpu(index: int, metric: str, value: float, pods: tuple[PodRef, ...]) -> GpuSample:
    """GPU ``index`` on node-a reading ``value`` of ``metric``, held by ``pods``."""
    if metric == "gpu_utilization":
        return gpu_sample(index, util=value, pods=pods, node="node-a")
    if metric == "sm_active":
        return gpu_sample(index, sm_active=value, pods=pods, node="node-a")
    assert metric == "nvlink_tx", metric
    return gpu_sample(index, nvlink_tx=value, pods=pods, node="node-a")


def resolved(single: SingleQuery, workload: str) -> SingleQuery:
    """``single`` with scaleTargetPods made the workload it names (the directory built here knows no scale target)."""
    pods = single.pods
    if pods is None or pods.scale_target is None:
        return single
    pods = replace(pods, scale_target=None, workload=workload)
    if isinstance(single, EngineQuery):
        return replace(single, pods=pods)
    return replace(single, pods=pods)


class Built:
    """The pods of one case, in-process: their GPUs in a node's snapshot and their engines' pages."""

    def __init__(self, inputs: Mapping[str, str], workload: str, labels: Mapping[str, str] | None = None) -> None:
        self.inputs = inputs
        self.workload = workload
        self.labels = {"app": workload, **(labels or {})}
        self.directory = Directory()
        self.samples: list[GpuSample] = []
        self.scrapes: dict[tuple[str, str], PodScrape] = {}

    def pod(self, number: int) -> str:
        return f"{self.workload}-{number}"

    def add_gpus(self, metric: str, key: str) -> None:
        if "gpus" in self.inputs:
            for value in groups(self.inputs["gpus"])[0]:
                self.samples.append(gpu(len(self.samples), metric, value, ()))
            return
        for number, values in enumerate(groups(self.inputs[key])):
            holder = (PodRef("default", self.pod(number), "main"),)
            for value in values:
                self.samples.append(gpu(len(self.samples), metric, value, holder))
            self.add_pod(number)

    def add_pages(self, metric: EngineMetric, key: str) -> None:
        signal = ENGINE_SIGNALS[metric]
        for number, values in enumerate(groups(self.inputs[key])):
            info = self.add_pod(number)
            endpoint = metrics_endpoint(info, signal.engine)
            assert not isinstance(endpoint, str), endpoint
            name = signal.series[0]
            if signal.kind is EngineKind.GAUGE:  # beside the series other signals of a combined trigger read
                had = self.scrapes.get((info.namespace, info.pod))
                total = sum(values) / signal.scale
                pool = self.inputs.get("inferencePool")
                page = EnginePage(
                    NOW,
                    {**(had.page.values if had and had.page else {}), name: total},
                    {**(had.page.counts if had and had.page else {}), name: len(values)},
                    {
                        **(had.page.pools if had and had.page else {}),
                        **({name: {pool: (total, len(values))}} if signal.pool_label and pool else {}),
                    },
                )
                self.scrapes[(info.namespace, info.pod)] = PodScrape(endpoint.url, page)
            else:  # a counter's increase over 10 s: each label set's value, 10 requests finished
                assert len(values) == 1, "a rate or a ratio is one value per pod"
                counted = values[0] * 10 if signal.kind is EngineKind.RATE else values[0] / signal.scale * 10
                before = {name: 0.0, **({signal.per: 0.0} if signal.per else {})}
                after = {name: counted, **({signal.per: 10.0} if signal.per else {})}
                self.scrapes[(info.namespace, info.pod)] = PodScrape(
                    endpoint.url, EnginePage(NOW, after), EnginePage(NOW - 10.0, before)
                )

    def add_pod(self, number: int) -> PodInfo:
        existing = self.directory.lookup("default", self.pod(number))
        if existing is not None:
            return existing
        info = PodInfo(
            "default",
            self.pod(number),
            self.labels,
            self.workload,
            "Deployment",
            node="node-a",
            holds_gpus=True,
            ip=f"10.0.0.{number + 1}",
            phase="Running",
            ready=True,
            ports=tuple(("", port) for port in DEFAULT_PORTS.values()),
        )
        self.directory.add(info)
        return info

    def view(self) -> Snapshot:
        node = replace(
            snapshot(1, NOW, tuple(self.samples), node="node-a"), attribution=Attribution(AttributionState.OK)
        )
        return cluster(node, at=NOW)

    def evaluate(self, single: SingleQuery) -> Evaluation:
        if isinstance(single, EngineQuery):
            engines = cast("EngineSource", SimpleNamespace(timeout_seconds=1.0, max_pods=100, scrape=self.scrapes.get))
            return evaluate_engine(single, engines, self.directory, None, now=NOW)
        return evaluate(single, source_of(self.view()), now=NOW, stale_after=5.0, directory=self.directory)


def evaluated(
    query: Query, inputs: Mapping[str, str], workload: str, labels: Mapping[str, str] | None = None
) -> float | None:
    """The real evaluator's value for ``query`` over pods built from ``inputs`` (labelled ``labels`` too); None where
    a GPU metric has no builder here (the rule's check still holds for it)."""
    built = Built(inputs, workload, labels)
    value = query.value
    if isinstance(value, CombinedQuery):
        parts = []
        for part in value.signals:
            single = resolved(part.query, workload)
            parts.append(replace(part, query=single))
            add(built, single, f"pods.{single.metric.value}")
        return built_value(built, evaluate_combined(CombinedQuery(tuple(parts)), built.evaluate))
    single = resolved(value, workload)
    if isinstance(single, GpuQuery) and single.metric.value not in BUILT_GPU_METRICS:
        return None
    add(built, single, "pods")
    return built_value(built, built.evaluate(single))


def add(built: Built, single: SingleQuery, key: str) -> None:
    """``single``'s inputs built: GPUs for a GPU metric, pages for an engine query."""
    if isinstance(single, EngineQuery):
        built.add_pages(single.metric, key)
    else:
        built.add_gpus(single.metric.value, key)


def built_value(built: Built, evaluation: Evaluation) -> float:
    """The evaluation's value, or a failure that says why."""
    assert evaluation.error is None, evaluation.error
    assert evaluation.value is not None
    return evaluation.value


@pytest.mark.parametrize("case", DOC_CASES, ids=[c.where for c in DOC_CASES])
def test_the_evaluator_answers_each_docs_cases_value(case: Case) -> None:
    """Over pods built from a docs case's inputs, the gateway's evaluator answers the value the case states."""
    answer = evaluated(doc_query(case.inputs), case.inputs, "w")
    if answer is not None:
        assert answer == pytest.approx(case.value), case.where


@pytest.mark.parametrize(("path", "scaled", "case"), EXAMPLE_CASES, ids=[c.where for _, _, c in EXAMPLE_CASES])
def test_the_evaluator_answers_each_examples_value(path: Path, scaled: Mapping[str, Any], case: Case) -> None:
    """Over pods built from an example's worked line, its own trigger evaluates to the value the line states."""
    trigger = scaled["spec"]["triggers"][0]["metadata"]
    workload = trigger.get("workload", scaled["spec"]["scaleTargetRef"]["name"])
    # Pods a podSelector of key=value pairs selects (the EPP's pods of the serving-from-zero example).
    selector = [pair.split("=", 1) for pair in trigger.get("podSelector", "").split(",") if "=" in pair]
    labels = {key.strip(): value.strip() for key, value in selector}
    answer = evaluated(parse(trigger, scaled["metadata"]), case.inputs, workload, labels)
    if answer is not None:
        assert answer == pytest.approx(case.value), case.where


def test_the_rule_agrees_with_the_hpa_preview_and_the_engine_table() -> None:
    """The rule's HPA step is the one ``gpuscaler query --replicas`` prints, and its usage signals are the engine
    table's averaged ones: three independent statements of one arithmetic."""
    for metric_type in ("AverageValue", "Value"):
        for value in (20.0, 90.0, 180.0, 360.0, 756.0):
            for current in (1, 2, 3, 4, 8):
                preview = desired_replicas(MetricType(metric_type), value=value, target=70.0, current=current)
                assert hpa(metric_type, value, 70.0, current) == preview, (metric_type, value, current)
    averaged = {metric.value for metric, signal in ENGINE_SIGNALS.items() if signal.label_sets is LabelSets.MEAN}
    assert averaged == USAGE_SIGNALS
    assert all(signal.aggregation is Aggregation.SUM for m, signal in ENGINE_SIGNALS.items() if signal.additive)
    # A pool's saturation is the pool's, whichever EPP pod reads it: the most any reads, never their sum.
    assert ENGINE_SIGNALS[EngineMetric.EPP_SATURATION].aggregation is Aggregation.MAX


def test_the_cases_cover_multi_gpu_pods_engines_and_combined_signals() -> None:
    """docs/hpa.md works 1-, 2-, 4- and 8-GPU pods under both metricTypes, with and without a pod selection, an
    engine usage mean, a queue sum and a combined signal."""
    inputs = [c.inputs for c in DOC_CASES]
    sizes = {len(groups(i["pods"])[0]) for i in inputs if "pods" in i and i.get("metric") in BUILT_GPU_METRICS}
    assert {1, 2, 4, 8} <= sizes
    for size in (1, 2, 4, 8):
        for metric_type in ("AverageValue", "Value"):
            assert any(
                i.get("metricType") == metric_type and "pods" in i and len(groups(i["pods"])[0]) == size for i in inputs
            ), (size, metric_type)
    assert any("gpus" in i for i in inputs)
    assert any(i.get("metric") in USAGE_SIGNALS and any(len(p) > 1 for p in groups(i["pods"])) for i in inputs)
    assert any(i.get("metric", "").endswith("_queue") for i in inputs)
    assert any("signals" in i for i in inputs)
    assert {i.get("metric") for i in inputs if "inferencePool" in i} >= {"epp_queue", "epp_saturation"}
