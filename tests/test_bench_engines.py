"""bench/engines.py measures what it says: its pages are vLLM-shaped and read as the signals, its scrapes land."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.engines import page_server, scrape_cost, vllm_page
from gpuscaler.gateway.engines.page import prefilter, read_whole_page
from gpuscaler.model.engines import Engine, engine_series


@pytest.mark.parametrize("size_kb", [10, 300])
def test_a_bench_page_has_the_size_asked_and_reads_as_the_signals(size_kb: int) -> None:
    """The page is its size or one histogram (under 3 kB) more, and the scraper's reader finds the three signal
    gauges in it."""
    body = vllm_page(size_kb).encode()
    assert size_kb * 1024 <= len(body) < (size_kb + 3) * 1024
    values = read_whole_page(body, prefilter(engine_series(Engine.VLLM)), at=0.0).values
    assert values == {
        "vllm:num_requests_waiting": 3.0,
        "vllm:num_requests_running": 12.0,
        "vllm:kv_cache_usage_perc": 0.42,
    }


async def test_a_short_scrape_run_reads_every_pod_about_once_a_second(tmp_path: Path) -> None:
    """5 pods for 2 s: every read works, and there are about 5 a second (the count the CPU is divided by)."""
    with page_server(10, tmp_path) as port:
        result = await scrape_cost(port, 10, pods=5, seconds=2.0)
    assert result["failed"] == 0
    assert 5 <= result["scrapes"] <= 20
    assert result["cpu_ms_per_scrape"] > 0


async def test_the_bench_beside_agents_reads_every_pod_through_a_real_gateway(tmp_path: Path) -> None:
    """bench.engines_under_load's middle setting at a tiny size: a real gateway over 2 simulated agents answers
    the pods' summed queue (3 each), and the scrapes it counts in its /metrics are the pods', none failed."""
    from bench.engines_under_load import WAITING_PER_POD, Setting, measure

    with page_server(10, tmp_path) as port:
        result = await measure(Setting("agents and pods", 2, True), 3, port, tmp_path, 2.0)
    assert result["value"] == result["value_expected"] == 3 * WAITING_PER_POD
    assert result["failed_scrapes"] == 0
    assert result["scrapes_per_second"] > 0
    assert result["snapshots_per_second"] == 4
