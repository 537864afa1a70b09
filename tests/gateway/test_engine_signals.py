"""Engine signals through a gateway in-process: fake engines on loopback, pods from a static directory file."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import yaml
from grpclib import GRPCError, Status
from grpclib.client import Channel

from gpuscaler.gateway.process import Gateway
from gpuscaler.generated import externalscaler as keda
from gpuscaler.model.engines import Engine
from tests.engines.calls import explain, metric_value
from tests.fakes.fake_engine import FakeEngine
from tests.gateway.conftest import StartGateway, StartNode
from tests.waiting import until


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
    """A gateway over one node, with ``pods`` as its pod directory."""
    node = await start_node("node-a")
    return await start_gateway(node, pod_directory=pods)


async def test_a_workloads_queue_is_the_sum_over_its_ready_pods(
    start_node: StartNode, start_gateway: StartGateway, engines: list[FakeEngine], tmp_path: Path
) -> None:
    """A workloads queue is the sum over its ready pods."""
    a = await serve(engines, Engine.VLLM, waiting=3)
    b = await serve(engines, Engine.VLLM, waiting=5)
    c = await serve(engines, Engine.VLLM, waiting=100)
    pods = write_pods(tmp_path / "pods.yaml", ("llm-a", a, {}), ("llm-b", b, {}), ("llm-c", c, {"ready": False}))
    gateway = await gateway_with(start_node, start_gateway, pods)
    assert await metric_value(gateway, metric="vllm_queue", workload="llm") == 8.0
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
    """A ready pod that cannot be read is unavailable naming it never zero."""
    a = await serve(engines, Engine.TGI, waiting=2)
    b = await serve(engines, Engine.TGI, waiting=2)
    pods = write_pods(tmp_path / "pods.yaml", ("tgi-a", a, {}), ("tgi-b", b, {}))
    gateway = await gateway_with(start_node, start_gateway, pods)
    assert await metric_value(gateway, metric="tgi_queue", workload="llm", scrapeInterval="250ms") == 4.0
    await b.stop()

    async def unavailable() -> str | None:
        """unavailable"""
        try:
            await metric_value(gateway, metric="tgi_queue", workload="llm", scrapeInterval="250ms")
        except GRPCError as error:
            return error.message if error.status is Status.UNAVAILABLE else None
        return None

    message = await until_message(unavailable)
    assert "pod ml/tgi-b" in message
    assert "never counts as 0" in message


async def until_message(check) -> str:  # type: ignore[no-untyped-def]
    """The first message ``check`` returns, polled until it has one (10 s at most)."""
    found: list[str] = []

    async def probe() -> bool:
        """probe"""
        message = await check()
        if message:
            found.append(message)
        return bool(message)

    for _ in range(200):
        if await probe():
            return found[0]
        await asyncio.sleep(0.05)
    raise AssertionError("the answer never became UNAVAILABLE")


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
    """Hostile engines are cut off and named."""
    fake = await serve(engines, Engine.VLLM, waiting=1)
    fake.mode = mode
    pods = write_pods(tmp_path / "pods.yaml", ("llm-a", fake, {}))
    node = await start_node("node-a")
    gateway = await start_gateway(node, pod_directory=pods, flags=("--engine-scrape-timeout", "0.5"))
    with pytest.raises(GRPCError) as raised:
        await metric_value(gateway, metric="vllm_queue", workload="llm")
    assert raised.value.status is Status.UNAVAILABLE
    assert "pod ml/llm-a" in str(raised.value.message)
    assert says in str(raised.value.message)


async def test_the_combined_answer_is_the_most_replicas_any_signal_asks_for(
    start_node: StartNode, start_gateway: StartGateway, engines: list[FakeEngine], tmp_path: Path
) -> None:
    """The combined answer is the most replicas any signal asks for."""
    a = await serve(engines, Engine.VLLM, waiting=4, kv=0.9)
    b = await serve(engines, Engine.VLLM, waiting=0, kv=0.7)
    pods = write_pods(tmp_path / "pods.yaml", ("llm-a", a, {}), ("llm-b", b, {}))
    gateway = await gateway_with(start_node, start_gateway, pods)
    # queue 4 / 8 = 0.5 replicas; KV cache 90% + 70% = 160 / 80 = 2 replicas
    assert await metric_value(gateway, profile="vllm-saturation", workload="llm") == pytest.approx(2.0)
    explained = await explain(gateway, profile="vllm-saturation", workload="llm")
    assert [s.metric for s in explained.signals] == ["vllm_queue", "vllm_kv_cache"]
    assert [s.replicas for s in explained.signals] == pytest.approx([0.5, 2.0])


async def test_push_activates_within_a_scrape_of_the_queue_rising(
    start_node: StartNode, start_gateway: StartGateway, engines: list[FakeEngine], tmp_path: Path
) -> None:
    """Push activates within a scrape of the queue rising."""
    fake = await serve(engines, Engine.SGLANG, waiting=0)
    pods = write_pods(tmp_path / "pods.yaml", ("sg-a", fake, {}))
    gateway = await gateway_with(start_node, start_gateway, pods)
    channel = Channel("127.0.0.1", gateway.port)
    seen: list[bool] = []
    metadata = {"metric": "sglang_queue", "workload": "llm", "scrapeInterval": "250ms"}
    stream = keda.ExternalScalerStub(channel).stream_is_active(
        keda.ScaledObjectRef(name="so", namespace="ml", scaler_metadata=metadata)
    )

    async def read() -> None:
        """read"""
        async for message in stream:
            seen.append(message.result)

    reader = asyncio.create_task(read())
    try:
        await until(lambda: seen == [False])
        fake.values["waiting"] = 3
        await until(lambda: seen == [False, True])
    finally:
        reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)
        channel.close()


async def test_an_agent_refuses_engine_signals_saying_they_need_the_gateway(start_node: StartNode) -> None:
    """An agent refuses engine signals saying they need the gateway."""
    node = await start_node("node-a")
    channel = Channel("127.0.0.1", node.port)
    try:
        with pytest.raises(GRPCError) as raised:
            await keda.ExternalScalerStub(channel).is_active(
                keda.ScaledObjectRef(
                    name="so", namespace="ml", scaler_metadata={"metric": "vllm_queue", "workload": "llm"}
                )
            )
    finally:
        channel.close()
    assert raised.value.status is Status.FAILED_PRECONDITION
    assert "point scalerAddress at the gateway" in str(raised.value.message)
