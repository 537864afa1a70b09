"""Open push streams, grouped by query: one evaluation per distinct query per tick, and a wake-up on each change."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Hashable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from gpuscaler.model.windows import WindowKey
from gpuscaler.query.query import CombinedQuery, EngineQuery, GpuQuery, Query, ValueSpec, windows_of
from gpuscaler.signals.engines.interest import EngineInterest, Read
from gpuscaler.signals.outcome import Evaluation

# A push stream's engine pods are looked at again at most this often (on a scrape or a snapshot), so a pod that
# joins its selection is read within about a second, and the cost of keeping them wanted does not grow with scrapes.
STREAM_INTEREST_EVERY_SECONDS = 1.0
# A stream's selection is resolved again only when what the directory says of it changed; its pods are wanted again
# this often even when nothing changed, well within the 120 s after which the gateway's scraper forgets a pod.
STREAM_REWANT_SECONDS = 30.0


@dataclass(eq=False, slots=True)
class Subscription:
    """One open push stream: the evaluator sets ``active`` and ``changed`` when its query's state moves."""

    query: Query
    changed: asyncio.Event
    active: bool | None = None


@dataclass(eq=False, slots=True)
class _Group:
    query: Query
    subscriptions: set[Subscription] = field(default_factory=set)
    broadcast: bool | None = None
    # Streams that opened while the value was unknown: they learn the state at the next known value,
    # even when it is the one already broadcast (a transition-only wake-up would leave them silent).
    waiting: set[Subscription] = field(default_factory=set)
    # The engine pods its streams keep wanted (``Streams.keep_wanted``): the directory's state they were resolved
    # in, the reads, and when they were last wanted.
    engine_reads: tuple[Hashable, list[Read], float] | None = None


class Streams:
    """The evaluator's push streams: what each distinct query's streams were last told, and their engine pods."""

    def __init__(
        self,
        *,
        evaluate: Callable[[ValueSpec], Evaluation],
        observe: Callable[[Query, float], bool],
        on_push: list[Callable[[Query, Evaluation], None]],
        interest: EngineInterest | None,
        clock: Callable[[], float],
    ) -> None:
        """``observe`` moves a query's activation state with a known value and says whether it is active;
        ``on_push`` is the evaluator's list of observers of push evaluations (shared, not copied)."""
        self._evaluate = evaluate
        self._observe = observe
        self._on_push = on_push
        self._interest = interest
        self._clock = clock
        self._groups: dict[Hashable, _Group] = {}
        self._wanted_at: float | None = None

    def __len__(self) -> int:
        """How many distinct queries are streamed."""
        return len(self._groups)

    def keys(self) -> set[Hashable]:
        """The activation keys of the streamed queries (their states are never idle)."""
        return set(self._groups)

    def windows(self) -> list[WindowKey]:
        """The windows the streamed queries read: they stay requested while their streams are open."""
        return [w for g in self._groups.values() for w in windows_of(g.query.value)]

    @contextmanager
    def subscribe(self, query: Query, event: Callable[[], asyncio.Event]) -> Iterator[Subscription]:
        """A push subscription for the lifetime of the ``with`` block; ``active`` is set at once if known."""
        key = query.activation_key
        group = self._groups.get(key)
        if group is None:
            group = self._groups[key] = _Group(query)
        subscription = Subscription(query, event())
        group.subscriptions.add(subscription)
        try:
            evaluation = self._evaluate(query.value)
            for observer in self._on_push:
                observer(query, evaluation)
            if evaluation.value is not None:
                subscription.active = self._observe(query, evaluation.value)
            else:
                group.waiting.add(subscription)
            yield subscription
        finally:
            group.subscriptions.discard(subscription)
            group.waiting.discard(subscription)
            if not group.subscriptions:
                del self._groups[key]

    def push_gpu_queries(self) -> None:
        """A new snapshot: push the streamed queries that read GPUs."""
        self._push([group for group in self._groups.values() if _reads_gpus(group.query.value)])

    def push_engine_queries(self) -> None:
        """New scrapes: push the streamed queries that read engine signals."""
        self._push([group for group in self._groups.values() if _reads_engines(group.query.value)])

    def keep_wanted(self) -> None:
        """A push stream's engine pods stay wanted while it is open: the scraper forgets pods asked for by polls
        alone after a while, and a stream polls nothing. Its selection's new pods are wanted here too.

        A selection is resolved again only when the directory's state for it moved: thousands of streams of
        distinct queries on a quiet directory cost a few look-ups each, not a pass over their namespaces' pods."""
        interest = self._interest
        if interest is None or not self._groups:
            return
        now = self._clock()
        if self._wanted_at is not None and now - self._wanted_at < STREAM_INTEREST_EVERY_SECONDS:
            return
        self._wanted_at = now
        for group in self._groups.values():
            if not _reads_engines(group.query.value):
                continue
            state = interest.directory_state(group.query.value)
            kept = group.engine_reads
            if kept is not None and kept[0] == state:
                if now - kept[2] < STREAM_REWANT_SECONDS:
                    continue
                reads = kept[1]
            else:
                reads = interest.reads(group.query.value)
            group.engine_reads = (state, reads, now)
            interest.want(reads)

    def close(self) -> None:
        """Wake every push stream, so each handler sees the evaluator closing and returns."""
        for group in self._groups.values():
            for subscription in group.subscriptions:
                subscription.changed.set()

    def _push(self, groups: Iterable[_Group]) -> None:
        for group in list(groups):
            evaluation = self._evaluate(group.query.value)
            for observer in self._on_push:
                observer(group.query, evaluation)
            if evaluation.value is None:
                continue  # unknown is not inactive: keep the last state until the value is back
            active = self._observe(group.query, evaluation.value)
            if active != group.broadcast:
                group.broadcast = active
                woken: set[Subscription] = group.subscriptions
            else:
                woken = group.waiting
            for subscription in woken:
                if subscription.active != active:
                    subscription.active = active
                    subscription.changed.set()
            group.waiting.clear()


def _reads_gpus(value: ValueSpec) -> bool:
    if isinstance(value, CombinedQuery):
        return any(isinstance(part.query, GpuQuery) for part in value.signals)
    return isinstance(value, GpuQuery)


def _reads_engines(value: ValueSpec) -> bool:
    if isinstance(value, CombinedQuery):
        return any(isinstance(part.query, EngineQuery) for part in value.signals)
    return isinstance(value, EngineQuery)
