"""Tenants do not wait on each other (issue 31, rows 2 and 8): a gateway process, pods from a static directory,
fake engines in this test's event loop on loopback.

Row 2: one tenant's Ready pods whose pages never answer, beside another tenant's healthy pod. The healthy tenant's
GetMetrics, with KEDA's deadline, gets its value at once and every time after, and sees its pod's change within
its freshness rule. Row 8: one query may not make the gateway read a large selection often: a scrapeInterval under
``--engine-min-scrape-interval`` and a selection past ``--engine-max-pods-per-selection`` are refused, naming the
key, and nothing is read for them. Limits are small so that each test takes seconds.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from pathlib import Path

import pytest
from grpclib import GRPCError

from e2e.support.engine_gateway import EngineGateways, StartGateway, counts_by, get_metrics
from e2e.support.process import Process
from gpuscaler.model.engines import Engine
from tests.fakes.fake_engine import FakeEngine
from tests.waiting import until, until_result

SILENT_PODS = 24
SCRAPE_TIMEOUT = "3"  # a silent pod holds a read slot this long
CONCURRENCY = "4"
KEDA_DEADLINE_SECONDS = 2.0  # the grpc-timeout of each call, as KEDA's calls carry one


def pod(namespace: str, name: str, engine: FakeEngine, workload: str) -> dict[str, object]:
    """A Running, Ready pod of ``workload`` on 127.0.0.1 whose metrics page is ``engine``'s."""
    return {
        "namespace": namespace,
        "pod": name,
        "workload": workload,
        "ip": "127.0.0.1",
        "annotations": {"prometheus.io/port": str(engine.port)},
    }


@pytest.fixture
async def engines() -> AsyncIterator[list[FakeEngine]]:
    """Fake engines a test starts, stopped after it."""
    started: list[FakeEngine] = []
    yield started
    for engine in started:
        await engine.stop()


async def serve(engines: list[FakeEngine], mode: str = "ok", **values: float) -> FakeEngine:
    """A fake vLLM on loopback serving ``values`` (``mode`` hang: it never answers)."""
    fake = await FakeEngine(Engine.VLLM, dict(values), mode=mode).start()
    engines.append(fake)
    return fake


@pytest.fixture
async def start_gateway(tmp_path: Path) -> AsyncIterator[StartGateway]:
    """Starts ``gpuscaler gateway`` processes over a pod directory and no agent, and stops them."""
    gateways = EngineGateways(tmp_path)
    yield gateways.start
    await gateways.stop()


async def keda_asks(port: int, namespace: str, timeout: float = KEDA_DEADLINE_SECONDS, **metadata: str) -> float:
    """GetMetricSpec, then GetMetrics with ``timeout`` as its deadline (KEDA's calls carry one)."""
    return await get_metrics(port, namespace, metadata, timeout=timeout)


async def outcome(call: Awaitable[float]) -> float | str:
    """The value, or the status and message of the refusal (a deadline the client saw pass: DEADLINE_EXCEEDED)."""
    try:
        return await call
    except GRPCError as error:
        return f"{error.status.name}: {error.message}"
    except TimeoutError:
        return "DEADLINE_EXCEEDED"


def limited(gateway: Process) -> dict[str, float]:
    """gpuscaler_gateway_engine_limited_total by limit, from the gateway's /metrics."""
    return counts_by(gateway, "gpuscaler_gateway_engine_limited_total", "limit")


async def test_one_tenants_silent_pods_do_not_stall_another_tenants_answers(
    engines: list[FakeEngine], start_gateway: StartGateway
) -> None:
    """Tenant noisy's 24 Ready pods never answer and fill the read slots; tenant ml's healthy pod is answered
    within KEDA's 2 s deadline on the first call and on every call after, and its change is seen."""
    silent = await serve(engines, mode="hang")
    healthy = await serve(engines, waiting=3)
    pods = [pod("noisy", f"silent-{index}", silent, "batch") for index in range(SILENT_PODS)]
    gateway = start_gateway(
        [*pods, pod("ml", "llm-0", healthy, "llm")],
        ("--engine-scrape-timeout", SCRAPE_TIMEOUT, "--engine-scrape-concurrency", CONCURRENCY),
    )
    # The noisy tenant asks first: its first reads take the slots, and its own call waits for them.
    noisy = asyncio.ensure_future(outcome(keda_asks(gateway.port, "noisy", metric="vllm_queue", workload="batch")))
    await until(lambda: silent.requests >= 3, timeout=10)
    answers: list[float | str] = []

    async def ask() -> float | str:
        """Tenant ml's GetMetrics, as KEDA polls it; every answer is kept."""
        answers.append(await outcome(keda_asks(gateway.port, "ml", metric="vllm_queue", workload="llm")))
        return answers[-1]

    assert await ask() == 3.0
    healthy.values["waiting"] = 5
    await until_result(ask, lambda answer: answer != 3.0, timeout=15, poll=0.25)
    assert set(answers) == {3.0, 5.0}, answers  # never an error: no deadline missed, no page too old
    noisy_answer = await noisy
    assert isinstance(noisy_answer, str)
    assert noisy_answer.startswith("UNAVAILABLE: vllm_queue of pods in namespace noisy, workload batch is unknown")
    assert limited(gateway)["namespace_share"] >= 1


async def test_one_query_cannot_make_the_gateway_read_a_large_selection_often(
    engines: list[FakeEngine], start_gateway: StartGateway
) -> None:
    """scrapeInterval 250ms under the gateway's 1 s minimum, and a workload of 8 Ready pods past its cap of 5,
    are refused naming the key, the value and the flag; no page is read for either, and the refusal counts."""
    engine = await serve(engines, waiting=1)
    gateway = start_gateway(
        [pod("ml", f"llm-{index}", engine, "llm") for index in range(8)] + [pod("ml", "small-0", engine, "small")],
        ("--engine-max-pods-per-selection", "5"),
    )
    fast = await outcome(keda_asks(gateway.port, "ml", metric="vllm_queue", workload="small", scrapeInterval="250ms"))
    assert fast == (
        "INVALID_ARGUMENT: scrapeInterval '250ms' is out of range; it must be from 1s (this gateway's "
        "--engine-min-scrape-interval) to 1m"
    )
    large = await outcome(keda_asks(gateway.port, "ml", metric="vllm_queue", workload="llm"))
    assert large == (
        "INVALID_ARGUMENT: pods in namespace ml, workload llm selects 8 Ready pods with a metrics page; one query "
        "may read at most 5 (the gateway's --engine-max-pods-per-selection): select fewer pods with workload or "
        "podSelector, or raise the flag"
    )
    assert engine.requests == 0
    assert limited(gateway)["max_pods_per_selection"] >= 1
    assert await keda_asks(gateway.port, "ml", metric="vllm_queue", workload="small") == 1.0
