"""A selection that matches no pod, at a running gateway: KEDA still gets 0 and inactive; Explain, the log, /metrics
and `gpuscaler query` say which selection and what it may have meant; reading it moves nothing."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import structlog
from grpclib.client import Channel
from prometheus_client.parser import text_string_to_metric_families

from gpuscaler.gateway.process import Gateway
from gpuscaler.generated import externalscaler as keda
from gpuscaler.generated.gpuscaler import v1 as pb
from gpuscaler.server.preview import PREVIEW_METADATA
from tests.fakes.fake_kubelet import Assignment
from tests.gateway.calls import view_has
from tests.gateway.conftest import StartGateway, StartNode
from tests.monitoring.promql import exposition
from tests.test_cli import run_cli
from tests.waiting import until

DIRECTORY = """
pods:
  - {namespace: ml, pod: trainer-7c9d-a, workload: trainer, workloadKind: Deployment, node: node-a, gpus: true}
scaledObjects:
  - {namespace: ml, name: sleeper-so, scaleTargetRef: {name: sleeper}}
"""


@pytest.fixture
async def gateway(start_node: StartNode, start_gateway: StartGateway, tmp_path: Path) -> Gateway:
    """A gateway over node-a, whose GPU 0 trainer's one pod holds, with trainer at 80%; sleeper is at zero."""
    node = await start_node("node-a", gpus=2)
    node.kubelet.assign([Assignment("ml", "trainer-7c9d-a", (node.uuid(0),))])
    node.set(80, 10)
    directory = tmp_path / "pods.yaml"
    directory.write_text(DIRECTORY)
    started = await start_gateway(node, pod_directory=directory)
    await view_has(started, 1)

    def trainer_busy() -> bool:
        latest = started.view.latest
        return latest is not None and any(s.pods and s.gpu_utilization_percent == 80 for s in latest.samples)

    await until(trainer_busy, timeout=10)
    return started


async def keda_round(channel: Channel, name: str, preview: bool = False, **metadata: str) -> tuple[float, bool]:
    """KEDA's poll for ScaledObject ml/NAME: GetMetricSpec, GetMetrics with its name, IsActive; with ``preview``,
    marked as `gpuscaler query` marks its calls."""
    stub = keda.ExternalScalerStub(channel, metadata=PREVIEW_METADATA if preview else None)
    ref = keda.ScaledObjectRef(name=name, namespace="ml", scaler_metadata=metadata)
    spec = await stub.get_metric_spec(ref)
    request = keda.GetMetricsRequest(scaled_object_ref=ref, metric_name=spec.metric_specs[0].metric_name)
    value = (await stub.get_metrics(request)).metric_values[0].metric_value_float
    return value, (await stub.is_active(ref)).result


async def explain(channel: Channel, name: str, **metadata: str) -> pb.Explanation:
    """Explain for ScaledObject ml/NAME."""
    request = pb.ExplainRequest(scaler_metadata=metadata, namespace="ml", name=name)
    return await pb.AgentStub(channel).explain(request)


def activation_states(gateway: Gateway) -> int:
    """How many queries' activation states the gateway keeps (what IsActive's hysteresis reads)."""
    return len(gateway.evaluator._states)


async def test_keda_gets_zero_and_explain_says_the_selection_matched_nothing(gateway: Gateway) -> None:
    """workload=trainr: GetMetrics 0 and IsActive false, as for a workload at zero; Explain says no pod or
    scaleTargetRef ever carried the name and suggests trainer, and neither Explain nor the log moves a state."""
    channel = Channel("127.0.0.1", gateway.port)
    try:
        before = await explain(channel, "typo-so", workload="trainr")
        assert (before.value, before.active) == (0.0, False)
        assert before.empty_selection is not None
        assert (before.empty_selection.seen, before.empty_selection.did_you_mean) == ("no", ["trainer"])
        assert "never scales up" in before.empty_selection.message
        assert activation_states(gateway) == 0  # Explain reads: it made no state
        assert gateway.evaluator.empty_selections is not None
        assert len(gateway.evaluator.empty_selections) == 0  # nor did it feed KEDA's findings

        with structlog.testing.capture_logs() as logged:
            assert [await keda_round(channel, "typo-so", workload="trainr") for _ in range(3)] == [(0.0, False)] * 3
            states = activation_states(gateway)
            after = await explain(channel, "typo-so", workload="trainr")
            assert await keda_round(channel, "typo-so", workload="trainr") == (0.0, False)
        assert activation_states(gateway) == states == 1
        assert after.empty_selection == before.empty_selection
        warnings = [entry for entry in logged if entry["event"] == "selection_matches_nothing"]
        assert [(w["scaled_object"], w["seen"], w["did_you_mean"]) for w in warnings] == [
            ("ml/typo-so", "no", ["trainer"])
        ]

        value, active = await keda_round(channel, "trainer-so", workload="trainer")
        assert value == pytest.approx(80.0)
        assert active is True
        assert (await explain(channel, "trainer-so", workload="trainer")).empty_selection is None
    finally:
        channel.close()


