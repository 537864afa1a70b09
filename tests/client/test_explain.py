"""`gpuscaler query`'s tables: readable at 80 columns (a terminal's default, and rich's width into a pipe) and
wider, a GPU table only for a query on GPUs, titles that say how each selection makes the answer."""

from __future__ import annotations

import io
import re
from dataclasses import replace
from typing import Any

import pytest
from rich.console import Console

from gpuscaler.client.explain import Answer, Report
from gpuscaler.client.render import render_table, selection_namespace_lines, window_line
from gpuscaler.generated.gpuscaler import v1 as pb

# Pod names as a Deployment's ReplicaSet makes them, long enough to be cut off in a narrow table.
POD_A, POD_B = "trainer-7c9d8b6f5d-x2x4p", "trainer-7c9d8b6f5d-q8r2m"
UUID = "GPU-8f3c1b2a-5d6e-4f70-8a9b-0c1d2e3f4a5b"
WHOLE = "whole GPU (this pod holds it alone)"


def gpu(index: int, pod: str, *, value: float | None = 91.5, covered: float | None = None) -> pb.GpuContribution:
    """One of node gpu-node-a's GPUs, held by ``pod`` in namespace ml."""
    reason = "" if value is not None else "gpu_lost: nvmlDeviceGetUtilizationRates(gpu 3): GPU is lost"
    return pb.GpuContribution(
        index=index,
        uuid=UUID[:-1] + str(index),
        node="gpu-node-a",
        included=value is not None,
        value=value,
        samples=240 if covered is None else 15,
        reason=reason,
        namespace="ml" if pod else "",
        pod=pod,
        share=WHOLE if pod else "",
        covered_seconds=covered if value is not None else None,  # as the server sends it
    )


def report(explanation: pb.Explanation) -> Report:
    """What `gpuscaler query` collects when every RPC answered, around ``explanation`` as the client decodes it."""
    fields: dict[str, Any] = explanation.to_dict(include_default_values=True)
    spec = Answer(
        True, {"metricSpecs": [{"metricName": explanation.metric_name, "targetSizeFloat": 90.0, "targetSize": 90}]}
    )
    value = Answer(True, {"metricValues": [{"metricValueFloat": explanation.value, "metricValue": 1}]})
    return Report({}, spec, value, Answer(True, {"result": True}), Answer(True, {"result": True}), fields, None, 1)


def workload_query(*, covered: float | None = None) -> Report:
    """`namespace=ml workload=trainer profile=training`: two pods of four GPUs, one GPU lost."""
    return report(
        pb.Explanation(
            metric_name="gpuscaler-gpu_utilization-sum-podsavgd37b9bf2ff-avg2m",
            metric="gpu_utilization",
            aggregation="sum",
            window_seconds=120.0,
            window_function="avg",
            target=90.0,
            activation_threshold=10.0,
            deactivation_threshold=1.0,
            gpus=[gpu(i, POD_A if i < 4 else POD_B, value=None if i == 3 else 91.5, covered=covered) for i in range(8)],
            pods=[
                pb.PodContribution(
                    namespace="ml",
                    pod=POD_A,
                    workload="trainer",
                    node="gpu-node-a",
                    included=True,
                    value=91.5,
                    gpus=4,
                    covered_seconds=covered,
                ),
                pb.PodContribution(
                    namespace="ml",
                    pod=POD_B,
                    workload="trainer",
                    node="gpu-node-a",
                    included=True,
                    value=91.5,
                    gpus=4,
                    covered_seconds=covered,
                ),
            ],
            pod_aggregation="avg",
            selection="pods in namespace ml, workload trainer",
            value=183.0,
            least_covered_seconds=covered,
            gpus_filling=7 if covered is not None else 0,
            least_covered_node="gpu-node-a" if covered is not None else "",
        )
    )


