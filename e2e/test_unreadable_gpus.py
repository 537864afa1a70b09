"""Unreadable is not zero: a busy node whose GPUs all hang, behind a real gateway, is unknown, never 0 (issue 19).

Two agents as real processes: node A idle (two GPUs at 0%), node B busy (four GPUs at 95%). Every one of B's
GPUs is made to hang with ``gpuscaler fake fail --error timeout``, as a user would. Agent B, asked about its own
GPUs, answers UNAVAILABLE; the gateway must too, naming node B: no 0 from GetMetrics, no ``false`` from
IsActive, and no ``false`` pushed on the stream that was ``true`` before. ``minNodes`` is the explicit way to
answer from the rest: node B then counts as not heard.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial
from pathlib import Path

import pytest
from grpclib.const import Status
from grpclib.exceptions import GRPCError

from e2e.support.cluster import CONSOLE_SCRIPT, Cluster, Pushes, answer, eventually, explain, is_active
from e2e.support.process import Process
from tests.fakes.fake_kubelet import FakeKubelet, short_socket_path

IDLE, BUSY = "node-a", "node-b"
BUSY_GPUS = 4
LOAD = 95.0
ACTIVE = {"activationThreshold": "10"}
# Compositions the gateway makes after it has seen node B's failure, before the stream's silence is judged:
# each re-evaluates the open stream's query (one every agent update, at least one every 0.5 s).
COMPOSITIONS = 10


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    """Agent A (2 GPUs), agent B (4 GPUs), one gateway over both; all stopped at the end."""
    built = Cluster(tmp_path)
    pods = tmp_path / "pods.yaml"
    pods.write_text("pods: []\n")
    try:
        for node in (IDLE, BUSY):
            built.kubelets[node] = await FakeKubelet(short_socket_path()).start()
        idle, busy = built.agent(IDLE), built.agent(BUSY, 0, "--fake-gpus", str(BUSY_GPUS))
        started = await asyncio.gather(asyncio.to_thread(idle.start), asyncio.to_thread(busy.start))
        built.agents = dict(zip((IDLE, BUSY), started, strict=True))
        built.gateways = [await asyncio.to_thread(built.gateway(0, pods).start)]
        yield built
    finally:
        for process in [*built.gateways, *built.agents.values()]:
            await process.terminate()
        for kubelet in built.kubelets.values():
            await kubelet.stop()


async def fake(agent: Process, *args: str) -> None:
    """``gpuscaler fake ARGS... --address <agent>``, as a user types it."""
    process = await asyncio.create_subprocess_exec(
        str(CONSOLE_SCRIPT),
        "fake",
        *args,
        "--address",
        f"127.0.0.1:{agent.port}",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    async with asyncio.timeout(30):
        output, _ = await process.communicate()
    assert process.returncode == 0, output.decode(errors="replace")


async def outcome(call: Callable[[], Awaitable[object]]) -> object:
    """The call's result, or the GRPCError it raised."""
    try:
        return await call()
    except GRPCError as error:
        return error


def unavailable(got: object, *words: str) -> bool:
    """Whether ``got`` is an UNAVAILABLE status whose message has every one of ``words``."""
    return (
        isinstance(got, GRPCError)
        and got.status is Status.UNAVAILABLE
        and all(word in str(got.message) for word in words)
    )


def equals(expected: float) -> partial[bool]:
    """Accepts a float answer equal to ``expected``."""
    return partial(lambda want, got: isinstance(got, float) and got == pytest.approx(want), expected)


def busy_uuids() -> str:
    """Node B's GPUs as a gpuUUID value."""
    return ",".join(f"GPU-fake-{BUSY}-{index}" for index in range(BUSY_GPUS))


async def test_a_busy_node_whose_gpus_all_hang_is_unknown_at_the_gateway_not_zero(cluster: Cluster) -> None:
    """All four of B's GPUs hang: GetMetrics UNAVAILABLE naming B (never 0), IsActive not false, no false pushed."""
    gateway, agent_b = cluster.gateways[0], cluster.agents[BUSY]
    for index in range(BUSY_GPUS):
        await fake(agent_b, "set", "--gpu", str(index), f"gpu_utilization={LOAD:g}")
    await eventually(partial(answer, gateway, **ACTIVE), equals(BUSY_GPUS * LOAD), timeout=15)
    push = Pushes(gateway, **ACTIVE)
    try:
        await eventually(push.pushed, lambda seen: seen == [True], timeout=15)

        for index in range(BUSY_GPUS):
            await fake(agent_b, "fail", "--gpu", str(index), "--error", "timeout")
        # The premise: agent B, asked about its own GPUs, answers UNAVAILABLE.
        await eventually(partial(answer, agent_b), lambda got: unavailable(got, "hung"), timeout=15)
        # The gateway has seen all four hang once a query naming them says so (naming GPUs is strict).
        named = partial(answer, gateway, gpuUUID=busy_uuids())
        await eventually(named, lambda got: unavailable(got, *busy_uuids().split(",")), timeout=15)
        # Each says when agent B last read it, which a gateway holding B's newest snapshot alone cannot know.
        message = str(getattr(await outcome(named), "message", ""))
        assert message.count("; last read 20") == BUSY_GPUS, message
        assert "last read never" not in message, message
        seen_at = (await explain(gateway, gpuUUID=busy_uuids())).snapshot_sequence

        got = await outcome(partial(answer, gateway, **ACTIVE))
        assert unavailable(got, f"node {BUSY!r}"), f"GetMetrics through the gateway answered {got!r}, not UNAVAILABLE"
        got = await outcome(partial(is_active, gateway, **ACTIVE))
        assert unavailable(got, f"node {BUSY!r}"), f"IsActive through the gateway answered {got!r}, not UNAVAILABLE"

        # minNodes is the explicit way to answer without B, which then counts as not heard.
        got = await outcome(partial(answer, gateway, minNodes="2"))
        assert unavailable(got, "only 1 of 2 known nodes"), got
        assert await answer(gateway, minNodes="1") == 0.0
        [absent] = (await explain(gateway, minNodes="1")).absent
        assert absent.node == BUSY, absent

        # Several compositions later the stream has still pushed nothing but its first true.
        later = partial(explain, gateway, gpuUUID=busy_uuids())
        await eventually(later, lambda e: getattr(e, "snapshot_sequence", 0) >= seen_at + COMPOSITIONS, timeout=15)
        assert push.seen == [True], f"the push stream sent {push.seen} while node {BUSY} could not be read"

        await fake(agent_b, "heal", "--gpu", "all")
        await eventually(partial(answer, gateway, **ACTIVE), equals(BUSY_GPUS * LOAD), timeout=15)
        assert await is_active(gateway, **ACTIVE) is True
        assert push.seen == [True]
    finally:
        await push.close()
