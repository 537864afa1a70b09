"""Engine scrapes in a real gateway beside the GPU load of many agents: what the scrapes cost, and whether they keep up.

Three runs of ``gpuscaler gateway`` over simulated agents (``bench.gateway``'s) and one page server (``bench.engines``'s
vLLM page) standing in for every pod of a static pod directory:

- agents only: N agents x 8 GPUs at 0.5 s, no engine query;
- agents and pods: the same, and a push stream on ``vllm_queue`` over P pods at 1 s, as KEDA holds one;
- pods only: one agent, and the same stream.

The gateway runs on core 0, the simulated agents and the page server on the other cores (``sched_setaffinity``),
so the gateway's own CPU is what is measured. The scrape CPU beside the load is (agents and pods - agents only) /
scrapes; the scrape's duration (the wait for a slot included) and the pages' age come from the gateway's /metrics.

``python -m bench.engines_under_load [--agents 2000] [--pods 200] [--page-kb 100] [--seconds 20]`` writes
``bench/results/engines_under_load.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from grpclib.client import Channel
from prometheus_client.parser import text_string_to_metric_families

from bench.common import cpu_seconds, print_table, write_result
from bench.engines import page_server
from bench.gateway import drain, gateway_ports, read_line, start_gateway, wait_for_nodes
from gpuscaler.generated import externalscaler as keda

GPUS = 8
AGENT_POLL_SECONDS = 0.5
WAITING_PER_POD = 3.0  # bench.engines' page says vllm:num_requests_waiting 3


@dataclass(frozen=True)
class Setting:
    """One run: how many simulated agents, and whether a push stream reads the pods' engines."""

    name: str
    agents: int
    engines: bool


def pin(pid: int, cores: set[int]) -> None:
    """Keep ``pid`` on ``cores`` where the machine has them (a one-core machine shares its core)."""
    available = os.sched_getaffinity(0)
    if cores & available and len(available) > 1:
        os.sched_setaffinity(pid, cores & available)


