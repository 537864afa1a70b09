"""Chaos: agents and GPUs fail, heal, restart and vanish at random under a KEDA-like poller; no answer is made up.

Three agents (two fake GPUs each, a fake kubelet each that gives GPU 0 to pod ``job-<node>``) behind a
gateway that finds them in an agents file. A driver does random things a cluster does: a GPU's load
changes, a GPU is lost and comes back, an agent is killed and restarted (its GPUs keep their load, as
a workload outlives its monitoring), an agent leaves discovery and comes back. It writes down the true
state after each step.

A poller calls GetMetricSpec, GetMetrics and IsActive as KEDA does, for a node-wide sum and a pod query,
and keeps a StreamIsActive open for each; every answer is recorded. The checker knows the truth: the sum
over the listed nodes' GPUs, a lost GPU's load included (its share is unknown, not 0: with six GPUs the
default maxUnreadable leaves none out, and a node with nothing readable is unknown). An answer is
made up when no true state during its flight, give or take the time a change takes to arrive, is that
low, node by node: a made-up zero is a value below the sum of each node's lowest true part in its window,
a made-up false an inactive answer while even that sum is active. There must be none. Errors are allowed:
they are "don't know".

Every run opens with the case that matters most (a busy node's agent killed for longer than the staleness
bound), then takes random steps for ``CHAOS_SECONDS`` (``CHAOS_SECONDS_FULL`` with ``make e2e-full``). The
seed is printed; ``GPUSCALER_CHAOS_SEED`` replays one.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest
from grpclib.client import Channel
from grpclib.exceptions import GRPCError, StreamTerminatedError

from e2e.support.cluster import Cluster
from e2e.support.process import Process
from e2e.support.sizes import FULL
from gpuscaler.generated import externalscaler as keda
from gpuscaler.generated.gpuscaler import v1 as pb
from tests.fakes.fake_kubelet import Assignment, FakeKubelet, short_socket_path

CHAOS_SECONDS = 20.0
CHAOS_SECONDS_FULL = 180.0
NODES = ("node-1", "node-2", "node-3")
LOADS = (0.0, 30.0, 60.0)
THRESHOLD = 10.0
# How long after a change an answer may still reflect the state before it: a poll (0.2 s), the gateway's
# compose (0.02 s) and a re-read of the agents file (0.5 s), on a machine that may be busy.
SLACK_SECONDS = 3.0
QUERIES = {
    "node-wide": {"activationThreshold": str(THRESHOLD)},
    "pods": {"pod": "job-*", "podAggregation": "sum", "activationThreshold": str(THRESHOLD)},
}


@dataclass(frozen=True)
class NodeTruth:
    """What one node really does: its GPUs' load, which GPUs are lost, whether discovery lists its agent."""

    loads: tuple[float, float] = (0.0, 0.0)
    lost: frozenset[int] = frozenset()
    listed: bool = True


@dataclass(frozen=True)
class Truth:
    """What the cluster really does at one moment: each node's truth, by name."""

    nodes: dict[str, NodeTruth]

    def share(self, query: str, name: str) -> float:
        """One node's true part of ``query``: its GPUs, lost ones too (GPU 0 only, for the pods' query), if listed."""
        node = self.nodes[name]
        gpus = (0,) if query == "pods" else (0, 1)
        return sum(node.loads[gpu] for gpu in gpus) if node.listed else 0.0

    def value(self, query: str) -> float:
        """The true value of ``query`` over the cluster."""
        return sum(self.share(query, name) for name in self.nodes)


def lowest(query: str, truths: list[Truth]) -> float:
    """The lowest value an honest answer can have when any of ``truths`` may be what it saw of each node.

    Nodes are seen with different delays (a dead agent's last snapshot counts until the staleness bound),
    so each node's part may come from a different one of the states: the bound is the sum of each node's
    lowest part.
    """
    return sum(min(truth.share(query, name) for truth in truths) for name in NODES)


@dataclass
class Answer:
    """One answer a client got: for which query, of which kind, when it was sent and received, and what it said."""

    query: str
    kind: str  # "value", "active" or "push"
    sent: float
    received: float
    result: float | bool | None  # None: an error status, "don't know"


@dataclass
class Record:
    """The true states over time, and every answer."""

    states: list[tuple[float, Truth]] = field(default_factory=list)
    answers: list[Answer] = field(default_factory=list)

    def truths_between(self, start: float, end: float) -> list[Truth]:
        """Every state in force at some moment of [start, end]."""
        found = [truth for at, truth in self.states if start <= at <= end]
        before = [truth for at, truth in self.states if at < start]
        return ([before[-1]] if before else []) + found


def made_up(record: Record, answer: Answer) -> bool:
    """Whether ``answer`` is lower (or less active) than every truth during its flight, with slack."""
    truths = record.truths_between(answer.sent - SLACK_SECONDS, answer.received)
    if answer.result is None or not truths:
        return False
    floor = lowest(answer.query, truths)
    if answer.kind == "value":
        assert isinstance(answer.result, float)
        return answer.result < floor - 1e-6
    return answer.result is False and floor > THRESHOLD


