"""Engine signals piece by piece: the page parser, one pod's value, which pods count and where they are read."""

from __future__ import annotations

import math

import pytest

from gpuscaler.gateway.engines.page import MalformedPage, prefilter, read_whole_page
from gpuscaler.model.engines import ENGINE_SIGNALS, Engine, EngineMetric, EnginePage, PodScrape, engine_series
from gpuscaler.model.pods import PodInfo
from gpuscaler.signals.engines.pods import Endpoint, left_out_because, metrics_endpoint
from gpuscaler.signals.engines.values import signal_value
from tests.fakes.fake_engine import FakeEngine


def parsed(engine: Engine, text: str) -> dict[str, float]:
    """The series a page of ``engine`` gives, as the scraper keeps them."""
    return dict(read_whole_page(text.encode(), prefilter(engine_series(engine)), at=0.0).values)


@pytest.mark.parametrize("engine", list(Engine))
def test_each_engines_page_gives_every_series_its_signals_read(engine: Engine) -> None:
    """Each engine's page, as the engine writes it, gives every series its signals read and none of the rest."""
    fake = FakeEngine(engine, {"waiting": 3, "running": 5, "kv": 0.25, "pending": 4, "success": 10, "queue_us": 8})
    values = parsed(engine, fake.page())
    wanted = {
        name
        for s in ENGINE_SIGNALS.values()
        if s.engine is engine
        for name in (s.read[0], s.per_of(s.read[0]))
        if name is not None
    }
    assert wanted <= set(values), values
    assert not any(name.startswith(("process_", "vllm:e2e")) for name in values)  # the prefilter kept only these


def test_vllm_v0_and_v1_cache_names_are_both_read() -> None:
    """The KV-cache signal reads V1's kv_cache_usage_perc or V0's gpu_cache_usage_perc, as a percentage."""
    signal = ENGINE_SIGNALS[EngineMetric.VLLM_KV_CACHE]
    for v0 in (False, True):
        page = read_whole_page(
            FakeEngine(Engine.VLLM, {"kv": 0.4}, v0=v0).page().encode(), prefilter(engine_series(Engine.VLLM)), at=0.0
        )
        value = signal_value(signal, PodScrape("u", page), now=0.0, stale_after=3.0)
        assert value == pytest.approx(40.0)


def test_triton_counters_sum_over_models_with_or_without_total() -> None:
    """A counter sums over its models whether the page spells its samples with _total or without."""
    text = (
        "# TYPE nv_inference_request_success counter\n"
        'nv_inference_request_success{model="a",version="1"} 6\n'
        'nv_inference_request_success_total{model="b",version="1"} 4\n'
    )
    assert parsed(Engine.TRITON, text) == {"nv_inference_request_success": 10.0}


@pytest.mark.parametrize("value", ["NaN", "-1", "+Inf"])
def test_a_value_no_engine_reports_makes_the_page_malformed(value: str) -> None:
    """NaN, a negative value or infinity in a series a signal reads makes the whole page malformed."""
    with pytest.raises(MalformedPage, match="which no engine reports"):
        parsed(Engine.TGI, f"tgi_queue_size {value}\n")


def test_text_that_is_not_prometheus_is_malformed() -> None:
    """A kept line the Prometheus parser cannot read makes the page malformed, with the parser's reason."""
    with pytest.raises(MalformedPage, match="not Prometheus text"):
        parsed(Engine.TGI, 'tgi_queue_size{x="1" 3\n')


def page(at: float, **values: float) -> EnginePage:
    """A page read at ``at`` with ``values``."""
    return EnginePage(at, values)


def test_a_rate_counts_a_reset_as_counting_from_zero() -> None:
    """A rate is the counter's increase per second; after a restart it counts from zero, never negative."""
    signal = ENGINE_SIGNALS[EngineMetric.TRITON_REQUEST_RATE]
    name = "nv_inference_request_success"
    steady = PodScrape("u", page(2.0, **{name: 130.0}), page(1.0, **{name: 100.0}))
    assert signal_value(signal, steady, now=2.0, stale_after=3.0) == pytest.approx(30.0)
    restarted = PodScrape("u", page(2.0, **{name: 7.0}), page(1.0, **{name: 100.0}))
    assert signal_value(signal, restarted, now=2.0, stale_after=3.0) == pytest.approx(7.0)  # never negative
    first = PodScrape("u", page(1.0, **{name: 100.0}))
    assert "needs two scrapes" in str(signal_value(signal, first, now=1.0, stale_after=3.0))


