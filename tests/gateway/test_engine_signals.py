"""Engine signals through a gateway in-process: fake engines on loopback, pods from a static directory file."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
import yaml
from grpclib import GRPCError, Status
from grpclib.client import Channel
from rich.console import Console

from gpuscaler.client.explain import collect
from gpuscaler.client.render import report_renderable
from gpuscaler.gateway.process import Gateway
from gpuscaler.generated import externalscaler as keda
from gpuscaler.generated.gpuscaler import v1 as pb
from gpuscaler.model.engines import Engine
from tests.fakes.fake_engine import FakeEngine
from tests.gateway.calls import explain, pushed, ref, value
from tests.gateway.conftest import StartGateway, StartNode
from tests.waiting import until, until_result


@pytest.fixture
async def engines() -> AsyncIterator[list[FakeEngine]]:
    """Fake engines a test starts, stopped after it."""
    started: list[FakeEngine] = []
    yield started
    for engine in started:
        await engine.stop()


async def serve(engines: list[FakeEngine], engine: Engine, **values: float) -> FakeEngine:
    """A fake ``engine`` on loopback serving ``values``."""
    fake = await FakeEngine(engine, dict(values)).start()
    engines.append(fake)
    return fake


def write_pods(path: Path, *pods: tuple[str, FakeEngine | None, dict[str, object]]) -> Path:
    """A static pod directory: each pod of workload llm on 127.0.0.1, annotated with its engine's port."""
    entries = []
    for name, fake, extra in pods:
        entry: dict[str, object] = {"namespace": "ml", "pod": name, "workload": "llm", "ip": "127.0.0.1"}
        if fake is not None:
            entry["annotations"] = {"prometheus.io/port": str(fake.port)}
        entries.append({**entry, **extra})
    path.write_text(yaml.safe_dump({"pods": entries}), encoding="utf-8")
    return path


async def gateway_with(start_node: StartNode, start_gateway: StartGateway, pods: Path) -> Gateway:
    """A gateway over one node, with ``pods`` as its pod directory, that allows scrapeInterval 250ms (tests that
    wait for a pod's change wait less)."""
    node = await start_node("node-a")
    return await start_gateway(node, pod_directory=pods, flags=("--engine-min-scrape-interval", "250ms"))


async def test_a_workloads_queue_is_the_sum_over_its_ready_pods(
    start_node: StartNode, start_gateway: StartGateway, engines: list[FakeEngine], tmp_path: Path
) -> None:
    """vllm_queue is the sum of the Ready pods' queues; a pod not Ready is listed with why and never read."""
    a = await serve(engines, Engine.VLLM, waiting=3)
    b = await serve(engines, Engine.VLLM, waiting=5)
    c = await serve(engines, Engine.VLLM, waiting=100)
    pods = write_pods(tmp_path / "pods.yaml", ("llm-a", a, {}), ("llm-b", b, {}), ("llm-c", c, {"ready": False}))
    gateway = await gateway_with(start_node, start_gateway, pods)
    assert await value(gateway, metric="vllm_queue", workload="llm") == 8.0
    explained = await explain(gateway, metric="vllm_queue", workload="llm")
    rows = {p.pod: p for p in explained.pods}
    assert (rows["llm-a"].value, rows["llm-b"].value, rows["llm-c"].included) == (3.0, 5.0, False)
    assert "not Ready" in rows["llm-c"].reason
    assert c.requests == 0
    assert rows["llm-a"].age_seconds is not None
    assert rows["llm-a"].age_seconds < 10


async def test_a_ready_pod_that_cannot_be_read_is_unavailable_naming_it_never_zero(
    start_node: StartNode, start_gateway: StartGateway, engines: list[FakeEngine], tmp_path: Path
) -> None:
    """When one Ready pod's engine stops answering, KEDA gets UNAVAILABLE naming that pod, not the others' sum."""
    a = await serve(engines, Engine.TGI, waiting=2)
    b = await serve(engines, Engine.TGI, waiting=2)
    pods = write_pods(tmp_path / "pods.yaml", ("tgi-a", a, {}), ("tgi-b", b, {}))
    gateway = await gateway_with(start_node, start_gateway, pods)
    assert await value(gateway, metric="tgi_queue", workload="llm", scrapeInterval="250ms") == 4.0
    await b.stop()

    async def unavailable() -> str | None:
        """The UNAVAILABLE message KEDA gets now, or None while it gets another answer."""
        try:
            await value(gateway, metric="tgi_queue", workload="llm", scrapeInterval="250ms")
        except GRPCError as error:
            return error.message if error.status is Status.UNAVAILABLE else None
        return None

    message = await until_result(unavailable, lambda found: found is not None, timeout=10)
    assert message is not None
    assert "pod ml/tgi-b" in message
    assert "never counts as 0" in message


