"""Agents and clients for the benchmarks, from the e2e support code, with the options every bench takes."""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from bench.target import Target
from e2e.support.agent import AgentProcess
from e2e.support.clients import ActiveStream, GrpcioScaler, Metadata, RpcFailure
from e2e.support.keda_grpcio import KedaProto, generate


@dataclass(frozen=True, slots=True)
class Options:
    """What every benchmark takes from the command line: tries, durations, the server to measure, the grid."""

    tries: int = 20  # push latency and start-up samples
    seconds: float = 5.0  # per unary cell
    idle_seconds: float = 30.0  # per idle CPU measurement
    target: Target = field(default_factory=Target.ours)  # what unary, idle and startup measure
    streams: tuple[int, ...] = (0, 1_000, 10_000)  # open StreamIsActive streams, per unary row group
    callers: tuple[int, ...] = (1, 10, 50)  # concurrent GetMetrics callers, per unary row
    poll_intervals: tuple[float, ...] = (0.1, 0.5, 1.0)  # push latency rows


@dataclass
class Bench:
    """A scratch folder and the grpcio stubs, for one ``python -m bench`` run."""

    folder: Path
    proto: KedaProto

    @contextlib.asynccontextmanager
    async def agent(self, *flags: str, gpus: int = 8, poll_interval: float = 0.5) -> AsyncIterator[AgentProcess]:
        """A fresh agent process; SIGTERM at the end, which must exit 0."""
        agent = await asyncio.to_thread(
            AgentProcess.start, *flags, log_dir=self.folder / "logs", gpus=gpus, poll_interval=poll_interval
        )
        try:
            yield agent
        finally:
            agent.expect_errors = True  # a measurement is not a test; the exit code still must be 0
            await agent.terminate(timeout=60)

    @contextlib.asynccontextmanager
    async def client(self, agent: AgentProcess) -> AsyncIterator[GrpcioScaler]:
        """One grpcio channel, as KEDA keeps one connection per scaler address."""
        client = await GrpcioScaler.connect(agent, self.proto)
        try:
            yield client
        finally:
            await client.close()


@contextlib.contextmanager
def bench_folder() -> Iterator[Bench]:
    """A Bench in a scratch folder, with the grpcio stubs generated into it; the folder goes at the end."""
    with tempfile.TemporaryDirectory(prefix="gpuscaler-bench-") as folder:
        path = Path(folder)
        yield Bench(path, generate(path / "stubs"))


async def open_streams(client: GrpcioScaler, queries: list[Metadata]) -> list[ActiveStream]:
    """One stream per query, all on the client's channel; returns once each has its first message."""
    streams = start_streams(client, queries)
    await asyncio.gather(*(stream.next(timeout=600) for stream in streams))
    return streams


def start_streams(client: GrpcioScaler, queries: list[Metadata]) -> list[ActiveStream]:
    """One stream per query, all on the client's channel, without waiting for anything."""
    return [client.stream_is_active(query, name=f"app-{i}") for i, query in enumerate(queries)]


async def silent_streams(streams: list[ActiveStream], seconds: float) -> int:
    """Wait up to ``seconds`` for every stream's first message; how many sent none (or ended instead)."""

    async def first(stream: ActiveStream) -> bool:
        try:
            await stream.next(timeout=seconds)
        except (TimeoutError, RpcFailure):
            return False
        return True

    answered = await asyncio.gather(*(first(stream) for stream in streams))
    return answered.count(False)


async def close_streams(streams: list[ActiveStream]) -> None:
    """Close every stream at once."""
    await asyncio.gather(*(stream.close() for stream in streams))


def distinct_queries(count: int) -> list[Metadata]:
    """``count`` queries that share no evaluation: metric x aggregation x a subset of the 8 GPUs."""
    metrics = ["gpu_utilization", "memory_utilization", "memory_used_percent", "temperature", "power_draw"]
    metrics.append("power_percent")
    aggregations = ["sum", "max", "min", "avg", "median", "p90", "p95", "p99"]
    subsets = [",".join(str(g) for g in range(8) if mask >> g & 1) for mask in range(1, 256)]
    queries = [
        {"metric": metric, "aggregation": aggregation, "gpuIndex": subset, "activationThreshold": "99999"}
        for subset in subsets
        for metric in metrics
        for aggregation in aggregations
    ]
    if count > len(queries):
        raise ValueError(f"at most {len(queries)} distinct queries")
    return queries[:count]


SHARED_QUERY: Metadata = {"metric": "gpu_utilization", "activationThreshold": "50"}
