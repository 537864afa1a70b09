"""Push from zero, in-process on loopback: a request queued at a fake EPP -> ``true`` at a StreamIsActive client.

    .venv/bin/python -m bench.epp_wake                  # 20 tries at scrapeInterval 1 s (the default and the floor)
    .venv/bin/python -m bench.epp_wake --interval 0.25 --tries 40

One agent (fake GPUs) and one gateway in this process, a fake EPP (llm-d's page) as the pod directory's only pod,
and a grpclib client's StreamIsActive on ``profile: epp-wake``. Each try waits for ``false``, waits a random part
of the scrape interval (so that the queue changes anywhere between two scrapes), sets the EPP's queue to 1 and
times from that to the arrival of ``true``, then empties it and waits for ``false``. The wait for the next scrape is
most of it: expect about half an interval on average and up to one, plus the read and the wire. Reported in ms and
in scrape intervals, with the load average. Writes bench/results/epp_wake.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import tempfile
import time
from pathlib import Path
from typing import Any

from grpclib.client import Channel

from bench.common import print_table, summary_ms
from gpuscaler.agent.collectors.fake import FakeCollector
from gpuscaler.agent.process import Agent
from gpuscaler.gateway.process import Gateway
from gpuscaler.generated import externalscaler as keda
from gpuscaler.model.engines import Engine
from tests.conftest import serve_settings
from tests.fakes.fake_engine import FakeEngine
from tests.fakes.fake_kubelet import FakeKubelet, short_socket_path
from tests.gateway.conftest import gateway_settings
from tests.gateway.test_engine_signals import write_pods
from tests.gateway.test_epp_wake_push import POOL

RESULTS = Path(__file__).parent / "results" / "epp_wake.json"


async def measure(interval: float, tries: int) -> list[float]:
    """``tries`` latencies in seconds from the queue's change to the pushed ``true``."""
    epp = await FakeEngine(Engine.EPP, {"waiting": 0, "running": 0, "kv": 0.0}).start()
    kubelet = await FakeKubelet(short_socket_path()).start()
    agent = await Agent.start(
        serve_settings(
            "--fake-gpus", "1", "--pod-resources-socket", str(kubelet.socket_path), "--listen", "127.0.0.1:0"
        ),
        FakeCollector(node="node-a", gpu_count=1),
    )
    with tempfile.TemporaryDirectory() as folder:
        pods = write_pods(Path(folder) / "pods.yaml", ("epp-a", epp, {}))
        gateway = await Gateway.start(
            gateway_settings(
                "--agents",
                f"127.0.0.1:{agent.port}",
                "--pod-directory",
                str(pods),
                "--engine-min-scrape-interval",
                f"{interval}s",
            )
        )
        channel = Channel("127.0.0.1", gateway.port)
        metadata = {"profile": "epp-wake", "inferencePool": POOL, "workload": "llm", "scrapeInterval": f"{interval}s"}
        received: asyncio.Queue[tuple[float, bool]] = asyncio.Queue()

        async def read() -> None:
            stream = keda.ExternalScalerStub(channel).stream_is_active(
                keda.ScaledObjectRef(name="so", namespace="ml", scaler_metadata=metadata)
            )
            async for message in stream:
                received.put_nowait((time.monotonic(), message.result))

        reader = asyncio.create_task(read())
        samples = []
        try:
            assert (await asyncio.wait_for(received.get(), 10))[1] is False
            for _ in range(tries):
                await asyncio.sleep(random.uniform(0, interval))
                started = time.monotonic()
                epp.values["waiting"] = 1
                at, active = await asyncio.wait_for(received.get(), 10)
                assert active is True
                samples.append(at - started)
                epp.values["waiting"] = 0
                assert (await asyncio.wait_for(received.get(), 10))[1] is False
        finally:
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)
            channel.close()
            await gateway.stop()
            await agent.stop()
            await kubelet.stop()
            await epp.stop()
    return samples


def main() -> None:
    """Measure, print the table and write the result file."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--interval", type=float, default=1.0, help="scrapeInterval, seconds (1)")
    parser.add_argument("--tries", type=int, default=20)
    args = parser.parse_args()
    load_before = os.getloadavg()
    samples = asyncio.run(measure(args.interval, args.tries))
    summary = summary_ms(samples)
    in_intervals = sorted(s / args.interval for s in samples)
    result: dict[str, Any] = {
        "benchmark": "push from zero: a request queued at a fake EPP -> true at a StreamIsActive client, in-process",
        "settings": {"scrapeInterval_seconds": args.interval, "profile": "epp-wake", "tries": args.tries},
        "load_average_1m_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
        "cpus": os.cpu_count(),
        **summary,
        "median_intervals": round(in_intervals[len(in_intervals) // 2], 3),
        "max_intervals": round(in_intervals[-1], 3),
    }
    RESULTS.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print_table(
        "Push from zero: queued -> true",
        ["scrapeInterval", "tries", "median ms", "p99 ms", "max ms", "median intervals", "max intervals", "load 1m"],
        [
            (
                f"{args.interval:g} s",
                summary["n"],
                summary["median_ms"],
                summary["p99_ms"],
                summary["max_ms"],
                result["median_intervals"],
                result["max_intervals"],
                result["load_average_1m_before_after"],
            )
        ],
    )


if __name__ == "__main__":
    main()
