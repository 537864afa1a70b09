"""Push from zero through a gateway in-process: a StreamIsActive on the epp-wake profile over a fake EPP on loopback."""

from __future__ import annotations

from pathlib import Path

import pytest
from grpclib import GRPCError, Status
from grpclib.client import Channel

from gpuscaler.generated import externalscaler as keda
from gpuscaler.model.engines import Engine
from tests.fakes.fake_engine import FakeEngine
from tests.gateway.calls import pushed, ref
from tests.gateway.conftest import StartGateway, StartNode
from tests.gateway.test_engine_signals import engines, gateway_with, write_pods
from tests.waiting import until

__all__ = ["engines"]  # the fixture, used by name

POOL = "vllm-llama3-8b-instruct"  # the fake EPP's --pool-name
WAKE = {"profile": "epp-wake", "inferencePool": POOL, "workload": "llm", "scrapeInterval": "250ms"}


class CountedEpp(FakeEngine):
    """A fake EPP that records the queue each page served showed, and hangs every read after ``hold_after`` pages
    showed a queue: a push that arrives then came from those pages alone, not a later scrape or a poll."""

    served: list[float]
    hold_after: int | None = None

    def page(self) -> str:
        waiting = self.values.get("waiting", 0.0)
        if self.hold_after is not None and sum(1 for q in self.served if q > 0) >= self.hold_after:
            self.mode = "hang"  # this read and every later one: the served list stops here
            return super().page()
        self.served.append(waiting)
        return super().page()


async def is_active(port: int) -> bool:
    """KEDA's IsActive for the wake query."""
    channel = Channel("127.0.0.1", port)
    try:
        return (await keda.ExternalScalerStub(channel).is_active(ref(**WAKE))).result
    finally:
        channel.close()


async def test_the_first_queued_request_is_pushed_after_the_one_scrape_that_sees_it(
    start_node: StartNode, start_gateway: StartGateway, engines: list[FakeEngine], tmp_path: Path
) -> None:
    """The stream sends inactive for an idle pool; the queue goes 0 -> 1, and the push of active arrives while the
    EPP has served exactly one page showing it and holds every later read (no second scrape, no KEDA poll)."""
    epp = CountedEpp(Engine.EPP, {"waiting": 0, "running": 0, "kv": 0.0})
    epp.served = []
    await epp.start()
    engines.append(epp)
    gateway = await gateway_with(start_node, start_gateway, write_pods(tmp_path / "pods.yaml", ("epp-a", epp, {})))
    async with pushed(gateway, ref(**WAKE)) as seen:
        await until(lambda: seen == [False])
        epp.hold_after = 1
        epp.values["waiting"] = 1
        await until(lambda: seen == [False, True])
        assert [q for q in epp.served if q > 0] == [1]


async def test_running_requests_keep_the_pool_active_until_none_is_left(
    start_node: StartNode, start_gateway: StartGateway, engines: list[FakeEngine], tmp_path: Path
) -> None:
    """Queued 1 -> active; the request dispatched (queue 0, 3 running) -> still active, no push of inactive; all
    done -> inactive."""
    epp = FakeEngine(Engine.EPP, {"waiting": 1, "running": 0, "kv": 0.0})
    await epp.start()
    engines.append(epp)
    gateway = await gateway_with(start_node, start_gateway, write_pods(tmp_path / "p.yaml", ("epp-a", epp, {})))
    async with pushed(gateway, ref(**WAKE)) as seen:
        await until(lambda: seen == [True])
        epp.values.update(waiting=0, running=3)
        reads = epp.requests
        await until(lambda: epp.requests >= reads + 3)  # two reads after one that saw the change
        assert seen == [True]
        assert await is_active(gateway.port)
        epp.values.update(running=0)
        await until(lambda: seen == [True, False])


async def test_without_a_ready_epp_the_wake_query_is_unavailable_never_inactive(
    start_node: StartNode, start_gateway: StartGateway, engines: list[FakeEngine], tmp_path: Path
) -> None:
    """The only EPP pod NotReady (a failover): IsActive is UNAVAILABLE naming it, never inactive."""
    epp = FakeEngine(Engine.EPP, {"waiting": 0, "running": 0, "kv": 0.0})
    await epp.start()
    engines.append(epp)
    pods = write_pods(tmp_path / "pods.yaml", ("epp-a", epp, {"ready": False}))
    gateway = await gateway_with(start_node, start_gateway, pods)
    with pytest.raises(GRPCError) as raised:
        await is_active(gateway.port)
    assert raised.value.status is Status.UNAVAILABLE
    assert "no Ready epp pod is selected (pod ml/epp-a: not Ready" in (raised.value.message or "")
