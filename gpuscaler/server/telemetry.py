"""Prometheus metrics both servers export: RPCs, streams, activation, transport limits, GC pauses, TLS expiry,
and per ScaledObject the value and target KEDA was given.

Names follow Prometheus conventions: base units, ``_ratio`` for 0-1, ``_total`` for counters.
"""

from __future__ import annotations

import gc
import itertools
import time
from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from gpuscaler import __version__
from gpuscaler.model.samples import GpuKey
from gpuscaler.query.query import Query
from gpuscaler.server.overload import LimitCounts
from gpuscaler.server.transport.limits import LIMITS
from gpuscaler.signals.energy import IdleEnergy
from gpuscaler.signals.evaluator import Evaluator
from gpuscaler.signals.outcome import Evaluation
from gpuscaler.tls import ReloadingServerTLS

if TYPE_CHECKING:
    from gpuscaler.server.transport.server import ManyStreamsServer

UNARY_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
GC_PAUSE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
# A ScaledObject KEDA has not asked about for this long (and that holds no push stream) leaves the per-workload
# series: KEDA polls every 30 s by default, so this outlasts any polling interval but not a deleted ScaledObject.
SCALER_ANSWER_IDLE_SECONDS = 10 * 60.0
# At most this many (namespace, ScaledObject, metric name) entries, 3 series each. The names are the caller's, so
# a client inventing new ones costs at most this; the least recently asked entry without a stream goes first.
SCALER_ANSWER_ENTRIES = 5000
SCALER_ANSWER_LABELS = ("namespace", "scaled_object", "metric_name")


class GcPauses(Collector):
    """``gpuscaler_gc_pause_seconds`` by generation: Python's cycle collector stops the event loop (the poll
    loop and every RPC) for as long as each collection takes, and a full one walks every object the process
    holds. One per process, as ``gc.callbacks`` is; every registry that registers it exports it."""

    _process: ClassVar[GcPauses | None] = None

    def __init__(self) -> None:
        self._started = 0.0
        self._counts = [[0] * (len(GC_PAUSE_BUCKETS) + 1) for _ in range(3)]
        self._seconds = [0.0, 0.0, 0.0]

    @classmethod
    def of_process(cls) -> GcPauses:
        """The process's collector, following every collection from its first use on."""
        if cls._process is None:
            cls._process = cls()
            gc.callbacks.append(cls._process.observe)
        return cls._process

    def observe(self, phase: str, info: dict[str, Any]) -> None:
        """``gc.callbacks``' hook: a collection's start, then its end."""
        if phase == "start":
            self._started = time.perf_counter()
            return
        seconds = time.perf_counter() - self._started
        generation = info["generation"]
        self._counts[generation][bisect_left(GC_PAUSE_BUCKETS, seconds)] += 1
        self._seconds[generation] += seconds

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(
            "gpuscaler_gc_pause_seconds",
            "Python garbage collections by generation (2: full), each a pause of the whole event loop.",
            labels=["generation"],
        )
        for generation in range(3):
            cumulative = list(itertools.accumulate(self._counts[generation]))
            buckets = [(str(bound), count) for bound, count in zip(GC_PAUSE_BUCKETS, cumulative, strict=False)]
            family.add_metric([str(generation)], [*buckets, ("+Inf", cumulative[-1])], self._seconds[generation])
        yield family


