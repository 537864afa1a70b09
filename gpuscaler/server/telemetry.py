"""Prometheus metrics both servers export: RPCs, streams, activation, transport limits, GC pauses.

Names follow Prometheus conventions: base units, ``_ratio`` for 0-1, ``_total`` for counters.
"""

from __future__ import annotations

import gc
import itertools
import time
from bisect import bisect_left
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, ClassVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from gpuscaler import __version__
from gpuscaler.model.samples import GpuKey
from gpuscaler.server.overload import LimitCounts
from gpuscaler.server.transport.limits import LIMITS
from gpuscaler.signals.energy import IdleEnergy
from gpuscaler.signals.evaluator import Evaluator
from gpuscaler.signals.outcome import Evaluation

if TYPE_CHECKING:
    from gpuscaler.server.transport.server import ManyStreamsServer

UNARY_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
GC_PAUSE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


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
        # prometheus_client's labels() validates and takes a lock at every call, four times per RPC; each
        # method's series are looked up once and kept. Bounded: the served methods and "unknown", by gRPC's codes.
        self._rpc_method_series: dict[str, tuple[Gauge, Histogram]] = {}
        self._rpc_handled: dict[tuple[str, str], Counter] = {}

    def watch(self, evaluator: Evaluator) -> None:
        """Follow ``evaluator``'s activation changes, partial answers and push streams."""
        evaluator.on_transition.append(self.observe_transition)
        evaluator.on_partial.append(self.observe_partial)
        self.distinct_queries.set_function(lambda: evaluator.distinct_stream_queries)

    def watch_transport(self, server: ManyStreamsServer) -> None:
        """Export what the gRPC server holds, and each time one of its connection limits acts."""
        self.registry.register(TransportCollector(server))

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
