"""A gateway keeps each node's contributions while its snapshot is unchanged: answers are the same as without."""

from __future__ import annotations

import dataclasses
import random
from operator import is_

from gpuscaler.model.errors import GpuscalerError
from gpuscaler.model.samples import GpuSample, ReadErrorKind, Snapshot
from gpuscaler.query.metadata import Limits, parse_metadata
from gpuscaler.signals.evaluation import evaluate
from gpuscaler.signals.evaluator import Evaluator
from gpuscaler.signals.node_memo import NodeMemo
from tests.builders import ClusterSource, cluster, failed_sample, gpu_sample, gpu_trigger, history_of, snapshot

LIMITS = Limits(history_seconds=600, cluster=True)
QUERIES = [
    {"metric": "gpu_utilization"},
    {"metric": "gpu_utilization", "aggregation": "max"},
    {"metric": "memory_used_percent", "aggregation": "avg"},
    {"metric": "gpu_utilization", "window": "10s", "windowFunction": "max"},
    {"metric": "memory_used_percent", "window": "5s", "aggregation": "p90"},
    {"metric": "temperature", "aggregation": "min"},
    # Named GPUs: one on a node that leaves now and then (missing: an error), two on nodes that come and go.
    {"gpuUUID": "GPU-node-03-2"},
    {"gpuUUID": "gpu-node-05-0,GPU-node-12-3", "window": "10s", "aggregation": "max"},
    {"gpuUUID": "GPU-node-01-1", "metric": "memory_used_percent"},
]


def node(name: str, tick: int, rng: random.Random) -> Snapshot:
    """Node ``name``'s snapshot at ``tick``: four GPUs (GPU-<name>-<index>) at random loads, each lost about
    one time in twenty."""
    samples = tuple(
        failed_sample(index, ReadErrorKind.GPU_LOST)
        if rng.random() < 0.05
        else gpu_sample(
            index,
            util=rng.choice([0.0, 12.5, 50.0, 99.0]),
            used=rng.randrange(1, 80),
            total=80,
            temperature=rng.choice([None, 40.0, 71.5, 80.0, 90.0]),
        )
        for index in range(4)
    )
    own = tuple(
        sample._replace(node=name, gpu=dataclasses.replace(sample.gpu, uuid=f"GPU-{name}-{sample.gpu.index}"))
        for sample in samples
    )
    return snapshot(tick, float(tick), own, node=name)


def outcome(query: dict[str, str], view: Snapshot, source: ClusterSource, memo: NodeMemo | None) -> object:
    """All that an evaluation answers (value, error, contributions), to compare with the memo and without."""
    value = gpu_trigger(parse_metadata(query, LIMITS)).value
    evaluation = evaluate(value, source, now=view.monotonic, stale_after=5.0, memo=memo)
    error = (type(evaluation.error), str(evaluation.error)) if isinstance(evaluation.error, GpuscalerError) else None
    return evaluation.value, error, list(evaluation.contributions)


def test_answers_with_the_memo_equal_fresh_evaluations_while_nodes_change() -> None:
    """Over 40 compositions in which a random third of 12 nodes send a new snapshot, and nodes leave, come back
    and take each other's place, every answer is identical: its value or error, and every GPU's contribution in
    full (the memo takes shortcuts for the common cases and for the nodes that did not change)."""
    rng = random.Random(7)
    names = [f"node-{n:02d}" for n in range(13)]
    histories = {name: history_of(node(name, 1, rng)) for name in names}
    memo = NodeMemo()
    compared = 0
    for tick in range(2, 42):
        for name in rng.sample(names, 4):
            histories[name].append(node(name, tick, rng))
        heard = names[:12]
        if tick % 5 == 0:
            heard[1] = "node-12"  # another node in its place: as many parts, one different
        if tick % 7 == 0:
            heard.remove("node-03")  # leaves, and comes back at the next composition
        parts = [latest for name in heard if (latest := histories[name].latest) is not None]
        view = cluster(*parts, at=float(tick))
        source = ClusterSource(view, *histories.values())
        for query in QUERIES:
            assert outcome(query, view, source, memo) == outcome(query, view, source, None)
            compared += 1
    assert compared == 40 * len(QUERIES)