@pytest.mark.parametrize(
    ("mode", "says"),
    [
        ("slow", "no answer within"),
        ("huge", "over the"),
        ("malformed", "not Prometheus text"),
        ("redirect", "HTTP 302"),
        ("gzip", "not asked for"),
        ("status", "HTTP 503"),
    ],
)
async def test_hostile_engines_are_cut_off_and_named(
    start_node: StartNode,
    start_gateway: StartGateway,
    engines: list[FakeEngine],
    tmp_path: Path,
    mode: str,
    says: str,
) -> None:
    """Slow, 100 MB, malformed, redirecting, compressed and failing pages end in UNAVAILABLE naming the pod and
    the cause, within the scrape timeout and the page limit."""
    fake = await serve(engines, Engine.VLLM, waiting=1)
    fake.mode = mode
    pods = write_pods(tmp_path / "pods.yaml", ("llm-a", fake, {}))
    node = await start_node("node-a")
    gateway = await start_gateway(node, pod_directory=pods, flags=("--engine-scrape-timeout", "0.5"))
    with pytest.raises(GRPCError) as raised:
        await value(gateway, metric="vllm_queue", workload="llm")
    assert raised.value.status is Status.UNAVAILABLE
    assert "pod ml/llm-a" in str(raised.value.message)
    assert says in str(raised.value.message)


async def test_the_combined_answer_is_the_most_replicas_any_signal_asks_for(
    start_node: StartNode, start_gateway: StartGateway, engines: list[FakeEngine], tmp_path: Path
) -> None:
    """vllm-saturation answers max(queue / 8, KV-cache sum / 80), and Explain lists what each signal asks for."""
    a = await serve(engines, Engine.VLLM, waiting=4, kv=0.9)
    b = await serve(engines, Engine.VLLM, waiting=0, kv=0.7)
    pods = write_pods(tmp_path / "pods.yaml", ("llm-a", a, {}), ("llm-b", b, {}))
    gateway = await gateway_with(start_node, start_gateway, pods)
    # queue 4 / 8 = 0.5 replicas; KV cache 90% + 70% = 160 / 80 = 2 replicas
    assert await value(gateway, profile="vllm-saturation", workload="llm") == pytest.approx(2.0)
    explained = await explain(gateway, profile="vllm-saturation", workload="llm")
    assert [s.metric for s in explained.signals] == ["vllm_queue", "vllm_kv_cache"]
    assert [s.replicas for s in explained.signals] == pytest.approx([0.5, 2.0])


async def test_gpuscaler_query_shows_each_pods_value_page_age_and_the_signals(
    start_node: StartNode, start_gateway: StartGateway, engines: list[FakeEngine], tmp_path: Path
) -> None:
    """`gpuscaler query`'s text names each engine pod with its value and page age, why one was left out, and
    what each signal of a combined query asks for."""
    a = await serve(engines, Engine.VLLM, waiting=4, kv=0.5)
    pods = write_pods(tmp_path / "pods.yaml", ("llm-a", a, {}), ("llm-b", None, {"ready": False}))
    gateway = await gateway_with(start_node, start_gateway, pods)
    channel = Channel("127.0.0.1", gateway.port)
    try:
        report = await collect(channel, {"profile": "vllm-saturation", "workload": "llm"}, scaled_object=("ml", "so"))
    finally:
        channel.close()
    console = Console(record=True, width=200)
    console.print(report_renderable(report))
    text = console.export_text()
    assert "ml/llm-a" in text
    assert re.search(r"vllm_queue .* ml/llm-a .* 4\.000 .* \d+\.\ds", text), text
    assert "not Ready" in text
    assert re.search(r"vllm_kv_cache .* 50\.000 .* 80 .* 0\.625", text), text


async def test_push_activates_within_a_scrape_of_the_queue_rising(
    start_node: StartNode, start_gateway: StartGateway, engines: list[FakeEngine], tmp_path: Path
) -> None:
    """A StreamIsActive on sglang_queue sends inactive, then active once a read sees the queue above 0."""
    fake = await serve(engines, Engine.SGLANG, waiting=0)
    pods = write_pods(tmp_path / "pods.yaml", ("sg-a", fake, {}))
    gateway = await gateway_with(start_node, start_gateway, pods)
    async with pushed(gateway, ref(metric="sglang_queue", workload="llm", scrapeInterval="250ms")) as seen:
        await until(lambda: seen == [False])
        fake.values["waiting"] = 3
        await until(lambda: seen == [False, True])


