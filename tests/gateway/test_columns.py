"""The gateway reads most answers from columns of its agents' snapshots: the same answers the records give."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterator

from gpuscaler.agent.history import History
from gpuscaler.gateway.decoding import SnapshotDecoder
from gpuscaler.gateway.view import ClusterView
from gpuscaler.model.aggregation import WindowFunction
from gpuscaler.model.columns import LazySamples, column, metric_column, uuids
from gpuscaler.model.errors import GpuscalerError
from gpuscaler.model.gpu_metrics import READING_FIELDS, Metric
from gpuscaler.model.samples import GpuSample, PodRef, ReadErrorKind, Snapshot
from gpuscaler.model.windows import WindowKey, WindowValues
from gpuscaler.query.metadata import Limits, parse_metadata
from gpuscaler.query.query import GpuQuery
from gpuscaler.server.wire import explained_gpus, snapshot_to_wire
from gpuscaler.signals.evaluation import evaluate
from gpuscaler.signals.evaluator import Evaluator
from gpuscaler.signals.outcome import Contribution, Evaluation
from tests.builders import ClusterSource, cluster, decoded, failed_sample, gpu_sample, history_of, snapshot
from tests.gateway.test_view import Clock

LIMITS = Limits(history_seconds=600, cluster=True)
QUERIES = [
    {"metric": "gpu_utilization"},
    {"metric": "gpu_utilization", "aggregation": "p90"},
    {"metric": "memory_used_percent", "aggregation": "avg"},
    {"metric": "temperature", "aggregation": "min"},
    {"metric": "power_draw", "aggregation": "max"},
    {"metric": "gpu_utilization", "window": "5s", "windowFunction": "max"},
    {"metric": "temperature", "window": "3s"},
    {"metric": "memory_used_percent", "window": "4s", "windowFunction": "min"},
    {"metric": "power_average", "window": "3s"},
    {"gpuUUID": "GPU-node-04-2"},
    {"gpuUUID": "gpu-node-01-0,GPU-node-07-3", "window": "5s", "windowFunction": "max"},
]
WINDOWS = [
    WindowKey(Metric.GPU_UTILIZATION, 5.0, WindowFunction.MAX),
    WindowKey(Metric.TEMPERATURE, 3.0, WindowFunction.AVG),
    WindowKey(Metric.MEMORY_USED_PERCENT, 4.0, WindowFunction.MIN),
    WindowKey(Metric.POWER_AVERAGE, 3.0, WindowFunction.AVG),
]


def sample(index: int, rng: random.Random) -> GpuSample:
    """A GPU at a random load; some readings absent, some GPUs lost, some held by a pod."""
    if rng.random() < 0.04:
        return failed_sample(index, ReadErrorKind.GPU_LOST)
    return gpu_sample(
        index,
        util=rng.choice([None, 0.0, 12.5, 50.0, 99.0, 99.0, 33.3]),
        used=rng.choice([None, *range(1, 80)]),
        total=rng.choice([80, 80, 80, 0]),
        temperature=rng.choice([None, 40.0, 71.5, 80.0]),
        power=rng.choice([None, 61.0, 300.25, 700.0]),
        pods=(PodRef("ml", f"pod-{index}", "main"),) if rng.random() < 0.3 else (),
    )._replace(energy_joules=rng.choice([None, 1000.0 * index + rng.random() * 10]))


def node(name: str, tick: int, rng: random.Random) -> Snapshot:
    """Node ``name``'s snapshot at ``tick`` (one a second): four GPUs, GPU-<name>-<index>."""
    samples = tuple(
        made._replace(node=name, gpu=dataclasses.replace(made.gpu, uuid=f"GPU-{name}-{index}"))
        for index, made in ((index, sample(index, rng)) for index in range(4))
    )
    return snapshot(tick, float(tick), samples, node=name)


def over_the_wire(history: History, decoder: SnapshotDecoder, *, at: float) -> Snapshot:
    """The node's newest snapshot as its agent sends it to a gateway (with the windows it asked for), decoded."""
    latest = history.latest
    assert latest is not None
    windows = {key: WindowValues({s.gpu.uuid: history.windowed(s, key) for s in latest.samples}) for key in WINDOWS}
    message = snapshot_to_wire(latest, poll_interval_seconds=1.0, windows=windows)
    return decoded(message, decoder, monotonic=at)


