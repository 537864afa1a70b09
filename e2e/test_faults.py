"""Faults: one of eight GPUs failing the way NVML fails, healing, and health when no GPU can be read.

"I don't know" must reach KEDA as an error (it then retries and applies its fallback), never as a 0
that scales the workload in. Failures are injected with ``gpuscaler fake fail`` as a user would.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from e2e.conftest import StartAgent
from e2e.support.agent import NODE_NAME
from e2e.support.clients import RpcFailure, ScalerClient, connect, refusal
from e2e.support.control import Control, fake_cli_async
from e2e.support.keda_grpcio import KedaProto

POLL_SECONDS = 0.5
SLACK_SECONDS = 0.5
FAILED_GPU = 3
FAILED_UUID = f"GPU-fake-{NODE_NAME}-{FAILED_GPU}"


async def first_answer(client: ScalerClient, metadata: dict[str, str], timeout: float = 10.0) -> float:
    """Ask GetMetrics every 20 ms until it answers; the value."""
    async with asyncio.timeout(timeout):
        while True:
            try:
                return await client.metric_value(metadata)
            except RpcFailure:
                await asyncio.sleep(0.02)


@pytest.mark.parametrize(
    ("failure", "code"),
    [("lost", "UNAVAILABLE"), ("not_supported", "FAILED_PRECONDITION"), ("timeout", "UNAVAILABLE")],
)
async def test_one_failed_gpu_of_eight(start_agent: StartAgent, keda_proto: KedaProto, failure: str, code: str) -> None:
    """Queries over the other GPUs answer, those needing the failed one get its error, heal restores it quickly."""
    agent = await start_agent(poll_interval=POLL_SECONDS)
    client = await connect("grpcio", agent, keda_proto)
    try:
        async with Control(agent) as control:
            await control.set_and_wait(None, {"gpu_utilization": 40})
            exit_code, output = await fake_cli_async(agent, "fail", "--gpu", str(FAILED_GPU), "--error", failure)
            assert exit_code == 0, output
            await control.next_tick()

            others = ",".join(str(i) for i in range(8) if i != FAILED_GPU)
            assert await client.metric_value({"gpuIndex": others}) == 7 * 40
            # All GPUs: a GPU without the metric is outside it and left out; a lost or hung one is unknown, and
            # 1 of 8 is beyond the default maxUnreadable (5% of 8 is 0). Within maxUnreadable it is left out.
            if failure == "not_supported":
                assert await client.metric_value({}) == 7 * 40
            else:
                [spec] = await client.get_metric_spec({})
                refused = await refusal(client.get_metrics({}, spec.metric_name))
                assert refused.code == "UNAVAILABLE", refused
                assert "cannot be read on 1 of the 8 selected GPUs" in refused.message
                assert f"GPU {FAILED_GPU} ({FAILED_UUID})" in refused.message
            assert await client.metric_value({"maxUnreadable": "1"}) == 7 * 40
            assert await client.is_active({"gpuIndex": "7"}) is True

            for metadata in ({"gpuIndex": str(FAILED_GPU)}, {"gpuIndex": f"2,{FAILED_GPU}"}):
                [spec] = await client.get_metric_spec(metadata)
                for refused in (
                    await refusal(client.get_metrics(metadata, spec.metric_name)),
                    await refusal(client.is_active(metadata)),
                ):
                    assert refused.code == code, refused
                    assert f"GPU {FAILED_GPU} ({FAILED_UUID})" in refused.message
                    assert failure in refused.message

            # A stream over the failed GPU says nothing: unknown is neither active nor inactive.
            stream = client.stream_is_active({"gpuIndex": str(FAILED_GPU), "activationThreshold": "10"})
            await stream.no_message(2 * POLL_SECONDS)

            exit_code, output = await fake_cli_async(agent, "heal", "--gpu", str(FAILED_GPU))
            assert exit_code == 0, output
            healed = time.monotonic()
            assert await first_answer(client, {"gpuIndex": str(FAILED_GPU)}) == 40
            assert time.monotonic() - healed <= 2 * POLL_SECONDS + SLACK_SECONDS
            assert await stream.next(timeout=5) is True
            await stream.close()
    finally:
        await client.close()


async def test_health_is_not_serving_while_no_gpu_can_be_read(start_agent: StartAgent, keda_proto: KedaProto) -> None:
    """Every GPU hung: health NOT_SERVING and queries UNAVAILABLE naming the GPUs; healed: SERVING and answers."""
    agent = await start_agent(poll_interval=0.2)
    client = await connect("grpcio", agent, keda_proto)
    try:
        async with Control(agent) as control:
            for gpu in range(8):
                await control.fail(gpu, "timeout")
            await asyncio.to_thread(agent.wait_health, "NOT_SERVING", 10.0)
            with pytest.raises(RpcFailure) as raised:
                await client.metric_value({})
            assert raised.value.code == "UNAVAILABLE"
            assert all(f"GPU {gpu} (" in raised.value.message for gpu in range(8))

            await control.heal(None)
            await asyncio.to_thread(agent.wait_health, "SERVING", 10.0)
            assert await first_answer(client, {}) == 0
    finally:
        await client.close()
