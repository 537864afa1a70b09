"""Evaluator with a manual clock: shared evaluations, shared stream groups, wake-ups only on transitions."""

from __future__ import annotations

from collections import Counter
from contextlib import ExitStack
from dataclasses import replace
from typing import Any

import pytest

import gpuscaler.signals.evaluator as evaluator_module
from gpuscaler.agent.history import History
from gpuscaler.model.errors import Unavailable
from gpuscaler.model.samples import GpuSample, ReadErrorKind, Snapshot
from gpuscaler.query.query import GpuQuery, Query
from gpuscaler.signals.evaluation import evaluate
from gpuscaler.signals.evaluator import Evaluator
from gpuscaler.signals.outcome import Evaluation
from gpuscaler.signals.streams import Subscription
from tests.builders import ClusterSource, cluster, failed_sample, gpu_sample, history_of, snapshot, utilizations

HYSTERESIS = {"activationThreshold": "50", "deactivationThreshold": "20"}


class ManualClock:
    """The evaluator's monotonic clock, moved only by the test."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Node:
    """A history, its evaluator and a clock; ``tick`` plays one poll: append a snapshot and tell the evaluator."""

    def __init__(self) -> None:
        self.clock = ManualClock()
        self.history: History = history_of(poll_interval_seconds=1.0)
        self.evaluator = Evaluator(self.history, clock=self.clock)
        self.sequence = 0

    def append(self, *samples: GpuSample) -> None:
        """A poll tick's snapshot lands in the history; the evaluator's listener has not run yet."""
        self.sequence += 1
        self.clock.now += 1.0
        self.history.append(snapshot(self.sequence, self.clock.now, samples))

    def tick(self, *samples: GpuSample) -> None:
        self.append(*samples)
        latest = self.history.latest
        assert latest is not None
        self.evaluator.on_snapshot(latest)

    def utilization(self, *values: float) -> None:
        self.tick(*utilizations(*values))

    def query(self, **metadata: str) -> Query:
        return self.evaluator.parse(metadata)


class CountingEvaluate:
    """Wraps gpuscaler.signals.evaluation.evaluate to count the evaluations the evaluator asks for."""

    def __init__(self) -> None:
        self.calls: Counter[GpuQuery] = Counter()

    def __call__(self, query: GpuQuery, *args: Any, **kwargs: Any) -> Evaluation:
        self.calls[query] += 1
        return evaluate(query, *args, **kwargs)

    def total(self) -> int:
        return sum(self.calls.values())


@pytest.fixture
def node() -> Node:
    """A node with no snapshot yet."""
    return Node()


@pytest.fixture
def evaluations(monkeypatch: pytest.MonkeyPatch) -> CountingEvaluate:
    """Counts every evaluation the evaluator performs."""
    counter = CountingEvaluate()
    monkeypatch.setattr(evaluator_module, "evaluate", counter)
    return counter


def wake_ups(subscription: Subscription) -> tuple[bool, bool | None]:
    """Whether the stream was woken since the last look, and its state; clears the wake-up."""
    woken = subscription.changed.is_set()
    subscription.changed.clear()
    return woken, subscription.active


def test_one_evaluation_per_distinct_query_per_snapshot(node: Node, evaluations: CountingEvaluate) -> None:
    """Many streams and unary calls in one tick cost one evaluation per distinct value query."""
    node.utilization(10.0, 20.0)
    same_value = [node.query(), node.query(), node.query(metricName="other"), node.query(activationThreshold="9")]
    other_value = node.query(metric="temperature")
    with ExitStack() as stack:
        for query in [*same_value, other_value]:
            stack.enter_context(node.evaluator.subscribe(query))
        assert evaluations.total() == 2
        for _ in range(3):
            before = evaluations.total()
            node.utilization(30.0, 40.0)
            assert evaluations.total() - before == 2
            node.evaluator.is_active(same_value[0])
            node.evaluator.value(same_value[3])
            node.evaluator.evaluate(other_value.value)
            assert evaluations.total() - before == 2
    assert set(evaluations.calls) == {same_value[0].value, other_value.value}


def test_stale_history_is_not_served_from_the_cache(node: Node, evaluations: CountingEvaluate) -> None:
    """Once the newest sample is stale each call re-evaluates and fails, so an old value never comes back."""
    node.utilization(60.0)
    query = node.query()
    assert node.evaluator.value(query) == 60.0
    node.clock.now += 10.0
    for _ in range(2):
        with pytest.raises(Unavailable, match="no fresh sample"):
            node.evaluator.value(query)
    assert evaluations.total() == 3


def test_subscriptions_with_the_same_query_share_one_group(node: Node) -> None:
    """Streams whose queries mean the same value and thresholds share one group, whatever their metric names."""
    node.utilization(10.0)
    with ExitStack() as stack:
        for query in (node.query(), node.query(), node.query(metricName="renamed"), node.query(gpuIndex="-1")):
            stack.enter_context(node.evaluator.subscribe(query))
        assert node.evaluator.distinct_stream_queries == 1
        with node.evaluator.subscribe(node.query(activationThreshold="30")):
            assert node.evaluator.distinct_stream_queries == 2
        assert node.evaluator.distinct_stream_queries == 1
    assert node.evaluator.distinct_stream_queries == 0


def test_subscription_knows_the_state_at_once(node: Node) -> None:
    """A stream opened over a fresh sample has its state before the next tick, without a wake-up."""
    node.utilization(60.0)
    with node.evaluator.subscribe(node.query(**HYSTERESIS)) as subscription:
        assert wake_ups(subscription) == (False, True)


def test_stream_opened_before_any_sample_learns_the_state_at_the_first(node: Node) -> None:
    """Before the first poll the state is unknown (not inactive); the first sample wakes the stream with it."""
    with node.evaluator.subscribe(node.query(**HYSTERESIS)) as subscription:
        assert wake_ups(subscription) == (False, None)
        node.utilization(10.0)
        assert wake_ups(subscription) == (True, False)
        node.utilization(10.0)
        assert wake_ups(subscription) == (False, False)


def test_stream_is_woken_only_on_a_transition(node: Node) -> None:
    """Ticks that leave the state as it was wake nobody; crossing a threshold wakes every stream once."""
    node.utilization(10.0)
    query = node.query(**HYSTERESIS)
    with node.evaluator.subscribe(query) as first, node.evaluator.subscribe(query) as second:
        seen = []
        for value in (10.0, 30.0, 50.0, 60.0, 70.0, 30.0, 21.0, 20.0, 5.0, 45.0):
            node.utilization(value)
            seen.append(wake_ups(first))
            assert wake_ups(second) == seen[-1]
    assert seen == [
        (False, False),
        (False, False),
        (False, False),
        (True, True),
        (False, True),
        (False, True),
        (False, True),
        (True, False),
        (False, False),
        (False, False),
    ]


def test_unknown_value_keeps_the_last_state(node: Node) -> None:
    """When the GPUs cannot be read the stream keeps its state (no false 'inactive') until a value is back."""
    node.utilization(60.0)
    query = node.query(**HYSTERESIS)
    with node.evaluator.subscribe(query) as subscription:
        for _ in range(3):
            node.tick(failed_sample(0, ReadErrorKind.GPU_LOST))
            assert wake_ups(subscription) == (False, True)
            with pytest.raises(Unavailable):
                node.evaluator.is_active(query)
        node.utilization(55.0)
        assert wake_ups(subscription) == (False, True)
        node.utilization(5.0)
        assert wake_ups(subscription) == (True, False)


def test_a_stream_opened_while_unknown_joins_a_group_that_already_knows(node: Node) -> None:
    """A stream that opens while the value is unreadable gets the state at the next readable tick, even unchanged."""
    node.utilization(60.0)
    query = node.query(**HYSTERESIS)
    with node.evaluator.subscribe(query) as first:
        assert first.active is True
        node.utilization(60.0)
        node.tick(failed_sample(0, ReadErrorKind.GPU_LOST))
        with node.evaluator.subscribe(query) as second:
            assert second.active is None
            node.utilization(60.0)
            assert wake_ups(second) == (True, True)
            assert wake_ups(first) == (False, True)
            node.utilization(61.0)
            assert wake_ups(second) == (False, True)


def test_a_transition_seen_by_a_poll_reaches_the_streams(node: Node) -> None:
    """IsActive and streams share one state: a change a poll observed wakes the streams on the next tick."""
    node.utilization(10.0)
    query = node.query(**HYSTERESIS)
    with node.evaluator.subscribe(query) as subscription:
        node.append(gpu_sample(0, util=90.0))
        assert node.evaluator.is_active(query) is True
        assert wake_ups(subscription) == (False, False)
        latest = node.history.latest
        assert latest is not None
        node.evaluator.on_snapshot(latest)
        assert wake_ups(subscription) == (True, True)


def test_close_streams_wakes_every_stream_with_closing(node: Node) -> None:
    """Shutdown wakes every open stream, in every group, with closing set, so each can end with OK."""
    node.utilization(10.0)
    with ExitStack() as stack:
        subscriptions = [
            stack.enter_context(node.evaluator.subscribe(query))
            for query in (node.query(), node.query(), node.query(metric="temperature"))
        ]
        assert not any(s.changed.is_set() for s in subscriptions)
        node.evaluator.close_streams()
        assert node.evaluator.closing is True
        assert all(s.changed.is_set() for s in subscriptions)


def healthy_after(*samples: GpuSample, age: float = 0.0) -> bool:
    """Whether an evaluator is healthy after one tick of ``samples``, ``age`` seconds later."""
    node = Node()
    node.tick(*samples)
    node.clock.now += age
    return node.evaluator.healthy()


@pytest.mark.parametrize(
    ("samples", "age", "expected"),
    [
        pytest.param((gpu_sample(0, util=10.0),), 0.0, True, id="fresh"),
        pytest.param((gpu_sample(0, util=10.0),), 3.0, True, id="at-the-freshness-limit"),
        pytest.param((gpu_sample(0, util=10.0),), 3.5, False, id="stale"),
        pytest.param((failed_sample(0, ReadErrorKind.GPU_LOST), gpu_sample(1, util=1.0)), 0.0, True, id="one-lost"),
        pytest.param(
            (failed_sample(0, ReadErrorKind.GPU_LOST), failed_sample(1, ReadErrorKind.TIMEOUT)),
            0.0,
            False,
            id="every-gpu-failed",
        ),
        pytest.param((), 0.0, False, id="no-gpus"),
    ],
)
def test_healthy(samples: tuple[GpuSample, ...], age: float, expected: bool) -> None:
    """Healthy means a fresh sample in which at least one GPU was read."""
    assert healthy_after(*samples, age=age) is expected


def test_not_healthy_before_the_first_poll(node: Node) -> None:
    """With no sample yet the agent is not SERVING."""
    assert node.evaluator.healthy() is False


def test_a_hung_busy_gpu_never_pushes_false_on_an_agent(node: Node) -> None:
    """The only busy GPU hangs beside an idle one: leaving it out would read 0 and push false; it stays unknown."""
    node.utilization(60.0, 0.0)
    query = node.query(**HYSTERESIS)
    with node.evaluator.subscribe(query) as subscription:
        assert subscription.active is True
        for _ in range(3):
            node.tick(failed_sample(0, ReadErrorKind.TIMEOUT), gpu_sample(1, util=0.0))
            assert wake_ups(subscription) == (False, True)
            with pytest.raises(Unavailable, match="cannot be read on 1 of the 2 selected GPUs"):
                node.evaluator.is_active(query)


def test_a_gateway_never_pushes_false_while_a_busy_node_cannot_be_read() -> None:
    """Behind a gateway, busy node B's GPUs all hang: no false pushed, IsActive UNAVAILABLE naming B, until read."""
    idle = Snapshot(1, 0.0, 0.0, "gpu-a", samples=(gpu_sample(0, util=0.0, node="gpu-a", uuid="GPU-a-0"),))
    busy = Snapshot(1, 0.0, 0.0, "gpu-b", samples=(gpu_sample(0, util=95.0, node="gpu-b", uuid="GPU-b-0"),))
    hung = replace(busy, samples=(failed_sample(0, ReadErrorKind.TIMEOUT)._replace(node="gpu-b"),))
    clock = ManualClock()
    source = ClusterSource(cluster(idle, busy))
    evaluator = Evaluator(source, clock=clock)

    def compose(*parts: Snapshot) -> None:
        clock.now += 0.5
        source.view = replace(cluster(*parts, at=clock.now), sequence=source.view.sequence + 1)
        evaluator.on_snapshot(source.view)

    query = evaluator.parse(HYSTERESIS)
    with evaluator.subscribe(query) as subscription:
        assert subscription.active is True
        for _ in range(3):
            compose(idle, hung)
            assert wake_ups(subscription) == (False, True)
            with pytest.raises(Unavailable, match="node 'gpu-b' is heard, but none of its 1 selected GPU"):
                evaluator.is_active(query)
        with evaluator.subscribe(query) as opened_while_unknown:
            assert opened_while_unknown.active is None
            compose(idle, busy)
            assert wake_ups(opened_while_unknown) == (True, True)
        assert wake_ups(subscription) == (False, True)
