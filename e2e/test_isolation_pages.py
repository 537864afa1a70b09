"""A page costs bounded work (issue 31, rows 1, 3 and 7): a gateway process, pods from a static directory, hostile
engine pages from ``e2e.support.engine_pods`` in a process of their own, and another tenant's good pod beside them.

Row 1: a page with more label sets of a wanted series than ``--engine-max-label-sets`` (default 8192) is refused,
named and counted, never parsed or believed. Row 3: pages without end are refused at ``--engine-max-page-bytes``,
and the gateway's memory comes back when they are gone. Row 7: two label sets of 1.7e308 are past the signal's
bound in each label set, and two of a counter (which has no such bound) sum to infinity: either way the pod is
named, and GetMetrics answers UNAVAILABLE, never UNKNOWN.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from grpclib import GRPCError

from e2e.support.engine_gateway import EngineGateways, StartGateway, counts_by, get_metrics
from e2e.support.engine_pods import engine_pods, pod_entries
from e2e.support.process import Process
from tests.waiting import until, until_result

GOOD = {"metric": "vllm_queue", "workload": "llm"}
HOSTILE = {"metric": "vllm_queue", "workload": "evil"}
PODS = 80  # row 3's count: with fewer, the memory the old reader kept came back too


@pytest.fixture
async def start_gateway(tmp_path: Path) -> AsyncIterator[StartGateway]:
    """Starts ``gpuscaler gateway`` processes over a pod directory and no agent, and stops them."""
    gateways = EngineGateways(tmp_path)
    yield gateways.start
    await gateways.stop()


async def ask(port: int, namespace: str, metadata: dict[str, str]) -> float | str:
    """GetMetricSpec then GetMetrics for ScaledObject ``namespace``/so: the value, or the status and message."""
    try:
        return await get_metrics(port, namespace, metadata)
    except GRPCError as error:
        return f"{error.status.name}: {error.message}"


def scrapes(gateway: Process) -> dict[str, float]:
    """gpuscaler_gateway_engine_scrapes_total by outcome, from the gateway's /metrics."""
    return counts_by(gateway, "gpuscaler_gateway_engine_scrapes_total", "outcome")