class Chaos:
    """The driver: random steps on a running cluster, each written down as the new truth."""

    def __init__(self, cluster: Cluster, record: Record, seed: int, folder: Path) -> None:
        self.cluster = cluster
        self.record = record
        self.random = random.Random(seed)
        self.folder = folder
        self.truth = Truth({node: NodeTruth() for node in NODES})
        self.dead: set[str] = set()
        self.steps: list[str] = []

    def _note(self, step: str, **changes: NodeTruth) -> None:
        self.truth = Truth({**self.truth.nodes, **changes})
        self.record.states.append((time.monotonic(), self.truth))
        self.steps.append(step)

    async def step(self) -> None:
        """One random step. The new truth is written down before the step acts, so it holds from then on."""
        node = self.random.choice(NODES)
        now = self.truth.nodes[node]
        if not now.listed:
            choices = ["return"]
        elif node in self.dead:
            choices = ["restart", "load"]  # a dead agent's GPUs still change: the workload runs on
        else:
            choices = ["load", "load", "load", "lose", "kill", "vanish", *(["heal"] if now.lost else [])]
        action = self.random.choice(choices)
        if action == "load":
            gpu, load = self.random.randrange(2), self.random.choice(LOADS)
            loads = (load, now.loads[1]) if gpu == 0 else (now.loads[0], load)
            self._note(f"{node} gpu {gpu} -> {load:g}", **{node: replace(now, loads=loads)})
            if node not in self.dead:
                await self._control(node, "set", gpu=gpu, load=load)
        elif action == "lose":
            gpu = self.random.randrange(2)
            self._note(f"{node} gpu {gpu} lost", **{node: replace(now, lost=now.lost | {gpu})})
            await self._control(node, "fail", gpu=gpu)
        elif action == "heal":
            self._note(f"{node} healed", **{node: replace(now, lost=frozenset())})
            await self._control(node, "heal")
        elif action == "kill":
            self._note(f"{node} agent killed")
            self.cluster.agents[node].kill()
            self.dead.add(node)
        elif action == "restart":
            self._note(f"{node} agent restarted")
            await self._restart(node, now)
        elif action == "vanish":
            self._note(f"{node} left discovery", **{node: replace(now, listed=False)})
            self.cluster.list_agents(*(n for n in NODES if self.truth.nodes[n].listed))
        else:  # return: alive again if it died while away, then listed again
            if node in self.dead:
                await self._restart(node, now)
            self._note(f"{node} back in discovery", **{node: replace(now, listed=True)})
            self.cluster.list_agents(*(n for n in NODES if self.truth.nodes[n].listed))

    async def opening(self) -> None:
        """The case that matters most, every run, before the random steps: a busy node's agent dies for a while."""
        node = NODES[0]
        self._note(f"{node} gpu 0 -> 60", **{node: replace(self.truth.nodes[node], loads=(60.0, 0.0))})
        await self._control(node, "set", gpu=0, load=60.0)
        await asyncio.sleep(1.0)
        self._note(f"{node} agent killed")
        self.cluster.agents[node].kill()
        self.dead.add(node)
        await asyncio.sleep(SLACK_SECONDS + 3.0)  # well past the staleness bound and the checker's slack
        self._note(f"{node} agent restarted")
        await self._restart(node, self.truth.nodes[node])

    async def _restart(self, node: str, now: NodeTruth) -> None:
        # The GPUs kept their load while the agent was down: the new agent starts from it.
        scenario = self.folder / f"{node}-scenario.yaml"
        gpus = "".join(f"  {i}: {{values: {{gpu_utilization: {load:g}}}}}\n" for i, load in enumerate(now.loads))
        scenario.write_text("gpus:\n" + gpus)
        port = self.cluster.agents[node].port
        process = self.cluster.agent(node, port, "--fake-scenario", str(scenario))
        self.cluster.agents[node] = await asyncio.to_thread(process.start)
        self.dead.discard(node)
        for gpu in sorted(now.lost):
            await self._control(node, "fail", gpu=gpu)

    async def _control(self, node: str, action: str, *, gpu: int = 0, load: float = 0.0) -> None:
        channel = Channel("127.0.0.1", self.cluster.agents[node].port)
        stub = pb.FakeControlStub(channel)
        try:
            if action == "set":
                values = {"gpu_utilization": load}
                await stub.set(pb.SetRequest(gpu=pb.GpuSelector(index=gpu), values=values), timeout=10)
            elif action == "fail":
                await stub.fail(pb.FailRequest(index=gpu, failure=pb.FakeFailure.LOST), timeout=10)
            else:
                await stub.heal(pb.HealRequest(gpu=pb.GpuSelector(all=True)), timeout=10)
        finally:
            channel.close()