ENGINE_QUERIES_FOR_AN_AGENT = [
    pytest.param({"profile": "vllm-queue"}, "vllm_queue", id="profile-without-a-selector"),
    pytest.param({"profile": "vllm-queue", "workload": "vllm"}, "vllm_queue", id="profile-with-a-selector"),
    pytest.param({"metric": "sglang_queue", "targetValue": "4"}, "sglang_queue", id="metric-without-a-selector"),
    pytest.param({"metricType": "vllm_queue_depth", "podSelector": "app=vllm"}, "vllm_queue", id="prior-art-name"),
    pytest.param({"signals": "gpu_utilization:80,vllm_queue:8"}, "vllm_queue", id="signals-with-a-gpu-metric"),
    pytest.param({"profile": "vllm-saturation", "scaleTargetPods": "true"}, "vllm_queue", id="combined-profile"),
]


async def _every_answer(port: int, metadata: dict[str, str]) -> dict[str, GRPCError | None]:
    """The error of each call KEDA makes and of Explain, for ``metadata``, at the server on ``port``; None: no error."""
    channel = Channel("127.0.0.1", port)
    scaled = ref(**metadata)
    stub = keda.ExternalScalerStub(channel)

    async def stream() -> None:
        async for _ in stub.stream_is_active(scaled):
            return

    calls: dict[str, Callable[[], Awaitable[object]]] = {
        "GetMetricSpec": lambda: stub.get_metric_spec(scaled),
        "GetMetrics": lambda: stub.get_metrics(keda.GetMetricsRequest(scaled_object_ref=scaled, metric_name="any")),
        "IsActive": lambda: stub.is_active(scaled),
        "StreamIsActive": stream,
        "Explain": lambda: pb.AgentStub(channel).explain(pb.ExplainRequest(scaler_metadata=metadata, namespace="ml")),
    }
    answers: dict[str, GRPCError | None] = {}
    try:
        for name, call in calls.items():
            try:
                await call()
            except GRPCError as error:
                answers[name] = error
            else:
                answers[name] = None
    finally:
        channel.close()
    return answers


@pytest.mark.parametrize(("metadata", "signal"), ENGINE_QUERIES_FOR_AN_AGENT)
async def test_an_agent_refuses_engine_signals_at_every_call_with_one_message(
    start_node: StartNode, metadata: dict[str, str], signal: str
) -> None:
    """At a node agent, an engine query is FAILED_PRECONDITION from GetMetricSpec on (so KEDA makes no HPA for it),
    with or without a selector, and every call gets the same message: who reads the signal and from where, that the
    pods need selecting, and the gateway's address."""
    node = await start_node("node-a")
    answers = await _every_answer(node.port, metadata)
    assert all(error is not None for error in answers.values()), answers
    statuses = {name: error.status for name, error in answers.items() if error is not None}
    assert set(statuses.values()) == {Status.FAILED_PRECONDITION}, statuses
    messages = {error.message for error in answers.values() if error is not None}
    assert len(messages) == 1, messages
    [message] = messages
    assert message is not None
    assert message.startswith(f"{signal} is an engine signal")
    for says in (
        "the gateway reads it from the metrics pages of the workload's own pods",
        "this server is a node agent",
        "gpuscaler.gpuscaler.svc.cluster.local:6000",
        "select the pods with workload, podSelector or pod, or scaleTargetPods: 'true'",
    ):
        assert says in message, message


async def test_an_agent_still_refuses_a_typo_in_an_engine_query_first(start_node: StartNode) -> None:
    """The agent's refusal does not hide a key it does not know: that is named first, as everywhere."""
    node = await start_node("node-a")
    answers = await _every_answer(node.port, {"profile": "vllm-queue", "workloda": "vllm"})
    error = answers["GetMetricSpec"]
    assert error is not None
    assert error.status is Status.INVALID_ARGUMENT
    assert error.message == "unknown key 'workloda'; did you mean 'workload'?"


async def test_a_gateway_without_a_pod_directory_says_engine_signals_need_one(
    start_node: StartNode, start_gateway: StartGateway
) -> None:
    """FAILED_PRECONDITION naming --pod-directory and the chart value, not the agent's message."""
    gateway = await start_gateway(await start_node("node-a"))
    with pytest.raises(GRPCError) as raised:
        await value(gateway, metric="vllm_queue", workload="llm")
    assert raised.value.status is Status.FAILED_PRECONDITION
    assert "start it with --pod-directory" in str(raised.value.message)