def engine_query() -> Report:
    """`--scaled-object ml/vllm workload=vllm profile=vllm-queue`: two pods' engines, no GPU."""
    pods = [
        pb.PodContribution(
            namespace="ml",
            pod=f"vllm-6b8c9d7f4-{suffix}",
            workload="vllm",
            node="gpu-node-c",
            included=value is not None,
            value=value,
            age_seconds=0.4 if value is not None else None,
            reason="" if value is not None else "not Ready: it serves no requests yet",
        )
        for suffix, value in (("p4t7n", 3.0), ("z2w5q", 0.0), ("k9m3x", None))
    ]
    return report(
        pb.Explanation(
            metric_name="gpuscaler-vllm_queue-sum-e964c67176",
            metric="vllm_queue",
            aggregation="sum",
            target=8.0,
            pods=pods,
            selection="pods in namespace ml, workload vllm",
            value=3.0,
        )
    )


def rendered(built: Report, width: int) -> str:
    """What `gpuscaler query` prints into a pipe (no terminal) ``width`` columns wide."""
    out = io.StringIO()
    render_table(built, Console(file=out, width=width, force_terminal=False, color_system=None))
    return out.getvalue()


@pytest.mark.parametrize("width", [80, 100, 160])
@pytest.mark.parametrize(
    "built", [workload_query(), workload_query(covered=7.5), engine_query()], ids=["pods", "filling", "engine"]
)
def test_every_line_fits_and_no_name_or_number_is_cut(built: Report, width: int) -> None:
    """At 80 columns and wider no line is longer than the width, and every pod name, metric name, value and
    reason is there whole (on one line, or a reason folded over several, never cut off with an ellipsis)."""
    text = rendered(built, width)
    assert max(map(len, text.splitlines())) <= width
    assert "…" not in text
    joined = "".join(text.split())  # a folded cell reads whole once the borders and line breaks are gone
    flat = joined.replace("│", "").replace("┃", "")
    explanation = built.explanation or {}
    for pod in explanation.get("pods", []):
        assert pod["pod"] in text  # a name on one line
    assert explanation["metricName"] in flat
    for row in explanation.get("gpus", []):
        if row.get("reason"):
            assert "".join(row["reason"].split()) in flat


def test_at_80_columns_a_pod_table_merges_node_and_index_and_says_a_shared_counted_as_once() -> None:
    """Narrow, each GPU row is node/index, its pod without the namespace every row shares, value and samples;
    UUIDs are left out (in --output json), and "counted as", the same on every row, is said under the table."""
    text = rendered(workload_query(), 80)
    assert "gpu-node-a/5" in text
    assert f"│ {POD_B} " in text
    assert UUID[:-1] + "5" not in text
    assert text.count(WHOLE) == 1
    assert f"each GPU counted as: {WHOLE}" in text
    assert re.search(r"│ gpu-node-a/3 +│ \S+ +│ left out │", text), text  # why: in the lines under the tables
    assert "GPU 3 (GPU-8f3c1b2a-5d6e-4f70-8a9b-0c1d2e3f4a53) on gpu-node-a: gpu_lost:" in text


def test_at_80_columns_reasons_are_listed_under_the_table_even_when_the_answer_failed() -> None:
    """Narrow, a GPU's or a pod's reason is a line under its table, not a column squeezed to a word a line: the
    GPUs' when KEDA got an error (no "leaves out" lines then), the pods' always."""
    failed = replace(workload_query(), get_metrics=Answer(False, code="UNAVAILABLE", message="cannot be read"))
    text = rendered(failed, 80)
    assert "  GPU 3 (GPU-8f3c1b2a-5d6e-4f70-8a9b-0c1d2e3f4a53) on gpu-node-a: gpu_lost:" in text
    text = rendered(engine_query(), 80)
    assert re.search(r"│ vllm-6b8c9d7f4-k9m3x +│ gpu-node-c +│ left out │", text), text
    assert "  ml/vllm-6b8c9d7f4-k9m3x: not Ready: it serves no requests yet" in text


def test_wide_tables_show_every_column() -> None:
    """At 160 columns a GPU row has its node, index and UUID apart, and pods are named with their namespace."""
    text = rendered(workload_query(), 160)
    assert UUID[:-1] + "5" in text
    assert f"ml/{POD_B}" in text
    assert "│ gpu-node-a │     5 │" in text


def all_gpus_query() -> Report:
    """`profile=training` over every GPU: one node's four."""
    return report(
        pb.Explanation(
            metric_name="gpuscaler-gpu_utilization-sum-avg2m",
            metric="gpu_utilization",
            aggregation="sum",
            window_seconds=120.0,
            window_function="avg",
            activation_threshold=10.0,
            deactivation_threshold=1.0,
            gpus=[gpu(i, "") for i in range(4)],
            selection="all GPUs",
            value=366.0,
        )
    )


def test_titles_say_how_each_selection_makes_the_answer() -> None:
    """A pod query's GPU table does not claim a sum across GPUs: its pods table says avg per pod, then sum across
    pods; an all-GPU query's GPU table sums across GPUs."""
    text = rendered(workload_query(), 100)
    assert "across GPUs" not in text
    assert "GPUs: gpu_utilization (avg over 120s) of each selected pod's GPUs" in text
    assert "Pods: avg of each pod's GPUs, then sum across pods; activation > 10, deactivation <= 1" in text
    text = rendered(all_gpus_query(), 100)
    assert "GPUs: gpu_utilization (avg over 120s), then sum across GPUs; activation > 10, deactivation <= 1" in text
    assert "Pods:" not in text


def test_an_engine_query_shows_its_pods_and_no_gpu_table() -> None:
    """An engine signal reads pods' metrics pages, not GPUs: no GPU table, a pods table that says how the pods'
    values make the answer, with each page's age and no GPU column."""
    text = rendered(engine_query(), 80)
    assert "GPUs:" not in text
    assert "Pods: vllm_queue from each pod's metrics page, then sum across pods" in text
    header = next(line for line in text.splitlines() if "pod" in line and "node" in line)
    assert "page age" in header
    assert "GPUs" not in header
    assert "vllm-6b8c9d7f4-p4t7n" in text


def test_filling_windows_are_marked_per_gpu_per_pod_and_for_the_answer() -> None:
    """A window that covers 7.5 s of 120 s shows in a covers column of both tables and in one line that counts
    the GPUs, names the node and says the value counts them; whole windows show neither."""
    text = rendered(workload_query(covered=7.5), 80)
    assert text.count("7.5 s") == 7 + 2 + 1  # seven GPUs, two pods, the line
    assert re.search(r"┃ samples ┃ covers ┃", text), text
    line = window_line(workload_query(covered=7.5))
    assert line.startswith("Windows filling: 7 of 8 GPU(s); the least covers 7.5 s of 120 s, on node gpu-node-a")
    assert "The value counts them as they are." in line
    assert window_line(workload_query()) == ""
    assert "covers" not in rendered(workload_query(), 80)


@pytest.mark.parametrize(
    ("metadata", "says"),
    [
        pytest.param({"workload": "trainer"}, True, id="workload"),
        pytest.param({"workloadFromEnv": "trainer"}, True, id="workload-from-env"),
        pytest.param({"namespaceFromEnv": "ml", "workload": "trainer"}, False, id="namespace-from-env"),
    ],
)
def test_a_pod_selection_without_a_namespace_says_which_it_asked_in(metadata: dict[str, str], says: bool) -> None:
    """A selection of pods that names no namespace, written or from the environment, says it asked in the
    ScaledObject's."""
    asked = replace(report(pb.Explanation()), metadata=metadata, scaled_object=("team-a", "trainer-so"))
    lines = selection_namespace_lines(asked)
    assert (
        any(line.startswith("Namespace: team-a, the namespace of ScaledObject team-a/trainer-so") for line in lines)
        is says
    )