def rss_mib(gateway: Process) -> float:
    """The gateway's resident memory now, MiB."""
    assert gateway.process is not None
    for line in Path(f"/proc/{gateway.process.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


async def first_read(port: int, namespace: str, metadata: dict[str, str]) -> float | str:
    """The first answer from a read of the pods (until their first read lands, the gateway says 'not read yet')."""
    return await until_result(
        lambda: ask(port, namespace, metadata), lambda a: "not read yet" not in str(a), timeout=20, poll=0.25
    )


async def good_answer(port: int) -> float | str:
    """The other tenant's answer, once its pod has been read: its queue, 3."""
    return await until_result(lambda: ask(port, "ml", GOOD), lambda a: a == 3.0, timeout=20, poll=0.25)


async def test_a_page_of_more_label_sets_than_the_limit_is_refused_naming_the_pod(start_gateway: StartGateway) -> None:
    """A Ready pod's page of 10,000 label sets of vllm:num_requests_waiting, past the default 8,192, is refused:
    its query is UNAVAILABLE naming the pod, the series and the limit, the read counts as too_many_label_sets,
    and the other tenant's pod is answered as it reads."""
    async with (
        engine_pods("label-sets", 1, "--label-sets", "10000") as (hostile, _),
        engine_pods("good", 1) as (
            good,
            _,
        ),
    ):
        gateway = start_gateway([*pod_entries("evil", "evil", hostile), *pod_entries("ml", "llm", good)], ())
        assert await first_read(gateway.port, "evil", HOSTILE) == (
            "UNAVAILABLE: vllm_queue of pods in namespace evil, workload evil is unknown: 1 of the Ready pods cannot "
            f"be read (pod evil/evil-0000: http://127.0.0.1:{hostile[0]}/metrics: more than 8192 label sets of "
            "vllm:num_requests_waiting, over the 8192 allowed); an unread pod never counts as 0"
        )
        assert scrapes(gateway)["too_many_label_sets"] >= 1
        assert await good_answer(gateway.port) == 3.0


async def test_label_sets_past_their_bound_are_unavailable_naming_the_pod_never_unknown(
    start_gateway: StartGateway,
) -> None:
    """Two label sets of 1.7e308 (whose sum is infinite), each past the queue's bound for one label set, make
    GetMetrics UNAVAILABLE naming the pod and the bound, on every call; never UNKNOWN, never a value."""
    async with engine_pods("infinite", 1) as (hostile, _):
        gateway = start_gateway(pod_entries("evil", "evil", hostile), ())
        expected = (
            "UNAVAILABLE: vllm_queue of pods in namespace evil, workload evil is unknown: 1 of the Ready pods cannot "
            f"be read (pod evil/evil-0000: http://127.0.0.1:{hostile[0]}/metrics: vllm:num_requests_waiting is "
            "1.7e+308, past the 1e+06 one label set can honestly read (docs/engines.md)); an unread pod never counts "
            "as 0"
        )
        assert await first_read(gateway.port, "evil", HOSTILE) == expected
        for _ in range(3):
            assert await ask(gateway.port, "evil", HOSTILE) == expected
        assert scrapes(gateway)["malformed"] >= 1


async def test_a_counter_summing_past_any_number_is_unavailable_naming_the_pod_never_unknown(
    start_gateway: StartGateway,
) -> None:
    """A Triton counter of 1.7e308 in each of two models, with no bound per label set, sums to infinity: GetMetrics
    is UNAVAILABLE naming the pod and the sum, on every call; never UNKNOWN, never a value."""
    async with engine_pods("infinite-sum", 1) as (hostile, _):
        gateway = start_gateway(pod_entries("evil", "evil", hostile), ())
        metadata = {"metric": "triton_request_rate", "workload": "evil"}
        expected = (
            "UNAVAILABLE: triton_request_rate of pods in namespace evil, workload evil is unknown: 1 of the Ready pods "
            f"cannot be read (pod evil/evil-0000: http://127.0.0.1:{hostile[0]}/metrics: nv_inference_request_success "
            "sums to inf over its label sets, which no engine reports); an unread pod never counts as 0"
        )
        assert await first_read(gateway.port, "evil", metadata) == expected
        for _ in range(3):
            assert await ask(gateway.port, "evil", metadata) == expected
        assert scrapes(gateway)["malformed"] >= 1


async def test_endless_pages_are_refused_at_the_limit_and_their_memory_comes_back(
    start_gateway: StartGateway,
) -> None:
    """80 Ready pods whose pages never end are each refused past --engine-max-page-bytes (4 MiB), named as too
    large; the other tenant is answered throughout, and once the pods are gone the gateway's memory returns within
    50 MiB of what it was before them."""
    async with engine_pods("good", 1) as (good, _):
        async with engine_pods("endless", PODS) as (hostile, _):
            gateway = start_gateway([*pod_entries("evil", "evil", hostile), *pod_entries("ml", "llm", good)], ())
            assert await good_answer(gateway.port) == 3.0
            before = rss_mib(gateway)
            answer = await first_read(gateway.port, "evil", HOSTILE)
            assert f"a page over the {4 * 1024 * 1024} bytes allowed" in str(answer)
            await until(lambda: scrapes(gateway).get("too_large", 0) >= 2 * PODS, timeout=30, poll=0.25)
            assert await ask(gateway.port, "ml", GOOD) == 3.0
        # The pods are gone: their reads fail at connect, and what reading them took is given back.
        await until(lambda: rss_mib(gateway) - before <= 50, timeout=15, poll=0.5)
        assert await ask(gateway.port, "ml", GOOD) == 3.0