async def test_a_preview_moves_nothing_that_keda_s_own_calls_move(gateway: Gateway) -> None:
    """The calls `gpuscaler query` makes (marked as a preview) get KEDA's answers and leave the activation states,
    the record of empty selections and the log as found; the same calls unmarked move all three."""
    channel = Channel("127.0.0.1", gateway.port)
    record = gateway.evaluator.empty_selections
    assert record is not None
    try:
        with structlog.testing.capture_logs() as logged:
            assert await keda_round(channel, "typo-so", preview=True, workload="trainr") == (0.0, False)
            value, active = await keda_round(channel, "trainer-so", preview=True, workload="trainer")
            assert value == pytest.approx(80.0)
            assert active is True
            stream = keda.ExternalScalerStub(channel, metadata=PREVIEW_METADATA).stream_is_active(
                keda.ScaledObjectRef(name="trainer-so", namespace="ml", scaler_metadata={"workload": "trainer"})
            )
            async with asyncio.timeout(10):
                assert [message.result async for message in stream] == [True]
            assert (activation_states(gateway), len(record)) == (0, 0)
            assert [e for e in logged if e["event"] in ("selection_matches_nothing", "stream_opened")] == []

            await keda_round(channel, "typo-so", workload="trainr")
            await keda_round(channel, "trainer-so", workload="trainer")
        assert (activation_states(gateway), len(record)) == (2, 1)
        assert [e["scaled_object"] for e in logged if e["event"] == "selection_matches_nothing"] == ["ml/typo-so"]
    finally:
        channel.close()


async def test_metrics_name_each_scaled_object_whose_selection_matches_nothing(gateway: Gateway) -> None:
    """The gauge has one series per ScaledObject's trigger, seen=no for a typo and seen=yes for a workload at zero
    that a ScaledObject's scaleTargetRef names; a selection with pods has none."""
    channel = Channel("127.0.0.1", gateway.port)
    try:
        await keda_round(channel, "typo-so", workload="trainr")
        await keda_round(channel, "sleeper-so", scaleTargetPods="true")
        await keda_round(channel, "trainer-so", workload="trainer")
        sleeper = await explain(channel, "sleeper-so", scaleTargetPods="true")
    finally:
        channel.close()
    assert sleeper.empty_selection is not None
    assert (sleeper.empty_selection.seen, sleeper.empty_selection.seen_as) == ("yes", ["scaleTargetRef"])
    assert gateway.frontend.metrics is not None
    page = await exposition(gateway.frontend.metrics.port)
    [family] = [f for f in text_string_to_metric_families(page) if f.name == "gpuscaler_gateway_selection_empty"]
    assert {(sample.labels["scaled_object"], sample.labels["seen"]): sample.value for sample in family.samples} == {
        ("typo-so", "no"): 1.0,
        ("sleeper-so", "yes"): 1.0,
    }


async def test_query_says_the_namespace_it_asked_in_and_what_matched_nothing(
    gateway: Gateway, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`gpuscaler query workload=trainr` exits 0 as KEDA's answer is a value, says it asked in namespace default as
    ScaledObject default/gpuscaler-query, and that ml/trainer is the close name."""
    monkeypatch.setenv("COLUMNS", "400")  # one line per sentence: rich wraps at the terminal's width
    address = f"127.0.0.1:{gateway.port}"
    assert await run_cli("query", "--address", address, "workload=trainr") == 0
    table = capsys.readouterr().out
    assert "Namespace: default, the namespace of ScaledObject default/gpuscaler-query" in table
    assert "Namespace default has no pods." in table
    assert "Did you mean ml/trainer (namespace/workload)?" in table

    assert await run_cli("query", "--address", address, "--output", "json", "workload=trainr") == 0
    report = json.loads(capsys.readouterr().out)
    assert report["scaled_object"] == ["default", "gpuscaler-query"]
    assert report["get_metrics"]["fields"]["metricValues"][0]["metricValueFloat"] == 0.0
    assert report["explanation"]["emptySelection"]["didYouMeanElsewhere"] == ["ml/trainer"]

    assert await run_cli("query", "--address", address, "namespace=ml", "workload=trainer") == 0
    table = capsys.readouterr().out
    assert "Namespace: " not in table
    assert "none matches" not in table
    # A read: no entry for default/gpuscaler-query, which does not exist, and no activation state moved.
    assert gateway.evaluator.empty_selections is not None
    assert (len(gateway.evaluator.empty_selections), activation_states(gateway)) == (0, 0)
