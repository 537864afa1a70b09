"""dev/fake_engines.py's one-pod mode, which `make e2e-node` runs in place of each engine example's engine container.

Its pages are read with the gateway's own page reader and signal arithmetic, so what the node suite sets is what
the gateway computes: each signal of each engine, from the requests a test puts in the pod.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuscaler.gateway.engines.page import prefilter, read_whole_page
from gpuscaler.model.engines import ENGINE_SIGNALS, Engine, EngineMetric, PodScrape, engine_series
from gpuscaler.signals.engines.values import signal_value

FAKE_ENGINES = Path(__file__).resolve().parents[2] / "dev" / "fake_engines.py"
REQUESTS = 36  # 16 run (the fake's batch), 20 wait
# Each signal's value in a pod holding REQUESTS, by the fake's model: 80 requests finish a second (16 running at
# 0.2 s each), and the 20 waiting wait 20 / 80 s = 250 ms each (Little's law).
EXPECTED = {
    EngineMetric.VLLM_QUEUE: 20.0,
    EngineMetric.VLLM_RUNNING: 16.0,
    EngineMetric.VLLM_KV_CACHE: 90.0,
    EngineMetric.TRITON_PENDING: 20.0,
    EngineMetric.TRITON_QUEUE_WAIT: 250.0,
    EngineMetric.TRITON_REQUEST_RATE: 80.0,
    EngineMetric.SGLANG_QUEUE: 20.0,
    EngineMetric.SGLANG_RUNNING: 16.0,
    EngineMetric.SGLANG_TOKEN_USAGE: 90.0,
    EngineMetric.TGI_QUEUE: 20.0,
    EngineMetric.TGI_BATCH: 16.0,
}
HEALTH = {Engine.VLLM: "/health", Engine.TRITON: "/v2/health/ready", Engine.SGLANG: "/health", Engine.TGI: "/health"}
# Finished requests to wait for between the two reads of a rate: at 80 a second, about half a second.
FINISHED_BETWEEN_READS = 40.0


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


@pytest.fixture(params=list(HEALTH), ids=str)  # the model servers dev/fake_engines.py fakes
def pod(request: pytest.FixtureRequest) -> Iterator[tuple[Engine, list[int]]]:
    """The fake engine of one pod, on two loopback ports, stopped after the test."""
    engine: Engine = request.param
    ports = _free_ports(2)
    argv = [sys.executable, str(FAKE_ENGINES), "--engine", engine.value, "--host", "127.0.0.1"]
    argv += [arg for port in ports for arg in ("--port", str(port))]
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as process:
        try:
            assert process.stdout is not None
            line = process.stdout.readline()  # blocks until it serves, or ends
            assert line.startswith("fake_engine_started"), line + process.stdout.read()
            yield engine, ports
        finally:
            process.terminate()
            process.wait(timeout=30)


def _call(method: str, url: str, body: bytes | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(url, data=body, method=method)
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return int(answer.status), bytes(answer.read())
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def _read(port: int) -> tuple[float, bytes]:
    status, body = _call("GET", f"http://127.0.0.1:{port}/metrics")
    assert status == 200
    return time.monotonic(), body


def test_each_signal_reads_what_the_pods_requests_make(pod: tuple[Engine, list[int]]) -> None:
    """After ``PUT /fake/requests 36``, the gateway's reader gives every signal of the engine the model's value, on
    each port, and the engine's health path answers there too."""
    engine, ports = pod
    for port in ports:
        assert _call("GET", f"http://127.0.0.1:{port}{HEALTH[engine]}")[0] == 200
    assert _call("PUT", f"http://127.0.0.1:{ports[0]}/fake/requests", str(REQUESTS).encode()) == (204, b"")
    wanted = prefilter(engine_series(engine))
    signals = {metric: signal for metric, signal in ENGINE_SIGNALS.items() if signal.engine is engine}
    at, body = _read(ports[1])
    first = read_whole_page(body, wanted, at=at)
    finished = "nv_inference_request_success"
    second = first
    while second.values.get(finished, 0.0) - first.values.get(finished, 0.0) < FINISHED_BETWEEN_READS:
        at, body = _read(ports[1])
        second = read_whole_page(body, wanted, at=at)
        if finished not in second.values:
            break  # not Triton: no counter to wait for
    scrape = PodScrape(endpoint="fake", page=second, previous=first)
    values = {metric: signal_value(signal, scrape, now=at, stale_after=60) for metric, signal in signals.items()}
    tolerance = {EngineMetric.TRITON_REQUEST_RATE: 0.25}  # the reads' times are the test's, the counts the fake's
    for metric, value in values.items():
        assert value == pytest.approx(EXPECTED[metric], rel=tolerance.get(metric, 1e-9)), (metric, value)


def test_a_request_count_that_is_no_number_is_refused_naming_it(pod: tuple[Engine, list[int]]) -> None:
    """``PUT /fake/requests`` with a negative count or a word answers 400 naming the body and what is allowed."""
    _, ports = pod
    for body in (b"-1", b"many"):
        status, text = _call("PUT", f"http://127.0.0.1:{ports[0]}/fake/requests", body)
        assert status == 400
        assert f"body {body.decode()!r} is not a number of requests of 0 or more" in text.decode()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--engine", "vllm"], "--engine vllm needs --port"),
        (["--port", "8000"], "give either --listen HOST:PORT"),
        (["--engine", "vllm", "--port", "0"], "--port '0': a port from 1 to 65535"),
        (["--engine", "llama", "--port", "8000"], "invalid choice: 'llama'"),
    ],
)
def test_a_mode_without_what_it_needs_exits_with_usage(argv: list[str], message: str) -> None:
    """Flags that name no mode, or a pod engine without a port, exit 2 with a line that says what to give."""
    result = subprocess.run(
        [sys.executable, str(FAKE_ENGINES), *argv], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr
