"""The engine scraper's Prometheus series: each pod read now, its signals and age, every scrape by outcome, and
each time a limit on reading acted.

Per-pod series exist while some query wants the pod read, so a workload scaled away takes its series with it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gpuscaler.gateway.engines.epp_token import REQUEST_OUTCOMES, WITHHELD_REASONS, EppCredentials
from gpuscaler.gateway.engines.scraper import LIMITS, EngineScraper

SCRAPE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
OUTCOMES = ("ok", "timeout", "error", "status", "too_large", "too_many_label_sets", "malformed")


class _EngineCollector(Collector):
    def __init__(self, scraper: EngineScraper, clock: Callable[[], float]) -> None:
        self._scraper = scraper
        self._clock = clock

    def collect(self) -> Iterator[Metric]:
        now = self._clock()
        series = GaugeMetricFamily(
            "gpuscaler_gateway_engine_series",
            "A series the engine signals read, summed over its label sets, from the pod's newest metrics page.",
            labels=["namespace", "pod", "series"],
        )
        age = GaugeMetricFamily(
            "gpuscaler_gateway_engine_page_age_seconds",
            "Age of the pod's newest metrics page read; it grows while the pod cannot be read.",
            labels=["namespace", "pod"],
        )
        up = GaugeMetricFamily(
            "gpuscaler_gateway_engine_up",
            "1 when the newest read of the pod's metrics page worked, 0 when it failed.",
            labels=["namespace", "pod"],
        )
        for (namespace, pod), scrape in sorted(self._scraper.pods().items()):
            up.add_metric([namespace, pod], 0.0 if scrape.error else 1.0)
            if scrape.page is not None:
                age.add_metric([namespace, pod], max(0.0, now - scrape.page.at))
                for name, value in sorted(scrape.page.values.items()):
                    series.add_metric([namespace, pod, name], value)
        scrapes = CounterMetricFamily(
            "gpuscaler_gateway_engine_scrapes",
            "Reads of engine metrics pages by outcome: ok, timeout, error (connection), status (not 200), "
            "too_large, too_many_label_sets, malformed.",
            labels=["outcome"],
        )
        for outcome in OUTCOMES:
            scrapes.add_metric([outcome], self._scraper.results.get(outcome, 0))
        limited = CounterMetricFamily(
            "gpuscaler_gateway_engine_limited",
            "Times a limit on reading engine pages acted (docs/security.md), by limit: namespace_share (a read "
            "waited because its namespace held its share of the slots), backoff (a failing pod's next read put off), "
            "first_read_wait (a query answered before its pods' first reads landed), max_pods_per_selection.",
            labels=["limit"],
        )
        for limit in LIMITS:
            limited.add_metric([limit], self._scraper.limited[limit])
        yield from (series, age, up, scrapes, limited)
        credentials = self._scraper.reader.authorize
        if isinstance(credentials, EppCredentials):  # --epp-metrics-token-service-account: its series, else none
            yield from _epp_token_families(credentials)


def _epp_token_families(credentials: EppCredentials) -> Iterator[Metric]:
    requests = CounterMetricFamily(
        "gpuscaler_gateway_epp_token_requests",
        "TokenRequests for the EPP's bearer token by outcome: ok, failed (RBAC, a missing ServiceAccount, the API).",
        labels=["outcome"],
    )
    for outcome in REQUEST_OUTCOMES:
        requests.add_metric([outcome], credentials.token.requests[outcome])
    withheld = CounterMetricFamily(
        "gpuscaler_gateway_epp_token_withheld",
        "EPP reads sent no token, by reason: address (not the pod's own address now), namespace (not one of "
        "--epp-namespaces), not_a_picker (no InferencePool's endpointPickerRef selects it), watch (the InferencePool "
        "or Service watch not ready: the read fails), no_token (none could be had: the read fails).",
        labels=["reason"],
    )
    for reason in WITHHELD_REASONS:
        withheld.add_metric([reason], credentials.withheld[reason])
    yield from (requests, withheld)


def register(scraper: EngineScraper, registry: CollectorRegistry) -> None:
    """Add the scraper's series to ``registry``."""
    registry.register(_EngineCollector(scraper, time.monotonic))
    duration = Histogram(
        "gpuscaler_gateway_engine_scrape_duration_seconds",
        "Time one read of a pod's engine metrics page took, the wait for a free slot included.",
        buckets=SCRAPE_BUCKETS,
        registry=registry,
    )
    scraper.on_scrape.append(lambda seconds, _: duration.observe(seconds))
