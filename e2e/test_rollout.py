"""A DaemonSet rollout under a gateway, as KEDA sees it: one node's agent replaced while KEDA polls a windowed trigger.

The new agent's history starts empty, so for one window length its windows cover less than they say. KEDA's rounds
(GetMetricSpec, GetMetrics, IsActive over one grpcio channel, as ``e2e/test_keda_pattern.py`` makes them) get
UNAVAILABLE only while the gateway cannot hear the node, then the value from the windows as they fill, marked in
Explain, never an error for a filling window (docs/metadata.md, windows that are filling).
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from e2e.support.clients import GrpcioScaler, RpcFailure
from e2e.support.cluster import Cluster, explain
from e2e.support.keda_grpcio import KedaProto
from e2e.support.process import Process
from e2e.test_keda_pattern import KEDA_OWN_KEYS, average_value_replicas, keda_round
from tests.fakes.fake_kubelet import FakeKubelet, short_socket_path

WINDOW_SECONDS = 4.0
# Two nodes of two fake GPUs, each node's GPUs at a steady load from its agent's first tick on (a scenario
# file, so a restarted agent reads the load at once): a filling window's average is then the whole window's.
LOADS = {"node-1": 40.0, "node-2": 20.0}
TOTAL = 2 * sum(LOADS.values())
TRIGGER = {**KEDA_OWN_KEYS, "window": f"{WINDOW_SECONDS:g}s", "targetValue": "30", "activationThreshold": "10"}


@dataclass
class Round:
    """One KEDA round and the Explain beside it: when, the value (or the error KEDA got), and the window's coverage."""

    at: float
    value: float | None
    active: bool | None
    error: RpcFailure | None
    covered: float | None
    least_node: str


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    """Two nodes (agent and fake kubelet each) at steady loads, and one gateway over them; all stopped at the end."""
    built = Cluster(tmp_path)
    pods = tmp_path / "pods.yaml"
    pods.write_text("pods: []\n")
    try:
        for node in LOADS:
            built.kubelets[node] = await FakeKubelet(short_socket_path()).start()
            built.agents[node] = await asyncio.to_thread(agent_of(built, node).start)
        built.gateways = [await asyncio.to_thread(built.gateway(0, pods).start)]
        yield built
    finally:
        codes = [await process.terminate() for process in [*built.gateways, *built.agents.values()]]
        for kubelet in built.kubelets.values():
            await kubelet.stop()
    assert all(code in (0, -signal.SIGKILL) for code in codes), codes


def agent_of(cluster: Cluster, node: str) -> Process:
    """``node``'s agent process (not started), on a new port, its GPUs at the node's load from the first tick."""
    scenario = cluster.directory / f"{node}.yaml"
    scenario.write_text(f"defaults:\n  values:\n    gpu_utilization: {LOADS[node]:g}\n")
    return cluster.agent(node, 0, "--fake-scenario", str(scenario))


async def one_round(scaler: GrpcioScaler, cluster: Cluster) -> Round:
    """KEDA's round, then the gateway's Explain of the same trigger."""
    at = time.monotonic()
    try:
        _, _, value, _, active = await keda_round(scaler, TRIGGER)
    except RpcFailure as error:
        return Round(at, None, None, error, None, "")
    explanation = await explain(cluster.gateways[0], **TRIGGER)
    return Round(at, value, active, None, explanation.least_covered_seconds, explanation.least_covered_node)


async def keep_polling(scaler: GrpcioScaler, cluster: Cluster, rounds: list[Round]) -> None:
    """KEDA's rounds, one after another until cancelled; KEDA polls every 30 s, a round every 0.1 s sees every state
    a poll could meet."""
    while True:
        rounds.append(await one_round(scaler, cluster))
        await asyncio.sleep(0.1)


async def until(rounds: list[Round], accept: Callable[[list[Round]], bool], timeout: float = 60) -> None:
    """Until the rounds so far are accepted; fails with the last round after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not accept(rounds):
        assert time.monotonic() < deadline, f"not within {timeout:g}s; last round: {rounds[-1] if rounds else None}"
        await asyncio.sleep(0.05)


async def test_a_rollout_answers_from_the_filling_window_and_errs_only_while_the_node_is_not_heard(
    cluster: Cluster, keda_proto: KedaProto
) -> None:
    """While node-1's agent is replaced, each KEDA round gets the whole answer (120: 4 replicas at target 30) or
    UNAVAILABLE naming node-1 while it cannot be heard, never a partial sum, a 0 or an inactive; once the new agent
    is heard, every round answers, and Explain says node-1's windows cover less than 4 s until they are whole
    again. The push stream sends its first true and nothing else."""
    gateway = cluster.gateways[0]
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{gateway.port}")  # one connection for every call, as KEDA's
    scaler = GrpcioScaler(channel, keda_proto)
    rounds: list[Round] = []
    pushes = scaler.stream_is_active(TRIGGER)
    polling = asyncio.create_task(keep_polling(scaler, cluster, rounds))
    try:
        await until(rounds, lambda seen: bool(seen) and seen[-1].value == TOTAL and seen[-1].covered is None)
        assert await pushes.next() is True

        before = len(rounds)
        assert await cluster.agents["node-1"].terminate() == 0  # the old pod: SIGTERM, its stream ends OK
        # A new pod slower to start than the gateway's 2 s silence bound (an image pull, NVML's start): node-1 is
        # unknown for a while, as it is in a cluster.
        await until(rounds, lambda seen: any(r.error is not None for r in seen[before:]))
        cluster.agents["node-1"] = await asyncio.to_thread(agent_of(cluster, "node-1").start)
        cluster.list_agents()  # discovery: the old pod's address gone, the new pod's listed
        new_agent = f"127.0.0.1:{cluster.agents['node-1'].port}"
        await until(rounds, lambda seen: any(r.covered is not None for r in seen[before:]))
        await until(rounds, lambda seen: seen[-1].error is None and seen[-1].covered is None)
    finally:
        polling.cancel()
        await asyncio.gather(polling, return_exceptions=True)
        await pushes.close()
        await channel.close()

    during = rounds[before:]
    for round_ in during:  # the whole answer, or unknown: never a partial sum, a 0 or an inactive
        if round_.error is None:
            assert (round_.value, round_.active) == (TOTAL, True), round_
        else:  # node-1 silent, or its new agent listed and not heard yet
            assert round_.error.code == "UNAVAILABLE", round_
            assert "node 'node-1'" in round_.error.message or new_agent in round_.error.message, round_
    # What the HPA makes of every answer: 4 replicas throughout; an error keeps them (or applies KEDA's fallback).
    assert {average_value_replicas(r.value, 30.0, current=4) for r in during if r.value is not None} == {4}
    first_filling = next(index for index, r in enumerate(during) if r.covered is not None)
    assert all(r.error is None for r in during[first_filling:]), "an error after the new agent was heard"
    filling = [r.covered for r in during if r.covered is not None]
    assert all(r.least_node == "node-1" for r in during if r.covered is not None)
    assert all(0 < covered < WINDOW_SECONDS for covered in filling), filling
    assert filling == sorted(filling)  # they fill
    assert [active for _, active in pushes.received] == [True]
