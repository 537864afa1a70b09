"""A stale snapshot's error says whose loop was held: a gateway's event loop, or an agent's poll loop."""

from __future__ import annotations

import dataclasses

from gpuscaler.model.aggregation import Aggregation, WindowFunction
from gpuscaler.model.errors import Unavailable
from gpuscaler.model.gpu_metrics import Metric
from gpuscaler.query.query import GpuQuery, GpuSelection
from gpuscaler.signals.evaluation import evaluate
from tests.builders import source_of
from tests.signals.test_evaluation_workloads import VIEW

QUERY = GpuQuery(Metric.POWER_DRAW, Aggregation.SUM, GpuSelection(), None, WindowFunction.AVG)


def test_a_gateways_stale_cluster_snapshot_names_its_busy_event_loop() -> None:
    """At a gateway (a composed cluster snapshot), an old snapshot means its own event loop was kept from composing:
    the error says so, and does not blame an agent's poll loop."""
    assert VIEW.cluster
    error = evaluate(QUERY, source_of(VIEW), now=VIEW.monotonic + 10.0, stale_after=2.0).error
    assert isinstance(error, Unavailable)
    assert error.message.endswith("older than 2s; the gateway's event loop was too busy to compose a newer one")


def test_an_agents_stale_snapshot_names_its_poll_loop() -> None:
    """At an agent, an old snapshot is its poll loop's."""
    node = dataclasses.replace(VIEW.parts[0], monotonic=VIEW.monotonic)
    error = evaluate(QUERY, source_of(node), now=node.monotonic + 10.0, stale_after=2.0).error
    assert isinstance(error, Unavailable)
    assert error.message.endswith("older than 2s; the poll loop is stalled")
