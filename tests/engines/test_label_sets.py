"""A pod's label sets combine as each signal says: a usage share is their mean, a queue their sum."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuscaler.gateway.engines.page import MalformedPage, prefilter, read_whole_page
from gpuscaler.model.engines import (
    ENGINE_SIGNALS,
    Engine,
    EngineMetric,
    EnginePage,
    EngineSignal,
    LabelSets,
    PodScrape,
    SignalKind,
    engine_series,
    series_bounds,
)
from gpuscaler.signals.engines.values import signal_value


def dp_page(series: dict[str, tuple[float, ...]], labels: str) -> bytes:
    """A page of one pod whose data-parallel engines each give one label set of every series; ``labels`` is a
    format string of the rank."""
    lines: list[str] = []
    for name, values in series.items():
        lines += [f"# HELP {name} {name}.", f"# TYPE {name} gauge"]
        lines += [f"{name}{{{labels.format(rank=rank)}}} {value}" for rank, value in enumerate(values)]
    return ("\n".join(lines) + "\n").encode()


VLLM_LABELS = 'engine="{rank}",model_name="meta-llama/Llama-3.1-8B-Instruct"'
SGLANG_LABELS = 'model_name="qwen",engine_type="unified",tp_rank="0",pp_rank="0",dp_rank="{rank}"'


def value_of(metric: EngineMetric, body: bytes) -> float | str:
    """The pod's value of ``metric`` from a page ``body`` read as the gateway reads it."""
    signal = ENGINE_SIGNALS[metric]
    wanted = prefilter(engine_series(signal.engine), series_bounds(signal.engine))
    page = read_whole_page(body, wanted, at=0.0)
    return signal_value(signal, PodScrape("http://10.0.0.1:8000/metrics", page), now=0.0, stale_after=3.0)


@pytest.mark.parametrize("cache", ["vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"])
def test_a_vllm_pod_of_two_engines_reads_its_cache_as_their_mean_and_its_queue_as_their_sum(cache: str) -> None:
    """Two vLLM engines at 50% and 70% KV cache make a pod 60% full (V1's name or V0's); 3 and 4 waiting make 7."""
    body = dp_page(
        {cache: (0.5, 0.7), "vllm:num_requests_waiting": (3, 4), "vllm:num_requests_running": (10, 20)}, VLLM_LABELS
    )
    page = read_whole_page(body, prefilter(engine_series(Engine.VLLM)), at=0.0)
    assert page.values[cache] == pytest.approx(1.2)  # the page keeps the sum and the count
    assert page.counts == {cache: 2, "vllm:num_requests_waiting": 2, "vllm:num_requests_running": 2}
    assert value_of(EngineMetric.VLLM_KV_CACHE, body) == pytest.approx(60.0)
    assert value_of(EngineMetric.VLLM_QUEUE, body) == 7.0
    assert value_of(EngineMetric.VLLM_RUNNING, body) == 30.0


def test_an_sglang_pod_of_two_ranks_reads_its_token_usage_as_their_mean_and_its_queue_as_their_sum() -> None:
    """Two SGLang data-parallel ranks at 0.5 and 0.7 token usage make 60%; 2 and 6 queued make 8."""
    body = dp_page(
        {"sglang:token_usage": (0.5, 0.7), "sglang:num_queue_reqs": (2, 6), "sglang:num_running_reqs": (1, 1)},
        SGLANG_LABELS,
    )
    assert value_of(EngineMetric.SGLANG_TOKEN_USAGE, body) == pytest.approx(60.0)
    assert value_of(EngineMetric.SGLANG_QUEUE, body) == 8.0
    assert value_of(EngineMetric.SGLANG_RUNNING, body) == 2.0


def test_one_engine_reads_as_it_did() -> None:
    """A pod of one engine reads its one label set, whichever way the signal combines them."""
    body = dp_page({"vllm:kv_cache_usage_perc": (0.42,), "vllm:num_requests_waiting": (5,)}, VLLM_LABELS)
    assert value_of(EngineMetric.VLLM_KV_CACHE, body) == pytest.approx(42.0)
    assert value_of(EngineMetric.VLLM_QUEUE, body) == 5.0


def test_the_bound_holds_for_each_label_set_not_their_mean() -> None:
    """An engine at 150% is no engine's, even beside one at 10% whose mean with it would be within 100%."""
    body = dp_page({"vllm:kv_cache_usage_perc": (1.5, 0.1)}, VLLM_LABELS)
    with pytest.raises(MalformedPage, match=r"vllm:kv_cache_usage_perc is 1\.5, past the 1 "):
        value_of(EngineMetric.VLLM_KV_CACHE, body)


def test_a_page_that_does_not_count_its_label_sets_leaves_a_mean_unread() -> None:
    """A page without label-set counts gives no mean (no guessed divisor), and still gives a sum."""
    page = EnginePage(at=0.0, values={"vllm:kv_cache_usage_perc": 1.2, "vllm:num_requests_waiting": 7.0})
    scrape = PodScrape("http://10.0.0.1:8000/metrics", page)
    cache = signal_value(ENGINE_SIGNALS[EngineMetric.VLLM_KV_CACHE], scrape, now=0.0, stale_after=3.0)
    assert isinstance(cache, str)
    assert "does not say how many label sets vllm:kv_cache_usage_perc has" in cache
    assert signal_value(ENGINE_SIGNALS[EngineMetric.VLLM_QUEUE], scrape, now=0.0, stale_after=3.0) == 7.0


def test_every_share_averages_and_every_count_sums() -> None:
    """A signal in % (a share of a pool) averages its label sets; requests, waits and rates sum them."""
    for metric, signal in ENGINE_SIGNALS.items():
        expected = LabelSets.MEAN if signal.unit == "%" else LabelSets.SUM
        assert signal.label_sets is expected, metric


def test_only_a_gauge_may_average_its_label_sets() -> None:
    """A rate or a ratio of counters that says it averages its label sets is refused when the table is built."""
    rate = ENGINE_SIGNALS[EngineMetric.TRITON_REQUEST_RATE]
    with pytest.raises(ValueError, match="nv_inference_request_success: a rate sums"):
        EngineSignal(
            rate.engine,
            rate.series,
            SignalKind.RATE,
            rate.unit,
            rate.help,
            target=rate.target,
            activation_threshold=rate.activation_threshold,
            additive=rate.additive,
            bound=rate.bound,
            label_sets=LabelSets.MEAN,
        )


def test_the_docs_signal_table_is_the_code_table() -> None:
    """docs/engines.md's signal table gives each signal's engine, kind, unit, default target, how its label sets
    combine and how pods combine, as the code's table does, and no signal more or less."""
    text = (Path(__file__).parents[2] / "docs" / "engines.md").read_text(encoding="utf-8")
    rows = {}
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 8 and cells[0].startswith("`") and cells[0].strip("`") in set(EngineMetric):
            rows[EngineMetric(cells[0].strip("`"))] = (cells[1], cells[3], cells[4], cells[5], cells[6], cells[7])
    assert rows == {
        metric: (
            signal.engine.value,
            signal.kind.value,
            signal.unit,
            f"{signal.target:g}",
            signal.label_sets.value,
            signal.aggregation.value,
        )
        for metric, signal in ENGINE_SIGNALS.items()
    }
