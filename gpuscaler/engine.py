"""The query engine: parses metadata, evaluates over the history, keeps activation, feeds push streams.

Handlers ask the engine; the engine never calls a collector. Streams with the same query share one
evaluation and one activation state per tick, so a tick costs one evaluation per distinct query,
however many streams are open. Unary calls within one tick reuse that tick's evaluations too.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Hashable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field

import structlog

from gpuscaler.activation import ActivationStates
from gpuscaler.attribution.directory import PodDirectory
from gpuscaler.evaluation import Evaluation, evaluate
from gpuscaler.history import History
from gpuscaler.metadata import Limits, parse_metadata
from gpuscaler.query import Query, ValueQuery
from gpuscaler.samples import DEVICE_FIELD, Snapshot

log = structlog.get_logger(__name__)

# Activation states of queries nobody asked about for this long are forgotten (KEDA polls every 30 s).
ACTIVATION_IDLE_SECONDS = 15 * 60.0
# KEDA sends each ScaledObject's same metadata on every call; parsed queries are kept for that many
# distinct metadata of at most that many keys and characters, so a client sending ever new metadata
# costs at most about PARSE_CACHE_ENTRIES * PARSE_CACHE_MAX_CHARS characters, and a huge request
# costs no more than parsing it did. There are 28 known keys.
PARSE_CACHE_ENTRIES = 1024
PARSE_CACHE_MAX_KEYS = 32
PARSE_CACHE_MAX_CHARS = 2048


def stale_after_for(poll_interval_seconds: float) -> float:
    """A sample older than this is not fresh: three missed ticks, and never under 2 s."""
    return max(3 * poll_interval_seconds, 2.0)


@dataclass(eq=False, slots=True)
class Subscription:
    """One open push stream: the engine sets ``active`` and ``changed`` when its query's state moves."""

    query: Query
    active: bool | None = None
    changed: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass(eq=False, slots=True)
class _Group:
    query: Query
    subscriptions: set[Subscription] = field(default_factory=set)
    broadcast: bool | None = None


class Engine:
    """Everything the gRPC handlers need, over one ``History``."""

    def __init__(
        self,
        history: History,
        *,
        clock: Callable[[], float] | None = None,
        directory: PodDirectory | None = None,
        cluster: bool = False,
    ) -> None:
        self.history = history
        self.directory = directory
        self.limits = Limits(history_seconds=history.history_seconds, cluster=cluster)
        self._parsed: dict[tuple[str, tuple[tuple[str, str], ...]], Query] = {}
        self.stale_after = stale_after_for(history.poll_interval_seconds)
        self._clock = clock or asyncio.get_running_loop().time
        self._states = ActivationStates(idle_seconds=ACTIVATION_IDLE_SECONDS)
        self._groups: dict[Hashable, _Group] = {}
        self._cache_sequence = -1
        self._cache: dict[ValueQuery, Evaluation] = {}
        self.closing = False
        self.on_transition: list[Callable[[bool], None]] = []

    def now(self) -> float:
        return self._clock()

    def parse(self, metadata: Mapping[str, str], namespace: str = "") -> Query:
        """``namespace`` is the ScaledObject's: the default namespace of a pod selection.

        Parsing is a pure function of the metadata (in its order: the first unknown key is the one
        named), the namespace and the limits, and a Query is immutable, so a parsed one is reused.
        Refusals are not kept: each raises afresh, with the same message.
        """
        items = tuple(metadata.items()) if len(metadata) <= PARSE_CACHE_MAX_KEYS else None
        if items is None or len(namespace) + sum(len(key) + len(value) for key, value in items) > PARSE_CACHE_MAX_CHARS:
            return parse_metadata(metadata, self.limits, namespace=namespace)  # too big to keep
        key = (namespace, items)
        query = self._parsed.get(key)
        if query is None:
            query = parse_metadata(metadata, self.limits, namespace=namespace)
            if len(self._parsed) >= PARSE_CACHE_ENTRIES:
                del self._parsed[next(iter(self._parsed))]  # the oldest entry
            self._parsed[key] = query
        return query

    def evaluate(self, query: ValueQuery) -> Evaluation:
        latest = self.history.latest
        fresh = latest is not None and self._clock() - latest.monotonic <= self.stale_after
        if not fresh or latest is None:
            return evaluate(
                query, self.history, now=self._clock(), stale_after=self.stale_after, directory=self.directory
            )
        if latest.sequence != self._cache_sequence:
            self._cache_sequence, self._cache = latest.sequence, {}
        cached = self._cache.get(query)
        if cached is None:
            cached = self._cache[query] = evaluate(
                query, self.history, now=latest.monotonic, stale_after=self.stale_after, directory=self.directory
            )
        return cached

    def value(self, query: Query) -> float:
        """The query's value now; raises the GpuscalerError KEDA must see instead of a made-up 0."""
        return self.evaluate(query.value).value_or_raise()

    def is_active(self, query: Query) -> bool:
        return self._observe(query, self.value(query))

    def _observe(self, query: Query, value: float) -> bool:
        transition = self._states.observe(query.activation_key, value, query.activation, now=self._clock())
        if transition.changed:
            for observer in self.on_transition:
                observer(transition.active)
            log.info(
                "activation_changed",
                metric_name=query.metric_name,
                active=transition.active,
                value=round(value, 3),
                activation_threshold=query.activation.activation_threshold,
                deactivation_threshold=query.activation.deactivation_threshold,
            )
        return transition.active

    @property
    def distinct_stream_queries(self) -> int:
        return len(self._groups)

    @contextmanager
    def subscribe(self, query: Query) -> Iterator[Subscription]:
        """A push subscription for the lifetime of the ``with`` block; ``active`` is set at once if known."""
        key = query.activation_key
        group = self._groups.get(key)
        if group is None:
            group = self._groups[key] = _Group(query)
        subscription = Subscription(query)
        group.subscriptions.add(subscription)
        try:
            evaluation = self.evaluate(query.value)
            if evaluation.value is not None:
                subscription.active = self._observe(query, evaluation.value)
            yield subscription
        finally:
            group.subscriptions.discard(subscription)
            if not group.subscriptions:
                del self._groups[key]

    def on_snapshot(self, snapshot: Snapshot) -> None:
        """Poll-loop listener: one evaluation per distinct streamed query, and a wake-up on each change."""
        for group in list(self._groups.values()):
            evaluation = self.evaluate(group.query.value)
            if evaluation.value is None:
                continue  # unknown is not inactive: keep the last state until the value is back
            active = self._observe(group.query, evaluation.value)
            if active == group.broadcast:
                continue
            group.broadcast = active
            for subscription in group.subscriptions:
                if subscription.active != active:
                    subscription.active = active
                    subscription.changed.set()
        self._states.forget_idle(now=self._clock(), keep=set(self._groups))

    def healthy(self) -> bool:
        """Fresh samples with at least one GPU read: what the health service reports as SERVING."""
        latest = self.history.latest
        if latest is None or self._clock() - latest.monotonic > self.stale_after:
            return False
        return any(all(error.field != DEVICE_FIELD for error in sample.errors) for sample in latest.samples)

    def close_streams(self) -> None:
        """Wake every push stream with ``closing`` set, so each handler returns and its stream ends OK."""
        self.closing = True
        for group in self._groups.values():
            for subscription in group.subscriptions:
                subscription.changed.set()