async def poll_like_keda(gateway: Process, record: Record, stop: asyncio.Event) -> None:
    """GetMetricSpec, GetMetrics, IsActive for each query, over and over, on one connection."""
    channel = Channel("127.0.0.1", gateway.port)
    stub = keda.ExternalScalerStub(channel)
    try:
        while not stop.is_set():
            for query, metadata in QUERIES.items():
                ref = keda.ScaledObjectRef(name=query, namespace="ml", scaler_metadata=metadata)
                sent = time.monotonic()
                try:
                    spec = await stub.get_metric_spec(ref, timeout=5)
                    request = keda.GetMetricsRequest(
                        scaled_object_ref=ref, metric_name=spec.metric_specs[0].metric_name
                    )
                    value: float | None = (
                        (await stub.get_metrics(request, timeout=5)).metric_values[0].metric_value_float
                    )
                except GRPCError:
                    value = None
                record.answers.append(Answer(query, "value", sent, time.monotonic(), value))
                sent = time.monotonic()
                try:
                    active: bool | None = (await stub.is_active(ref, timeout=5)).result
                except GRPCError:
                    active = None
                record.answers.append(Answer(query, "active", sent, time.monotonic(), active))
            await asyncio.sleep(0.05)
    finally:
        channel.close()


async def watch_pushes(gateway: Process, query: str, record: Record, stop: asyncio.Event) -> None:
    """A StreamIsActive held open (reopened when it ends, as KEDA does); every push is an answer."""
    ref = keda.ScaledObjectRef(name=query, namespace="ml", scaler_metadata=QUERIES[query])
    while not stop.is_set():
        channel = Channel("127.0.0.1", gateway.port)
        try:
            async for message in keda.ExternalScalerStub(channel).stream_is_active(ref):
                arrived = time.monotonic()
                record.answers.append(Answer(query, "push", arrived, arrived, message.result))
        except (GRPCError, StreamTerminatedError, OSError):
            await asyncio.sleep(0.1)
        finally:
            channel.close()


@pytest.fixture
async def chaos_cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    """Three agents with fake kubelets and a gateway reading an agents file; all stopped at the end."""
    built = Cluster(tmp_path)
    # The pod directory is the authority on which pods exist: a silent node's pods it lacks count as deleted.
    pods = "".join(f"  - {{namespace: ml, pod: job-{node}, node: {node}, gpus: true}}\n" for node in NODES)
    (tmp_path / "pods.yaml").write_text("pods:\n" + pods)
    try:
        for node in NODES:
            kubelet = built.kubelets[node] = await FakeKubelet(short_socket_path()).start()
            kubelet.assign([Assignment("ml", f"job-{node}", (f"GPU-fake-{node}-0",))])
        started = await asyncio.gather(*(asyncio.to_thread(built.agent(node).start) for node in NODES))
        built.agents = dict(zip(NODES, started, strict=True))
        built.gateways = [await asyncio.to_thread(built.gateway(0, tmp_path / "pods.yaml").start)]
        yield built
    finally:
        for process in [*built.gateways, *built.agents.values()]:
            await process.terminate()
        for kubelet in built.kubelets.values():
            await kubelet.stop()


async def test_no_answer_is_made_up_while_agents_and_gpus_fail_heal_restart_and_vanish(
    chaos_cluster: Cluster, tmp_path: Path
) -> None:
    """Under random failures, every answer is an error or matches some true state: no made-up zero or false."""
    seed = int(os.environ.get("GPUSCALER_CHAOS_SEED", random.randrange(2**32)))
    print(f"chaos seed {seed} (set GPUSCALER_CHAOS_SEED to replay)")
    record = Record()
    chaos = Chaos(chaos_cluster, record, seed, tmp_path)
    chaos._note("start")
    gateway = chaos_cluster.gateways[0]
    stop = asyncio.Event()
    observers = [
        asyncio.create_task(poll_like_keda(gateway, record, stop)),
        *(asyncio.create_task(watch_pushes(gateway, query, record, stop)) for query in QUERIES),
    ]
    try:
        await chaos.opening()
        deadline = time.monotonic() + (CHAOS_SECONDS_FULL if FULL else CHAOS_SECONDS)
        while time.monotonic() < deadline:
            await chaos.step()
            await asyncio.sleep(chaos.random.uniform(0.2, 1.5))
    finally:
        stop.set()
        for task in observers:
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*observers, return_exceptions=True)

    checked = [answer for answer in record.answers if answer.result is not None]
    wrong = [answer for answer in record.answers if made_up(record, answer)]
    print(
        f"chaos: {len(chaos.steps)} steps, {len(record.answers)} answers, {len(checked)} with a value checked, "
        f"{len(record.answers) - len(checked)} errors ('don't know'), {len(wrong)} made up"
    )
    assert len(checked) > 50, "too few answers to say anything"
    kinds = {answer.kind for answer in checked}
    assert kinds == {"value", "active", "push"}, kinds
    assert not wrong, (
        "\n".join(
            f"{a.kind} {a.query} = {a.result} at +{a.received - record.states[0][0]:.2f}s; truths "
            f"{[t.value(a.query) for t in record.truths_between(a.sent - SLACK_SECONDS, a.received)]}"
            for a in wrong[:10]
        )
        + "\nsteps: "
        + "; ".join(
            f"+{at - record.states[0][0]:.2f}s {step} ({truth.value('node-wide'):g}/{truth.value('pods'):g})"
            for (at, truth), step in zip(record.states, chaos.steps, strict=True)
        )
    )