def test_queue_wait_is_queue_time_per_finished_request_and_zero_when_idle() -> None:
    """Queue wait is the queue time's increase per finished request, in ms; 0 when nothing finished."""
    signal = ENGINE_SIGNALS[EngineMetric.TRITON_QUEUE_WAIT]
    q, s = "nv_inference_queue_duration_us", "nv_inference_request_success"
    busy = PodScrape("u", page(2.0, **{q: 600_000.0, s: 20.0}), page(1.0, **{q: 100_000.0, s: 10.0}))
    assert signal_value(signal, busy, now=2.0, stale_after=3.0) == pytest.approx(50.0)  # 500 ms / 10 requests
    idle = PodScrape("u", page(2.0, **{q: 100.0, s: 10.0}), page(1.0, **{q: 100.0, s: 10.0}))
    assert signal_value(signal, idle, now=2.0, stale_after=3.0) == 0.0


def test_an_old_page_an_error_or_no_read_is_no_value() -> None:
    """A page past stale_after, a failed read, no read yet, or another engine's page each give a reason, no value."""
    signal = ENGINE_SIGNALS[EngineMetric.VLLM_QUEUE]
    fresh = PodScrape("http://p/metrics", page(1.0, **{"vllm:num_requests_waiting": 2.0}))
    assert signal_value(signal, fresh, now=2.0, stale_after=3.0) == 2.0
    assert "last read 9.0s ago" in str(signal_value(signal, fresh, now=10.0, stale_after=3.0))
    failed = PodScrape("http://p/metrics", fresh.page, None, "no answer within 2s")
    assert str(signal_value(signal, failed, now=5.0, stale_after=3.0)) == "http://p/metrics: no answer within 2s"
    assert signal_value(signal, None, now=5.0, stale_after=3.0) == "not read yet"
    other = PodScrape("u", page(1.0, tgi_queue_size=1.0))
    assert "is it a vllm pod?" in str(signal_value(signal, other, now=1.0, stale_after=3.0))


def pod(**fields: object) -> PodInfo:
    """A Running, Ready pod on the pod network, with ``fields`` changed."""
    defaults: dict[str, object] = {
        "namespace": "ml",
        "pod": "llm-0",
        "ip": "10.1.2.3",
        "phase": "Running",
        "ready": True,
    }
    return PodInfo(**{**defaults, **fields})  # type: ignore[arg-type]


def test_the_metrics_port_comes_from_the_pod_annotation_first_then_a_named_port_then_the_engine_default() -> None:
    """The port is the annotation's (a number or a port name), else the port named metrics, else the engine's
    default where declared."""
    assert metrics_endpoint(pod(metrics_port="9100", metrics_path="/custom/path"), Engine.VLLM) == Endpoint(
        "10.1.2.3", 9100, "/custom/path"
    )
    assert metrics_endpoint(pod(metrics_port="http", ports=(("http", 8080),)), Engine.VLLM) == Endpoint(
        "10.1.2.3", 8080, "/metrics"
    )
    assert metrics_endpoint(pod(ports=(("http", 8000), ("metrics", 9400))), Engine.VLLM) == Endpoint(
        "10.1.2.3", 9400, "/metrics"
    )
    assert metrics_endpoint(pod(ports=(("", 8002),)), Engine.TRITON) == Endpoint("10.1.2.3", 8002, "/metrics")
    assert "declares no metrics port" in str(metrics_endpoint(pod(ports=(("", 8000),)), Engine.TRITON))
    assert Endpoint("fd00::1", 8000, "/metrics").url == "http://[fd00::1]:8000/metrics"


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"host_network": True, "metrics_port": "10250"}, "hostNetwork"),
        ({"ip": None}, "no pod IP"),
        ({"metrics_port": "99999"}, "neither a port number"),
        ({"metrics_port": "8000", "metrics_path": "http://169.254.169.254/"}, "not an absolute URL path"),
        ({"metrics_port": "8000", "metrics_path": "/m?x=1"}, "not an absolute URL path"),
    ],
)
def test_a_pod_that_could_aim_the_gateway_elsewhere_is_never_read(fields: dict[str, object], says: str) -> None:
    """hostNetwork pods, pods without an IP, and annotations naming a bad port or a URL are never read."""
    assert says in str(metrics_endpoint(pod(**fields), Engine.VLLM))


def test_only_running_ready_pods_that_are_not_terminating_count() -> None:
    """A pod counts when Running, Ready and not terminating; otherwise the reason says which."""
    assert left_out_because(pod()) is None
    assert "terminating" in str(left_out_because(pod(deleting=True)))
    assert "not Ready" in str(left_out_because(pod(ready=False)))
    assert "phase Pending" in str(left_out_because(pod(phase="Pending", ready=None)))


def test_every_signal_reads_a_series_its_engine_serves_and_has_sane_defaults() -> None:
    """Every row is named for its engine, has a positive finite target, and a divisor exactly when a ratio."""
    for metric, signal in ENGINE_SIGNALS.items():
        assert metric.value.startswith(signal.engine.value + "_")
        assert signal.target > 0
        assert not math.isinf(signal.target)
        assert (signal.per is not None) == (signal.kind.value == "ratio")