class NewestOnly(ClusterSource):
    """The reference: windows from each node's history, as its agent reduces them, but each node's newest
    snapshot only, as a gateway keeps."""

    def newest_first(self, node: str) -> Iterator[Snapshot]:
        return iter([part for part in self.view.parts if part.node == node])


def outcome(evaluation: Evaluation) -> object:
    """All that an evaluation answers: its value or error, and every GPU's contribution in full."""
    error = evaluation.error
    described = (type(error), str(error)) if isinstance(error, GpuscalerError) else None
    return evaluation.value, described, list(evaluation.contributions), evaluation.unread


def listed(evaluation: Evaluation, limit: int) -> tuple[list[Contribution], int]:
    """The rows an explanation should list, said plainly: the GPUs left out of the value, then those that went
    in, the first ``limit`` of them; and how many are not listed."""
    everything = list(evaluation.contributions)
    rows = ([c for c in everything if c.value is None] + [c for c in everything if c.value is not None])[:limit]
    return (everything, 0) if len(everything) <= limit else (rows, len(everything) - limit)


def test_columns_read_what_the_records_hold() -> None:
    """Every reading and metric of decoded samples, read as a column, is what each GPU's record says."""
    rng = random.Random(3)
    history = history_of(node("node-a", 1, rng))
    for tick in range(2, 60):
        history.append(node("node-a", tick, rng))
        decoded = over_the_wire(history, SnapshotDecoder(), at=float(tick)).samples
        assert isinstance(decoded, LazySamples)
        records = list(decoded)
        assert uuids(decoded) == [r.gpu.uuid for r in records]
        for reading in READING_FIELDS:
            assert column(decoded, reading) == [getattr(r, reading) for r in records]
        for metric in Metric:
            assert metric_column(decoded, metric) == [r.value(metric) for r in records]


async def test_a_gateway_answers_from_columns_what_it_answers_from_records() -> None:
    """Twelve nodes over the wire, half sending before each composition: the view's answers (columns, the memo)
    equal fresh evaluations over the same nodes' records and histories, contribution for contribution; so do
    their counts, their GPUs' names and the rows an explanation lists past its limit."""
    rng = random.Random(11)
    clock = Clock()
    view = ClusterView(history_seconds=600, compose_interval_seconds=1.0, clock=clock)
    evaluator = Evaluator(view, clock=clock)
    names = [f"node-{n:02d}" for n in range(12)]
    view.set_agents(names)
    histories = {name: history_of(node(name, 1, rng), poll_interval_seconds=1.0) for name in names}
    decoders = {name: SnapshotDecoder() for name in names}
    for key in WINDOWS:
        view.request([key])
    compared = 0
    for tick in range(2, 30):
        clock.now = float(tick)
        for name in names[tick % 2 :: 2] if tick > 2 else names:  # each node every 2 s: fresh, half new each time
            histories[name].append(node(name, tick, rng))
            received = over_the_wire(histories[name], decoders[name], at=clock.now)
            view.update(name, received, poll_interval_seconds=1.0)
        composed = view.compose()
        records = [h.latest for h in histories.values() if h.latest is not None]
        fresh = NewestOnly(cluster(*records, at=clock.now), *histories.values())
        for metadata in QUERIES:
            query = parse_metadata(metadata, LIMITS).value
            assert isinstance(query, GpuQuery)
            answer = evaluator.evaluate(query)
            assert answer.snapshot is composed
            expected = evaluate(query, fresh, now=clock.now, stale_after=evaluator.stale_after)
            assert outcome(answer) == outcome(expected), metadata
            assert len(answer.contributions) == len(expected.contributions)
            assert answer.nodes_counted == expected.nodes_counted
            assert list(answer.gpu_keys()) == list(expected.gpu_keys())
            assert explained_gpus(answer, limit=10) == explained_gpus(expected, limit=10) == listed(expected, 10)
            compared += 1
    assert compared == 28 * len(QUERIES)