@contextlib.asynccontextmanager
async def simulated_agents(agents: int, others: set[int]) -> AsyncIterator[list[str]]:
    """``bench.gateway``'s simulated agents on ``others`` cores; yields their ports."""
    command = ["-m", "bench.gateway", "--simulate", "--agents", str(agents), "--gpus", str(GPUS)]
    command += ["--poll", str(AGENT_POLL_SECONDS)]
    simulator = await asyncio.create_subprocess_exec(
        sys.executable, *command, stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    pin(simulator.pid, others)
    try:
        assert simulator.stdout is not None
        yield (await read_line(simulator.stdout, "ports ")).split(",")
    finally:
        simulator.kill()
        await simulator.wait()


def pod_directory(folder: Path, pods: int, port: int) -> Path:
    """A static pod directory of ``pods`` Ready pods of Deployment llm in namespace bench, each serving its
    engine's page at 127.0.0.1:``port`` (one server stands in for them all; each pod is read on its own)."""
    path = folder / "pods.yaml"
    entries = [
        {
            "namespace": "bench",
            "pod": f"llm-{index:04d}",
            "labels": {"app": "llm"},
            "workload": "llm",
            "workloadKind": "Deployment",
            "ip": "127.0.0.1",
            "annotations": {"prometheus.io/port": str(port)},
        }
        for index in range(pods)
    ]
    path.write_text(yaml.safe_dump({"pods": entries}), encoding="utf-8")
    return path


def engine_ref() -> keda.ScaledObjectRef:
    """The ScaledObject of Deployment llm, scaling on its pods' vLLM queue."""
    metadata = {"metric": "vllm_queue", "workload": "llm", "targetValue": "8", "activationThreshold": "1"}
    return keda.ScaledObjectRef(name="llm", namespace="bench", scaler_metadata=metadata)


async def engine_value(stub: keda.ExternalScalerStub) -> float:
    """GetMetricSpec then GetMetrics, as KEDA asks, for ``engine_ref``."""
    spec = await stub.get_metric_spec(engine_ref())
    request = keda.GetMetricsRequest(scaled_object_ref=engine_ref(), metric_name=spec.metric_specs[0].metric_name)
    return float((await stub.get_metrics(request)).metric_values[0].metric_value_float)


async def wait_for_pods(stub: keda.ExternalScalerStub, pods: int) -> None:
    """Until every pod's queue is in the answer (up to 60 s)."""
    async with asyncio.timeout(60):
        while True:
            with contextlib.suppress(Exception):
                if await engine_value(stub) == WAITING_PER_POD * pods:
                    return
            await asyncio.sleep(0.2)


def scrape_series(metrics_port: int) -> dict[str, float]:
    """The gateway's scrape counters, duration histogram sums and snapshots received, and the oldest page's age,
    from /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as response:
        text = response.read().decode()
    found = dict.fromkeys(("ok", "failed", "duration_sum", "duration_count", "age_max", "snapshots"), 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "gpuscaler_gateway_agent_snapshots_total":
                found["snapshots"] += sample.value
            elif sample.name == "gpuscaler_gateway_engine_scrapes_total":
                found["ok" if sample.labels.get("outcome") == "ok" else "failed"] += sample.value
            elif sample.name == "gpuscaler_gateway_engine_scrape_duration_seconds_sum":
                found["duration_sum"] += sample.value
            elif sample.name == "gpuscaler_gateway_engine_scrape_duration_seconds_count":
                found["duration_count"] += sample.value
            elif sample.name == "gpuscaler_gateway_engine_page_age_seconds":
                found["age_max"] = max(found["age_max"], sample.value)
    return found


async def measure(setting: Setting, pods: int, page_port: int, folder: Path, seconds: float) -> dict[str, Any]:
    """One run of the gateway as ``setting`` says: its CPU, and the scrapes it made meanwhile."""
    others = set(range(1, os.cpu_count() or 1))
    async with simulated_agents(setting.agents, others) as ports:
        log_path = folder / f"gateway-{setting.name.replace(' ', '-')}.log"
        directory = pod_directory(folder, pods, page_port)
        gateway = start_gateway(ports, log_path, "--pod-directory", str(directory))
        pin(gateway.pid, {0})
        stream: asyncio.Task[None] | None = None
        try:
            port, metrics_port = await gateway_ports(log_path)
            channel = Channel("127.0.0.1", port)
            stub = keda.ExternalScalerStub(channel)
            await wait_for_nodes(stub, setting.agents * GPUS)
            if setting.engines:
                stream = asyncio.create_task(drain(stub.stream_is_active(engine_ref())))
                await wait_for_pods(stub, pods)
            await asyncio.sleep(3)  # let start-up settle
            before, cpu_before, started = scrape_series(metrics_port), cpu_seconds(gateway.pid), time.monotonic()
            ages = []
            while time.monotonic() - started < seconds:
                await asyncio.sleep(1)
                ages.append(scrape_series(metrics_port)["age_max"])
            after, cpu_used = scrape_series(metrics_port), cpu_seconds(gateway.pid) - cpu_before
            wall = time.monotonic() - started
            value = await engine_value(stub) if setting.engines else None
            channel.close()
        finally:
            if stream is not None:
                stream.cancel()
                await asyncio.gather(stream, return_exceptions=True)
            gateway.terminate()
            gateway.wait(20)
    scrapes = after["ok"] - before["ok"]
    durations = after["duration_count"] - before["duration_count"]
    return {
        "setting": setting.name,
        "agents": setting.agents,
        "snapshots_per_second": round(setting.agents / AGENT_POLL_SECONDS),
        # What the gateway counted in: the simulated agents share a core, and may send fewer than they should.
        "snapshots_received_per_second": round((after["snapshots"] - before["snapshots"]) / wall),
        "pods": pods if setting.engines else 0,
        "measured_seconds": round(wall, 1),
        "gateway_cpu_percent_of_one_core": round(100 * cpu_used / wall, 1),
        "gateway_cpu_seconds": round(cpu_used, 3),
        "scrapes_per_second": round(scrapes / wall, 1),
        "failed_scrapes": int(after["failed"] - before["failed"]),
        "scrape_mean_ms": round(1000 * (after["duration_sum"] - before["duration_sum"]) / durations, 2)
        if durations
        else None,
        "oldest_page_seconds_max": round(max(ages), 2) if ages and setting.engines else None,
        "value": value,
        "value_expected": WAITING_PER_POD * pods if setting.engines else None,
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    """The three settings, and the scrape's CPU derived from them."""
    settings = (
        Setting("agents only", args.agents, False),
        Setting("agents and pods", args.agents, True),
        Setting("pods only", 1, True),
    )
    runs = []
    with tempfile.TemporaryDirectory(prefix="gpuscaler-bench-") as name:
        folder = Path(name)
        with page_server(args.page_kb, folder) as page_port:
            for setting in settings:
                runs.append(await measure(setting, args.pods, page_port, folder, args.seconds))
    load, both, alone = runs
    scrapes_beside = both["scrapes_per_second"] * both["measured_seconds"]
    # The gateway's CPU beyond what the same agents cost it without the pods, over the scrapes it made.
    extra_cpu = (
        both["gateway_cpu_seconds"] - load["gateway_cpu_seconds"] * both["measured_seconds"] / load["measured_seconds"]
    )
    per_scrape_beside = extra_cpu / scrapes_beside if scrapes_beside else float("nan")
    return {
        "page_kb": args.page_kb,
        "cores": len(os.sched_getaffinity(0)),
        "runs": runs,
        "scrape_cpu_ms_beside_load": round(1000 * per_scrape_beside, 3),
        "pods_per_core_at_1s_beside_load": int(1 / per_scrape_beside) if per_scrape_beside > 0 else None,
        "scrape_cpu_ms_alone_upper_bound": round(
            1000 * alone["gateway_cpu_seconds"] / (alone["scrapes_per_second"] * alone["measured_seconds"]), 3
        ),
    }


def main(argv: list[str] | None = None) -> int:
    """Run the three settings, print them, write ``bench/results/engines_under_load.json``."""
    parser = argparse.ArgumentParser(prog="python -m bench.engines_under_load", description=__doc__.splitlines()[0])
    parser.add_argument("--agents", type=int, default=2000, help="simulated agents of 8 GPUs at 0.5 s (2000)")
    parser.add_argument("--pods", type=int, default=200, help="pods whose engines are read at 1 s (200)")
    parser.add_argument("--page-kb", type=int, default=100, help="size of each pod's metrics page (100)")
    parser.add_argument("--seconds", type=float, default=20.0, help="seconds measured per setting (20)")
    args = parser.parse_args(argv)
    result = asyncio.run(run(args))
    print_table(
        f"gpuscaler gateway on core 0: {args.pods} pods' {args.page_kb} kB pages at 1 s beside {args.agents} agents",
        ["setting", "snapshots/s received", "gateway CPU %", "scrapes/s", "failed", "scrape mean ms", "oldest page s"],
        [
            [
                r["setting"],
                f"{r['snapshots_received_per_second']} of {r['snapshots_per_second']}",
                r["gateway_cpu_percent_of_one_core"],
                r["scrapes_per_second"],
                r["failed_scrapes"],
                r["scrape_mean_ms"],
                r["oldest_page_seconds_max"],
            ]
            for r in result["runs"]
        ],
    )
    print(
        f"scrape CPU beside the load: {result['scrape_cpu_ms_beside_load']} ms "
        f"({result['pods_per_core_at_1s_beside_load']} pods per core at 1 s); alone, at most "
        f"{result['scrape_cpu_ms_alone_upper_bound']} ms (the whole gateway's CPU over its scrapes)"
    )
    path = write_result("engines_under_load", result)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