def test_a_cluster_answer_names_the_windows_that_have_not_filled_from_the_nodes_that_have_them() -> None:
    """A node whose agent restarted 3 s ago counts its GPUs' 3 s windows and lists them as short; a node whose
    history spans the window is whole, and the answer sums both."""
    steady = [snapshot(t, float(t), utilizations_of("node-a", 50.0), node="node-a") for t in range(1, 31)]
    restarted = [snapshot(t, float(27 + t), utilizations_of("node-b", 10.0), node="node-b") for t in range(1, 4)]
    view = cluster(steady[-1], restarted[-1], at=30.0)
    source = ClusterSource(view, history_of(*steady), history_of(*restarted))
    query = gpu_trigger(parse_metadata({"metric": "gpu_utilization", "window": "20s"}, LIMITS)).value
    for memo in (NodeMemo(), None):
        evaluation = evaluate(query, source, now=30.0, stale_after=5.0, memo=memo)
        assert evaluation.value == 4 * 50.0 + 4 * 10.0
        filling = evaluation.filling_windows()
        assert [(c.sample.node, c.covered_seconds) for c in filling] == [("node-b", 3.0)] * 4


def utilizations_of(name: str, util: float) -> tuple[GpuSample, ...]:
    """Four GPUs of node ``name`` (GPU-<name>-<index>) at ``util``."""
    return tuple(gpu_sample(index, util=util, node=name, uuid=f"GPU-{name}-{index}") for index in range(4))


def test_an_unchanged_node_is_not_evaluated_again() -> None:
    """The same node snapshot object gives the same contributions object: nothing recomputed."""
    rng = random.Random(1)
    part_a, part_b = node("node-a", 1, rng), node("node-b", 1, rng)
    memo = NodeMemo()
    query = gpu_trigger(parse_metadata({"metric": "gpu_utilization"}, LIMITS)).value
    source = ClusterSource(cluster(part_a, part_b), history_of(part_a), history_of(part_b))
    first = memo.parts(query, (part_a,), source)[0]
    assert memo.parts(query, (part_a,), source)[0] is first
    newer = node("node-a", 2, rng)
    assert memo.parts(query, (newer,), source)[0] is not first


def test_forgotten_queries_and_nodes_leave_the_memo() -> None:
    """Only the queries still asked are kept, and a node that left goes once the query holds more nodes than
    the view has (until then it is kept, which changes nothing: it is reused only for the same snapshot)."""
    rng = random.Random(2)
    part, other = node("node-a", 1, rng), node("node-b", 1, rng)
    memo = NodeMemo()
    query = gpu_trigger(parse_metadata({"metric": "gpu_utilization"}, LIMITS)).value
    source = ClusterSource(cluster(part, other), history_of(part), history_of(other))
    first = memo.parts(query, (part,), source)[0]
    memo.keep_only([query], [other])  # node-a left, node-b came: the query holds one node, as many as listed
    assert memo.parts(query, (part,), source)[0] is first
    memo.parts(query, (other,), source)[0]
    memo.keep_only([query], [other])  # now it holds two for one listed: node-a is forgotten
    assert memo.parts(query, (part,), source)[0] is not first  # computed afresh
    second = memo.parts(query, (part,), source)[0]
    memo.keep_only([], [part])
    assert memo.parts(query, (part,), source)[0] is not second


def test_the_evaluator_keeps_only_the_queries_the_last_composition_evaluated() -> None:
    """A streamed query, evaluated at every composition, reuses its unchanged nodes' parts; one that a
    composition skipped (KEDA polls every 30 s, by when every node has sent anew) is evaluated afresh."""
    rng = random.Random(3)
    parts = (node("node-a", 1, rng), node("node-b", 1, rng))
    source = ClusterSource(cluster(*parts), history_of(parts[0]), history_of(parts[1]))
    evaluator = Evaluator(source, clock=lambda: 0.0)
    memo = evaluator.memo
    assert memo is not None
    streamed = gpu_trigger(parse_metadata({"metric": "gpu_utilization"}, LIMITS)).value
    polled = gpu_trigger(parse_metadata({"metric": "gpu_utilization", "aggregation": "max"}, LIMITS)).value
    evaluator.evaluate(streamed)
    evaluator.evaluate(polled)
    first = {query: memo.parts(query, parts, source) for query in (streamed, polled)}
    for sequence in (2, 3):  # two compositions in which no node sent: the stream is evaluated, the poll is not
        source.view = dataclasses.replace(source.view, sequence=sequence)
        evaluator.evaluate(streamed)
    assert all(map(is_, memo.parts(streamed, parts, source), first[streamed]))
    assert not any(map(is_, memo.parts(polled, parts, source), first[polled]))