class TransportCollector(Collector):
    """The gRPC server's connections, streams and request tasks, and its limits' actions, read at scrape time."""

    def __init__(self, server: ManyStreamsServer) -> None:
        self._server = server

    def collect(self) -> Iterator[Metric]:
        server = self._server
        guard = server.guard
        yield GaugeMetricFamily(
            "gpuscaler_grpc_connections", "gRPC connections open, handshaking ones included.", len(guard.connections)
        )
        yield GaugeMetricFamily(
            "gpuscaler_grpc_streams", "HTTP/2 streams grpclib holds, over all connections.", server.open_streams
        )
        yield GaugeMetricFamily(
            "gpuscaler_grpc_handler_tasks",
            "Request handler tasks alive, cancelled ones that have not finished included.",
            server.handler_tasks,
        )
        limited = CounterMetricFamily(
            "gpuscaler_grpc_limited",
            "Times a connection limit acted (docs/security.md), by limit.",
            labels=["limit"],
        )
        for limit in LIMITS:
            limited.add_metric([limit], guard.limited[limit])
        yield limited
        yield CounterMetricFamily(
            "gpuscaler_grpc_turns_deferred",
            "Reads of a connection that held more than one turn's budget of calls or bytes (--turn-calls, "
            "--turn-bytes), the rest served in its later turns: reordered, nothing refused.",
            guard.turns_deferred,
        )


class TlsCollector(Collector):
    """The serving certificate's expiry, as of the newest reload: an alert sees a renewal that never arrived."""

    def __init__(self, tls: ReloadingServerTLS) -> None:
        self._tls = tls

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            "gpuscaler_tls_certificate_expiry_timestamp_seconds",
            "notAfter of the certificate the gRPC listener serves now, in Unix seconds (updated at each reload).",
        )
        if self._tls.expiry is not None:  # unreadable: no series, not a 0 that reads as long expired
            family.add_metric([], self._tls.expiry)
        yield family


@dataclass(slots=True)
class _Answer:
    """What one ScaledObject's metric was last answered. ``order`` ranks it against push evaluations."""

    target: float | None
    seen: float
    value: float | None = None
    order: int = 0
    errors: int = 0
    streams: int = 0
    push_key: Hashable | None = None


