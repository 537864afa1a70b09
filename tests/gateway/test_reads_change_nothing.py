"""A read (Explain, `gpuscaler query`'s preview calls, a /metrics scrape) between two of KEDA's calls changes nothing
KEDA's next answer depends on: its activation state, the windows the gateway asks its agents for, the engine pods
it keeps read."""

from __future__ import annotations

from pathlib import Path

from grpclib.client import Channel

from gpuscaler.client.explain import collect
from gpuscaler.gateway.process import Gateway
from gpuscaler.generated import externalscaler as keda
from gpuscaler.model.engines import Engine
from tests.fakes.fake_engine import FakeEngine
from tests.gateway.calls import explain, ref, value
from tests.gateway.conftest import StartGateway, StartNode
from tests.gateway.test_engine_signals import engines, gateway_with, serve, write_pods
from tests.gateway.test_telemetry import scrape
from tests.waiting import until_result

__all__ = ["engines"]  # the fixture, used by name

# KEDA's trigger: active above a queue of 5, and once active, until the queue is 1 or less.
KEDA = {
    "metric": "vllm_queue",
    "workload": "llm",
    "scrapeInterval": "250ms",
    "activationThreshold": "5",
    "deactivationThreshold": "1",
}
# A trigger no ScaledObject has: on another workload's pod, and a GPU window KEDA never asked for.
NOBODYS = {"metric": "vllm_queue", "workload": "chat"}
WINDOW = {"metric": "gpu_utilization", "window": "30s", "windowFunction": "max"}


async def keda_is_active(gateway: Gateway) -> bool:
    """KEDA's own IsActive for its trigger (no preview mark)."""
    channel = Channel("127.0.0.1", gateway.port)
    try:
        return (await keda.ExternalScalerStub(channel).is_active(ref(**KEDA))).result
    finally:
        channel.close()


async def keda_sees(gateway: Gateway, queue: float) -> None:
    """Wait until KEDA's GetMetrics (which moves no activation state) answers ``queue``."""
    await until_result(lambda: value(gateway, **KEDA), lambda found: found == queue, timeout=10)


async def read_everything(gateway: Gateway) -> None:
    """Every read path once: `gpuscaler query` (its four preview calls and Explain) for KEDA's trigger and for
    one nobody asks, Explain of a window nobody asked for, and a /metrics scrape."""
    channel = Channel("127.0.0.1", gateway.port)
    try:
        mine = await collect(channel, KEDA, scaled_object=("ml", "so"))
        nobodys = await collect(channel, NOBODYS, scaled_object=("ml", "so"))
    finally:
        channel.close()
    # The previews answer what KEDA would get now: a queue of 8 would activate it.
    assert mine.is_active.fields == {"result": True}
    assert mine.stream_is_active.fields == {"result": True}
    assert mine.explanation is not None
    # The pod nobody wants is read once for this answer.
    assert nobodys.get_metrics.ok, nobodys.get_metrics
    assert nobodys.get_metrics.fields["metricValues"][0]["metricValueFloat"] == 7.0
    assert nobodys.explanation is not None
    assert nobodys.explanation["value"] == 7.0
    # Answered: the agents are asked for the window while Explain reads it, and no longer once it has.
    window = await explain(gateway, **WINDOW)
    assert window.error_code == "", window.error_message
    await scrape(gateway)


async def test_reads_between_two_keda_calls_leave_its_answers_and_the_gateways_reads_as_they_were(
    start_node: StartNode, start_gateway: StartGateway, engines: list[FakeEngine], tmp_path: Path
) -> None:
    """KEDA sees a queue of 3 (inactive); the queue rises to 8 and every read path runs (each would activate it);
    the queue falls back to 3, and KEDA's IsActive is still inactive (from inactive, 3 is below 5), as with no reads
    between. The pods the scraper keeps read and the windows the agents are asked for are those before the reads;
    the pod only the reads asked about was read, and is not kept."""
    llm = await serve(engines, Engine.VLLM, waiting=3)
    chat = await serve(engines, Engine.VLLM, waiting=7)
    pods = write_pods(tmp_path / "pods.yaml", ("llm-a", llm, {}), ("chat-a", chat, {"workload": "chat"}))
    gateway = await gateway_with(start_node, start_gateway, pods)
    assert await keda_is_active(gateway) is False
    await keda_sees(gateway, 3.0)
    wanted, windows = gateway.engines.wanted(), gateway.view.windows
    assert wanted == {("ml", "llm-a"): 0.25}

    llm.values["waiting"] = 8
    await keda_sees(gateway, 8.0)
    await read_everything(gateway)
    assert (gateway.engines.wanted(), gateway.view.windows) == (wanted, windows)
    assert chat.requests >= 1  # read once for each read path's answer, never kept

    llm.values["waiting"] = 3
    await keda_sees(gateway, 3.0)
    assert await keda_is_active(gateway) is False
    assert (gateway.engines.wanted(), gateway.view.windows) == (wanted, windows)
