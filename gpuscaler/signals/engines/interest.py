"""Which engine pods a query reads, and keeping them wanted by the engine source: interest, apart from evaluating."""

from __future__ import annotations

from collections.abc import Hashable, Iterable

from gpuscaler.model.engines import ENGINE_SIGNALS, Engine
from gpuscaler.model.errors import TooManyPods
from gpuscaler.model.pods import PodDirectory, ScaleTargets
from gpuscaler.query.query import CombinedQuery, EngineQuery, ValueSpec
from gpuscaler.signals.engines.evaluation import EngineSelection, select_engine_pods
from gpuscaler.signals.engines.pods import Endpoint
from gpuscaler.signals.engines.source import EngineSource, PodKey

# What a call that waits for its pods' first reads leaves of the caller's deadline (KEDA's grpc-timeout) for the
# answer itself: it answers with the pods still unread named, not DEADLINE_EXCEEDED.
DEADLINE_MARGIN_SECONDS = 0.25
# Without a deadline, the wait for a query's first reads is one read's timeout and this: a read may wait a moment
# for a slot behind its own namespace's reads.
FIRST_READ_SLACK_SECONDS = 1.0

# One engine pod a query reads: the pod, its engine, its page's address, and the interval it is read at.
Read = tuple[PodKey, Engine, Endpoint, float]


class EngineInterest:
    """The engine pods queries select, resolved from the directory, and the engine source's wanted set."""

    def __init__(self, engines: EngineSource, directory: PodDirectory | None) -> None:
        self.engines = engines
        self.directory = directory

    def first_read_within(self, time_left: float | None) -> float:
        """How long a call waits for its pods' first reads: one read's timeout and a slack, within its deadline."""
        within = self.engines.timeout_seconds + FIRST_READ_SLACK_SECONDS
        return within if time_left is None else min(within, time_left - DEADLINE_MARGIN_SECONDS)

    def reads(self, value: ValueSpec) -> list[Read]:
        """The engine pods ``value`` reads now, from the directory; a selection past the cap is counted.

        A selection that cannot be read (no directory, too many pods) reads nothing: evaluating says why."""
        reads: list[Read] = []
        for engine_query in engine_queries(value):
            selection = select_engine_pods(engine_query, self.engines, self.directory)
            if isinstance(selection, TooManyPods):
                self.engines.note_limited("max_pods_per_selection", selection=engine_query.pods.describe())
            if not isinstance(selection, EngineSelection):
                continue
            engine = ENGINE_SIGNALS[engine_query.metric].engine
            reads.extend(
                ((info.namespace, info.pod), engine, endpoint, engine_query.interval_seconds)
                for info, endpoint in selection.reads()
            )
        return reads

    def want(self, reads: Iterable[Read]) -> None:
        """Keep each of ``reads`` read by the engine source, at its interval."""
        for pod, engine, endpoint, interval in reads:
            self.engines.want(pod, engine, endpoint, interval)

    def directory_state(self, value: ValueSpec) -> Hashable:
        """What the directory says of ``value``'s engine selections, compared for equality only: equal means they
        select the same pods at the same addresses (a few look-ups, not a pass over the pods)."""
        directory = self.directory
        if directory is None:
            return None
        targets: object = directory  # a directory may know ScaledObjects too: the protocol is checked at run time
        state: list[Hashable] = [directory.problem()]
        for engine_query in engine_queries(value):
            pods = engine_query.pods
            state.append(directory.version(pods.namespace))
            if pods.scale_target is not None and isinstance(targets, ScaleTargets):
                state.append(targets.scale_targets_problem())
                state.append(targets.scale_target(pods.namespace, pods.scale_target))
        return tuple(state)


def engine_queries(value: ValueSpec) -> list[EngineQuery]:
    """``value``'s engine queries: itself, or a combined query's engine parts."""
    if isinstance(value, CombinedQuery):
        return [part.query for part in value.signals if isinstance(part.query, EngineQuery)]
    return [value] if isinstance(value, EngineQuery) else []