class ScalerAnswers(Collector):
    """Per ScaledObject and metric name: the last value KEDA was answered (GetMetrics, or a push stream's
    evaluation, whichever is newer), the target it scales against, and the GetMetrics calls that failed.

    A value is absent, never 0, after an error answer. An entry lives while a push stream is open for it and
    ``idle_seconds`` after its last call; at most ``max_entries`` exist. Runs on the event loop thread only.
    """

    def __init__(
        self,
        *,
        clock: Callable[[], float] = time.monotonic,
        idle_seconds: float = SCALER_ANSWER_IDLE_SECONDS,
        max_entries: int = SCALER_ANSWER_ENTRIES,
    ) -> None:
        self._clock = clock
        self._idle_seconds = idle_seconds
        self._max_entries = max_entries
        self._entries: OrderedDict[tuple[str, str, str], _Answer] = OrderedDict()
        # Push evaluations are per activation key (streams with equal queries share one), and only those some open
        # stream holds are kept: (value, order). Read at scrape time, so a tick costs one write per distinct query.
        self._pushed: dict[Hashable, tuple[float | None, int]] = {}
        self._streamed: dict[Hashable, int] = {}
        self._order = 0
        self.dropped = 0

    def __len__(self) -> int:
        return len(self._entries)

    def observe_target(self, namespace: str, scaled_object: str, query: Query) -> None:
        """GetMetricSpec answered ``query.target`` for this ScaledObject."""
        self._entry((namespace, scaled_object, query.metric_name), query.target)

    def observe_value(self, namespace: str, scaled_object: str, query: Query, value: float) -> None:
        """GetMetrics answered ``value``."""
        entry = self._entry((namespace, scaled_object, query.metric_name), query.target)
        if entry is not None:
            self._order += 1
            entry.value, entry.order = value, self._order

    def observe_error(self, namespace: str, scaled_object: str, metric_name: str, query: Query | None) -> None:
        """GetMetrics answered an error: the value is unknown until the next answer. ``query`` is None when the
        metadata did not parse (no target then)."""
        entry = self._entry((namespace, scaled_object, metric_name), None if query is None else query.target)
        if entry is not None:
            self._order += 1
            entry.value, entry.order = None, self._order
            entry.errors += 1

    def stream_opened(self, namespace: str, scaled_object: str, query: Query) -> None:
        """A push stream opened: its evaluations are this entry's values while it stays open."""
        key = query.activation_key
        self._streamed[key] = self._streamed.get(key, 0) + 1
        entry = self._entry((namespace, scaled_object, query.metric_name), query.target)
        if entry is not None:
            entry.streams += 1
            entry.push_key = key

    def stream_closed(self, namespace: str, scaled_object: str, query: Query) -> None:
        """The stream ended: its newest evaluation stays the entry's value, which now ages like a polled one."""
        key = query.activation_key
        pushed = self._pushed.get(key)
        entry = self._entries.get((namespace, scaled_object, query.metric_name))
        if entry is not None and entry.streams > 0:
            entry.streams -= 1
            entry.seen = self._clock()
            if pushed is not None and pushed[1] > entry.order:
                entry.value, entry.order = pushed
        left = self._streamed.get(key, 0) - 1
        if left > 0:
            self._streamed[key] = left
        else:
            self._streamed.pop(key, None)
            self._pushed.pop(key, None)

    def observe_push(self, query: Query, evaluation: Evaluation) -> None:
        """The evaluator's hook: a push evaluation of ``query`` (None when it could not be known)."""
        key = query.activation_key
        if key in self._streamed:
            self._order += 1
            self._pushed[key] = (evaluation.value, self._order)

    def _entry(self, key: tuple[str, str, str], target: float | None) -> _Answer | None:
        now = self._clock()
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
            entry.seen = now
            if target is not None:
                entry.target = target
            return entry
        if len(self._entries) >= self._max_entries and not self._make_room(now):
            self.dropped += 1
            return None
        entry = self._entries[key] = _Answer(target, now)
        return entry

    def _make_room(self, now: float) -> bool:
        self._forget_idle(now)
        if len(self._entries) < self._max_entries:
            return True
        # The least recently asked entry without a stream: a stream's entry is live however long ago it opened.
        victim = next((key for key, entry in self._entries.items() if entry.streams == 0), None)
        if victim is None:
            return False
        del self._entries[victim]
        self.dropped += 1
        return True

    def _forget_idle(self, now: float) -> None:
        idle = [k for k, e in self._entries.items() if e.streams == 0 and now - e.seen > self._idle_seconds]
        for key in idle:
            del self._entries[key]

    def collect(self) -> Iterator[Metric]:
        self._forget_idle(self._clock())
        labels = list(SCALER_ANSWER_LABELS)
        value = GaugeMetricFamily(
            "gpuscaler_scaler_metric_value",
            "The value last answered for a ScaledObject's metric (GetMetrics or a push evaluation); absent after "
            "an error.",
            labels=labels,
        )
        target = GaugeMetricFamily(
            "gpuscaler_scaler_metric_target",
            "The target GetMetricSpec gives for a ScaledObject's metric.",
            labels=labels,
        )
        errors = CounterMetricFamily(
            "gpuscaler_scaler_metric_errors",
            "GetMetrics calls for a ScaledObject's metric answered with an error.",
            labels=labels,
        )
        for key, entry in self._entries.items():
            current = entry.value
            if entry.streams and entry.push_key is not None:
                pushed = self._pushed.get(entry.push_key)
                if pushed is not None and pushed[1] > entry.order:
                    current = pushed[0]
            names = list(key)
            if current is not None:
                value.add_metric(names, current)
            if entry.target is not None:
                target.add_metric(names, entry.target)
            errors.add_metric(names, entry.errors)
        yield from (value, target, errors)
        yield CounterMetricFamily(
            "gpuscaler_scaler_answers_dropped",
            f"ScaledObject entries dropped, or never kept, because {self._max_entries} were held.",
            value=self.dropped,
        )


