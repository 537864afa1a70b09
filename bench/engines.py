"""Engine signals: the gateway's CPU per scrape of a pod's metrics page, by page size, and the pods one core reads.

Two measurements, both of the gateway's own code:
- parse: ``gateway/engines/page.read_whole_page`` on vLLM-like pages of 10 kB to 1 MB (the signals' series among
  histograms with vLLM's labels), beside prometheus-client's parser on the whole page, in this process;
- scrape: ``EngineScraper`` reading N pods (one page server in a child process, one pod key per "pod") at
  ``scrapeInterval`` 1 s for some seconds: this process's CPU per completed scrape, and the pods one core could
  read at 1 s (1 / CPU seconds per scrape). The page server runs on the other core where there is one.

``python -m bench.engines [--seconds 10] [--pods 200]`` writes ``bench/results/engines.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from bench.common import print_table, write_result
from gpuscaler.gateway.engines.limits import ScrapeLimits
from gpuscaler.gateway.engines.page import prefilter, read_whole_page
from gpuscaler.gateway.engines.scraper import EngineScraper
from gpuscaler.model.engines import Engine, engine_series
from gpuscaler.signals.engines.pods import Endpoint

SIZES_KB = (10, 100, 300, 1000)
LABELS = 'engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"'
BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)


def vllm_page(size_kb: int) -> str:
    """A vLLM metrics page of about ``size_kb`` kB: its three signal gauges, then histograms until the size."""
    lines = []
    for name, value in (
        ("vllm:num_requests_waiting", 3),
        ("vllm:num_requests_running", 12),
        ("vllm:kv_cache_usage_perc", 0.42),
    ):
        lines += [f"# HELP {name} {name}.", f"# TYPE {name} gauge", f"{name}{{{LABELS}}} {value}"]
    family = 0
    while sum(len(line) + 1 for line in lines) < size_kb * 1024:
        name = f"vllm:request_latency_{family}_seconds"
        lines += [f"# HELP {name} Histogram of a latency.", f"# TYPE {name} histogram"]
        lines += [f'{name}_bucket{{{LABELS},le="{le}"}} {i * 7}' for i, le in enumerate(BUCKETS)]
        lines += [f'{name}_bucket{{{LABELS},le="+Inf"}} 200', f"{name}_sum{{{LABELS}}} 81.5"]
        lines += [f"{name}_count{{{LABELS}}} 200"]
        family += 1
    return "\n".join(lines) + "\n"


def parse_costs(repeats: int) -> list[dict[str, Any]]:
    """CPU milliseconds per page: ours (prefilter + parser) and the parser alone on the whole page."""
    wanted = prefilter(engine_series(Engine.VLLM))
    rows = []
    for size_kb in SIZES_KB:
        text = vllm_page(size_kb)
        body = text.encode()
        started = time.process_time()
        for _ in range(repeats):
            page = read_whole_page(body, wanted, at=0.0)
        ours = (time.process_time() - started) / repeats
        assert page.values["vllm:num_requests_waiting"] == 3.0
        full_repeats = max(1, repeats // 10)
        started = time.process_time()
        for _ in range(full_repeats):
            for _family in text_string_to_metric_families(text):
                pass
        full = (time.process_time() - started) / full_repeats
        rows.append(
            {
                "page_kb": round(len(body) / 1024, 1),
                "ours_ms": round(1000 * ours, 3),
                "whole_page_parser_ms": round(1000 * full, 3),
            }
        )
    return rows


SERVER = """
import sys
from aiohttp import web
body = open(sys.argv[1], "rb").read()
async def metrics(request):
    return web.Response(body=body, content_type="text/plain")
app = web.Application()
app.router.add_get("/metrics", metrics)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[2]), print=lambda *a: print("serving", flush=True),
            access_log=None)
"""


@contextlib.contextmanager
def page_server(size_kb: int, folder: Path) -> Iterator[int]:
    """A child process serving a vLLM page of ``size_kb`` kB at /metrics on loopback; yields its port."""
    page_file = folder / f"page-{size_kb}.txt"
    page_file.write_text(vllm_page(size_kb), encoding="utf-8")
    port = _free_port()
    server = subprocess.Popen(
        [sys.executable, "-c", SERVER, str(page_file), str(port)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
    )
    try:
        assert server.stdout is not None
        server.stdout.readline()  # "serving"
        yield port
    finally:
        server.terminate()
        server.wait()
        if server.stdout is not None:
            server.stdout.close()


async def scrape_cost(port: int, size_kb: int, pods: int, seconds: float) -> dict[str, Any]:
    """This process's CPU per scrape while ``EngineScraper`` reads ``pods`` pods of ``size_kb`` kB at 1 s."""
    scraper = EngineScraper(ScrapeLimits(concurrency=32))
    await scraper.start()
    endpoint = Endpoint("127.0.0.1", port, "/metrics")
    keys = [("bench", f"pod-{index}") for index in range(pods)]

    def ask() -> None:
        for key in keys:
            scraper.want(key, Engine.VLLM, endpoint, 1.0)

    ask()
    await scraper.first_reads(keys, within_seconds=60.0)
    before_ok = scraper.results.get("ok", 0)
    cpu_before, started = time.process_time(), time.monotonic()
    while time.monotonic() - started < seconds:
        ask()  # as a push stream's interest is kept
        await asyncio.sleep(0.5)
    cpu = time.process_time() - cpu_before
    elapsed = time.monotonic() - started
    scrapes = scraper.results.get("ok", 0) - before_ok
    failed = sum(v for k, v in scraper.results.items() if k != "ok")
    await scraper.stop()
    per_scrape = cpu / scrapes if scrapes else float("nan")
    return {
        "page_kb": size_kb,
        "pods": pods,
        "seconds": round(elapsed, 1),
        "scrapes": scrapes,
        "scrapes_per_second": round(scrapes / elapsed, 1),
        "failed": failed,
        "cpu_ms_per_scrape": round(1000 * per_scrape, 3),
        "pods_per_core_at_1s": int(1 / per_scrape) if scrapes else 0,
        "cpu_share": round(cpu / elapsed, 3),
    }


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def main(argv: list[str] | None = None) -> int:
    """Measure both, print the tables, write ``bench/results/engines.json``."""
    parser = argparse.ArgumentParser(prog="python -m bench.engines", description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="seconds per scrape measurement (10)")
    parser.add_argument("--pods", type=int, default=200, help="pods read at 1 s in the scrape measurement (200)")
    parser.add_argument("--repeats", type=int, default=200, help="parses per page size (200)")
    args = parser.parse_args(argv)
    parse = parse_costs(args.repeats)
    print_table(
        "CPU per page (ms)",
        ["page kB", "prefilter + parser", "parser on the whole page"],
        [[r["page_kb"], r["ours_ms"], r["whole_page_parser_ms"]] for r in parse],
    )
    scrapes = []
    with tempfile.TemporaryDirectory() as folder:
        for size in (10, 100, 300):
            with page_server(size, Path(folder)) as port:
                scrapes.append(asyncio.run(scrape_cost(port, size, args.pods, args.seconds)))
    print_table(
        f"Scraping {args.pods} pods at 1 s (this process's CPU)",
        ["page kB", "scrapes/s", "failed", "CPU ms/scrape", "pods per core at 1 s", "CPU share"],
        [
            [
                r["page_kb"],
                r["scrapes_per_second"],
                r["failed"],
                r["cpu_ms_per_scrape"],
                r["pods_per_core_at_1s"],
                r["cpu_share"],
            ]
            for r in scrapes
        ],
    )
    path = write_result("engines", {"parse": parse, "scrape": scrapes})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