class ServerTelemetry:
    """The series both servers export, agent and gateway alike: RPCs, push streams, activation, partial answers."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        registry = self.registry
        Gauge("gpuscaler_build_info", "The running version.", ["version"], registry=registry).labels(__version__).set(1)
        registry.register(GcPauses.of_process())
        registry.register(LimitCounts.of_process())
        self.rpc_handled = Counter(
            "gpuscaler_rpc_handled_total",
            "Finished RPCs by method and gRPC status; a client that hangs up counts as CANCELLED.",
            ["method", "code"],
            registry=registry,
        )
        self.rpc_seconds = Histogram(
            "gpuscaler_rpc_duration_seconds",
            "Latency of unary RPCs by method.",
            ["method"],
            buckets=UNARY_LATENCY_BUCKETS,
            registry=registry,
        )
        self.rpc_in_flight = Gauge(
            "gpuscaler_rpc_in_flight",
            "RPCs in progress by method; for streams, the open streams.",
            ["method"],
            registry=registry,
        )
        self.distinct_queries = Gauge(
            "gpuscaler_stream_distinct_queries",
            "Distinct queries among open push streams (one evaluation each per snapshot).",
            registry=registry,
        )
        self.transitions = Counter(
            "gpuscaler_activation_transitions_total",
            "Activation changes of any query, by direction.",
            ["direction"],
            registry=registry,
        )
        for direction in ("activate", "deactivate"):
            self.transitions.labels(direction)
        self.partial_answers = Counter(
            "gpuscaler_partial_answers_total",
            "Answers given without some selected GPUs (unreadable, left out of an all-GPU query) or nodes "
            "(left out under minNodes), by what was left out.",
            ["left_out"],
            registry=registry,
        )
        for left_out in ("gpus", "nodes"):
            self.partial_answers.labels(left_out)
        self.scaler_answers = ScalerAnswers()
        registry.register(self.scaler_answers)
        # prometheus_client's labels() validates and takes a lock at every call, four times per RPC; each
        # method's series are looked up once and kept. Bounded: the served methods and "unknown", by gRPC's codes.
        self._rpc_method_series: dict[str, tuple[Gauge, Histogram]] = {}
        self._rpc_handled: dict[tuple[str, str], Counter] = {}

    def watch(self, evaluator: Evaluator) -> None:
        """Follow ``evaluator``'s activation changes, partial answers and push streams."""
        evaluator.on_transition.append(self.observe_transition)
        evaluator.on_partial.append(self.observe_partial)
        evaluator.on_push.append(self.scaler_answers.observe_push)
        self.distinct_queries.set_function(lambda: evaluator.distinct_stream_queries)

    def watch_transport(self, server: ManyStreamsServer) -> None:
        """Export what the gRPC server holds, and each time one of its connection limits acts."""
        self.registry.register(TransportCollector(server))

    def watch_tls(self, tls: ReloadingServerTLS) -> None:
        """Export the expiry of the certificate ``tls`` serves, following its reloads."""
        self.registry.register(TlsCollector(tls))

    def idle_energy_of(self, gpus: Iterable[GpuKey], window_seconds: float | None) -> IdleEnergy | None:
        """Energy while idle of ``gpus`` for Explain, over the window where the server can tell."""
        return None

    def observe_rpc_started(self, method: str) -> None:
        self._rpc_series(method)[0].inc()

    def observe_rpc(self, method: str, code: str, seconds: float, streaming: bool) -> None:
        in_flight, latency = self._rpc_series(method)
        in_flight.dec()
        handled = self._rpc_handled.get((method, code))
        if handled is None:
            handled = self._rpc_handled[(method, code)] = self.rpc_handled.labels(method, code)
        handled.inc()
        if not streaming:
            latency.observe(seconds)

    def _rpc_series(self, method: str) -> tuple[Gauge, Histogram]:
        series = self._rpc_method_series.get(method)
        if series is None:
            series = self._rpc_method_series[method] = (
                self.rpc_in_flight.labels(method),
                self.rpc_seconds.labels(method),
            )
        return series

    def observe_partial(self, evaluation: Evaluation) -> None:
        if evaluation.unread:  # not the contributions: a cluster's would make every GPU's record
            self.partial_answers.labels("gpus").inc()
        if evaluation.absent:
            self.partial_answers.labels("nodes").inc()

    def observe_transition(self, active: bool) -> None:
        self.transitions.labels("activate" if active else "deactivate").inc()
