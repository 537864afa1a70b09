"""The gateway under simulated agents (100 x 8 GPUs unless told): push latency through it, its CPU and memory.

    .venv/bin/python -m bench.gateway [--agents 100] [--gpus 8] [--poll 0.5] [--seconds 60] [--tries 20]
    .venv/bin/python -m bench.gateway --receive-only [--agents 2000] [--seconds 30]

One child process simulates every agent: one grpclib server per agent on its own loopback port, each
serving the real ``gpuscaler.v1.Agent`` service over its own ring buffer, fed by one shared ticker with
synthetic samples (no collector threads, so the simulator's cost stays out of the gateway's numbers).
The gateway is the real ``gpuscaler gateway`` process. CPU is read from /proc (utime + stime) over the
measured span, memory is VmRSS at its end. Push latency: the bench asks the simulator to raise node 0's
utilisation and times the StreamIsActive ``true`` at the gateway, both from the request (what a user
sees: up to one agent poll of waiting) and from the start of the agent tick that carried the change.
Writes bench/results/gateway.json and prints it. ``--receive-only`` runs, instead of the gateway, a process
that only receives and parses the snapshots: the transport's floor (bench/results/gateway-receive-only.json).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import struct
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from grpclib.client import Channel
from grpclib.const import Cardinality, Handler, Status
from grpclib.encoding.proto import ProtoCodec
from grpclib.exceptions import GRPCError
from grpclib.server import Server
from prometheus_client.parser import text_string_to_metric_families

from gpuscaler.generated import externalscaler as keda
from gpuscaler.generated.gpuscaler import v1 as pb
from gpuscaler.generated.pb2.gpuscaler.v1 import agent_pb2
from gpuscaler.model.gpu_metrics import Metric
from gpuscaler.model.samples import ATTRIBUTION_OFF, GpuIdentity, GpuSample, Snapshot
from gpuscaler.model.windows import Windowed, WindowKey, WindowValues
from gpuscaler.server.wire import snapshot_to_wire, window_key_from_wire

CONSOLE_SCRIPT = Path(sys.executable).with_name("gpuscaler")
WATCH = "/gpuscaler.v1.Agent/WatchSnapshots"
RESULTS = Path(__file__).with_name("results") / "gateway.json"
RECEIVE_ONLY_RESULTS = RESULTS.with_name("gateway-receive-only.json")
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


# The simulator (child process)


class Encoded:
    """A message already in its wire form: grpclib's codec sends ``SerializeToString()`` as it is."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    def SerializeToString(self) -> bytes:
        return self.data


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


class SimulatedAgent:
    """One agent's WatchSnapshots stream, from bytes encoded once: each tick appends only its sequence and time.

    Protobuf merges repeated encodings of a message, so the static part (node, GPUs, attribution) is encoded
    when the node's values change and the tick's fields (2: sequence, 3: taken_at) are appended to it.
    """

    def __init__(self, node: str, gpus: int, poll: float) -> None:
        self.node = node
        self.identities = [GpuIdentity(i, f"GPU-sim-{node[4:]}-{i}", "Simulated GPU") for i in range(gpus)]
        self.poll = poll
        self.sequence = 0
        self.tick = asyncio.Event()
        self.static = b""
        self.set_utilization(30.0)

    def set_utilization(self, util: float) -> None:
        self.utilization = util
        self.windowed: dict[tuple[WindowKey, ...], bytes] = {}
        samples = [
            GpuSample(
                gpu=gpu,
                node=self.node,
                gpu_utilization_percent=util,
                memory_utilization_percent=10.0,
                memory_used_bytes=10 * 2**30,
                memory_total_bytes=80 * 2**30,
                temperature_celsius=50.0,
                power_draw_watts=300.0,
                power_limit_watts=700.0,
                energy_joules=5e6,  # read, as on every GPU since Volta (steady: the values are today's)
            )
            for gpu in self.identities
        ]
        self.snapshot = Snapshot(0, 0.0, 0.0, self.node, tuple(samples), attribution=ATTRIBUTION_OFF)
        self.static = bytes(snapshot_to_wire(self.snapshot, poll_interval_seconds=self.poll))

    def message(self, windows: tuple[WindowKey, ...] = ()) -> Encoded:
        tick = self.static + b"\x10" + _varint(self.sequence) + b"\x19" + struct.pack("<d", time.time())
        return Encoded(tick + self._windows(windows) if windows else tick)

    def _windows(self, windows: tuple[WindowKey, ...]) -> bytes:
        """The windows a gateway asked for, encoded as an agent encodes them: the simulated load is steady, so
        each window's value is today's."""
        encoded = self.windowed.get(windows)
        if encoded is None:
            today = {Metric.GPU_UTILIZATION: self.utilization, Metric.TEMPERATURE: 50.0, Metric.POWER_DRAW: 300.0}
            reduced = {
                key: WindowValues(
                    {
                        gpu.uuid: Windowed(today.get(key.metric, 10.0), int(key.seconds / self.poll))
                        for gpu in self.identities
                    }
                )
                for key in windows
            }
            message = snapshot_to_wire(self.snapshot, poll_interval_seconds=self.poll, windows=reduced)
            encoded = self.windowed[windows] = bytes(pb.Snapshot(windows=message.windows))
        return encoded

    def __mapping__(self) -> dict[str, Handler]:
        return {WATCH: Handler(self.watch, Cardinality.UNARY_STREAM, pb.WatchSnapshotsRequest, Encoded)}

    async def watch(self, stream: Any) -> None:
        request = await stream.recv_message()
        windows = tuple(window_key_from_wire(w) for w in request.windows)
        while True:
            await self.tick.wait()
            await stream.send_message(self.message(windows))


class RawCodec(ProtoCodec):
    """grpclib's protobuf codec, for our pre-encoded replies too."""

    def encode(self, message: Any, message_type: Any) -> bytes:
        return message.data if isinstance(message, Encoded) else super().encode(message, message_type)


async def simulate(agents: int, gpus: int, poll: float) -> None:
    """Serve ``agents`` fake agents; print their ports, then 'tick <monotonic>' for each tick that carried a change.

    Each agent ticks every ``poll`` seconds at its own phase, as real agents do, not all at once.
    """
    simulated = [SimulatedAgent(f"sim-{n:04d}", gpus, poll) for n in range(agents)]
    servers = []
    for agent in simulated:
        server = Server([agent], codec=RawCodec())
        await server.start("127.0.0.1", 0)
        servers.append(server)
    ports = [server._server.sockets[0].getsockname()[1] for server in servers]  # type: ignore[union-attr]
    print("ports " + ",".join(map(str, ports)), flush=True)

    changed: list[float] = []
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)

    async def commands() -> None:
        while line := await reader.readline():
            simulated[0].set_utilization(float(line.decode().strip()))
            changed.append(0.0)

    command_task = asyncio.create_task(commands())  # runs until the bench kills this process
    assert command_task is not None
    start = loop.time()
    slots = max(1, int(poll / 0.005))  # agents tick in 5 ms slots spread over the interval
    slot = 0
    while True:
        now = loop.time()
        for n in range(slot, agents, slots):
            agent = simulated[n]
            agent.sequence += 1
            event, agent.tick = agent.tick, asyncio.Event()
            event.set()
            if n == 0 and changed:
                changed.clear()
                print(f"tick {time.monotonic():.6f}", flush=True)
        slot = (slot + 1) % slots
        target = start + (int((now - start) / 0.005) + 1) * 0.005
        await asyncio.sleep(max(0.0, target - loop.time()))


async def receive_only(ports: list[str]) -> None:
    """Subscribe to every simulated agent as the gateway does, receive and parse each snapshot, and do nothing else.

    Its CPU per snapshot is the floor under any gateway on this transport (grpclib over h2, the protobuf C
    runtime): what a snapshot costs before the gateway has looked at it. Prints 'receiving' once every stream
    has delivered a snapshot.
    """
    first: list[asyncio.Future[None]] = [asyncio.get_running_loop().create_future() for _ in ports]

    async def one(port: str, delivered: asyncio.Future[None]) -> None:
        channel = Channel("127.0.0.1", int(port))
        async with channel.request(
            WATCH, Cardinality.UNARY_STREAM, agent_pb2.WatchSnapshotsRequest, agent_pb2.Snapshot
        ) as stream:
            await stream.send_message(agent_pb2.WatchSnapshotsRequest(), end=True)
            while await stream.recv_message() is not None:
                if not delivered.done():
                    delivered.set_result(None)

    tasks = [asyncio.create_task(one(port, delivered)) for port, delivered in zip(ports, first, strict=True)]
    await asyncio.gather(*first)
    print("receiving", flush=True)
    await asyncio.gather(*tasks)


# The bench (parent process)


def cpu_seconds(pid: int) -> float:
    """User plus system CPU seconds process ``pid`` has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def rss_mib(pid: int) -> float:
    """Process ``pid``'s resident memory now (VmRSS), MiB; NaN when /proc does not say."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def read_line(stream: asyncio.StreamReader, prefix: str) -> str:
    """The rest of the simulator's next output line that starts with ``prefix``; RuntimeError if it has ended."""
    while True:
        line = (await stream.readline()).decode()
        if not line:
            raise RuntimeError("the simulator ended")
        if line.startswith(prefix):
            return line[len(prefix) :].strip()


async def run_receive_only(args: argparse.Namespace) -> dict[str, object]:
    """The transport's floor: the CPU a process that only receives the simulated agents' snapshots uses."""
    simulator = await asyncio.create_subprocess_exec(
        *simulator_command(args), stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    assert simulator.stdout is not None
    ports = await read_line(simulator.stdout, "ports ")
    receiver = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "bench.gateway", "--receive-only-from", ports, stdout=subprocess.PIPE
    )
    try:
        assert receiver.stdout is not None
        async with asyncio.timeout(120):
            await read_line(receiver.stdout, "receiving")
        await asyncio.sleep(3)  # let start-up settle
        cpu_before, wall_before = cpu_seconds(receiver.pid), time.monotonic()
        await asyncio.sleep(args.seconds)
        cpu_used, wall = cpu_seconds(receiver.pid) - cpu_before, time.monotonic() - wall_before
        rss = rss_mib(receiver.pid)
    finally:
        receiver.kill()
        await receiver.wait()
        simulator.kill()
        await simulator.wait()
    return {
        "benchmark": "receive only: one grpclib client streams every simulated agent's snapshots, parses each "
        "(protobuf C runtime) and does nothing else; the floor under a gateway on this transport",
        "agents": args.agents,
        "gpus_per_agent": args.gpus,
        "agent_poll_seconds": args.poll,
        "measured_seconds": round(wall, 1),
        "receiver_cpu_percent_of_one_core": round(100 * cpu_used / wall, 1),
        "receiver_rss_mib": round(rss, 1),
        "snapshots_per_second": round(args.agents / args.poll),
        "receiver_cpu_us_per_snapshot": round(1e6 * cpu_used / wall / (args.agents / args.poll), 1),
        "machine": f"{os.cpu_count()} cores",
    }


def simulator_command(args: argparse.Namespace) -> list[str]:
    """This module as the simulated agents."""
    return [
        sys.executable,
        "-m",
        "bench.gateway",
        "--simulate",
        "--agents",
        str(args.agents),
        "--gpus",
        str(args.gpus),
        "--poll",
        str(args.poll),
    ]


async def run(args: argparse.Namespace) -> dict[str, object]:
    """Start the simulated agents and a real gateway over them; measure its CPU, memory, answers and push latency."""
    simulator = await asyncio.create_subprocess_exec(
        *simulator_command(args), stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    assert simulator.stdout is not None
    assert simulator.stdin is not None
    ports = (await read_line(simulator.stdout, "ports ")).split(",")
    log_path = Path(tempfile.mkdtemp(prefix="gpuscaler-bench-")) / "gateway.log"
    gateway = start_gateway(ports, log_path)
    try:
        port, metrics_port = await gateway_ports(log_path)
        channel = Channel("127.0.0.1", port)
        stub = keda.ExternalScalerStub(channel)
        await wait_for_nodes(stub, args.agents * args.gpus)

        # Some open push streams, as KEDA would hold them while we measure: node-wide, and windowed (the agents
        # reduce the window, the gateway sums).
        streams = [
            asyncio.create_task(
                drain(
                    stub.stream_is_active(ref(activationThreshold=str(10 + i), **({"window": "30s"} if i % 2 else {})))
                )
            )
            for i in range(10)
        ]
        # ...and the stream the push latency is timed on, so that the CPU measured includes its query.
        streams.append(asyncio.create_task(drain(stub.stream_is_active(ref(**PUSH_SELECTOR)))))
        await asyncio.sleep(3)  # let start-up settle
        total = await node_wide_sum(stub)
        # A window no query asked for yet: every agent is asked for it, and the answer waits for all of them.
        asked = time.monotonic()
        windowed_total = await until_answered(lambda: node_wide_sum(stub, window="30s", windowFunction="max"))
        new_window_seconds = time.monotonic() - asked
        expected = 30.0 * args.agents * args.gpus
        cpu_before, wall_before = cpu_seconds(gateway.pid), time.monotonic()
        simulator_before = cpu_seconds(simulator.pid)
        await asyncio.sleep(args.seconds)
        cpu_used, wall = cpu_seconds(gateway.pid) - cpu_before, time.monotonic() - wall_before
        simulator_used = cpu_seconds(simulator.pid) - simulator_before
        rss = rss_mib(gateway.pid)

        from_request, from_tick = await push_latency(stub, simulator.stdin, simulator.stdout, args.tries)
        collections = await asyncio.to_thread(gc_pauses, metrics_port)
        for task in streams:
            task.cancel()
        await asyncio.gather(*streams, return_exceptions=True)
        channel.close()
    finally:
        gateway.terminate()
        gateway.wait(20)
        simulator.kill()
        await simulator.wait()
    return {
        "agents": args.agents,
        "gpus_per_agent": args.gpus,
        "agent_poll_seconds": args.poll,
        "measured_seconds": round(wall, 1),
        "gateway_cpu_seconds_per_minute": round(60 * cpu_used / wall, 2),
        "gateway_cpu_percent_of_one_core": round(100 * cpu_used / wall, 1),
        "gateway_rss_mib": round(rss, 1),
        # The cost model's unit: every agent sends a snapshot per poll, and each costs the gateway this much.
        "snapshots_per_second": round(args.agents / args.poll),
        "gateway_cpu_us_per_snapshot": round(1e6 * cpu_used / wall / (args.agents / args.poll), 1),
        # The simulated agents share the machine: how busy they kept the other core.
        "simulator_cpu_percent_of_one_core": round(100 * simulator_used / wall, 1),
        "push_tries": args.tries,
        "push_from_request_ms": summary(from_request),
        "push_from_agent_tick_ms": summary(from_tick),
        "push_bound_ms": round(1000 * args.poll + 100),
        "new_window_answer_seconds": round(new_window_seconds, 2),
        "node_wide_sum": total,
        "node_wide_sum_expected": expected,
        "windowed_sum": windowed_total,
        # Every collection since the gateway started (start-up and the new window's stream reopening included).
        "gateway_gc_pauses": collections,
        "machine": f"{os.cpu_count()} cores",
    }


def start_gateway(ports: list[str], log_path: Path, *flags: str) -> subprocess.Popen[bytes]:
    """``gpuscaler gateway`` over the simulated agents on ``ports``, with ``flags``, on ephemeral loopback ports
    (``gateway_ports`` reads them from its JSON log at ``log_path``); only the flags given count."""
    with log_path.open("wb") as log:
        return subprocess.Popen(
            [
                str(CONSOLE_SCRIPT),
                "gateway",
                "--listen",
                "127.0.0.1:0",
                "--metrics-listen",
                "127.0.0.1:0",
                "--agents",
                ",".join(f"127.0.0.1:{port}" for port in ports),
                *flags,
                "--log-format",
                "json",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={k: v for k, v in os.environ.items() if not k.startswith("GPUSCALER_")},
        )


def ref(**metadata: str) -> keda.ScaledObjectRef:
    """The ScaledObject every bench query comes from, with ``metadata`` as its trigger's."""
    return keda.ScaledObjectRef(name="bench", namespace="bench", scaler_metadata=metadata)


async def drain(stream: object) -> None:
    """Read a push stream until it ends, as KEDA holds one open, ignoring what it says."""
    async for _ in stream:  # type: ignore[attr-defined]
        pass


async def gateway_ports(log_path: Path) -> tuple[int, int]:
    """The gRPC and /metrics ports the gateway logged when it started (both on port 0), within 30 s."""
    async with asyncio.timeout(30):
        while True:
            for line in log_path.read_text().splitlines():  # noqa: ASYNC240 - a small local log
                if '"gateway_started"' in line:
                    started = json.loads(line)
                    return int(started["port"]), int(started["metrics_port"])
            await asyncio.sleep(0.05)


def gc_pauses(metrics_port: int) -> dict[str, object]:
    """The gateway's garbage collections so far, from its ``gpuscaler_gc_pause_seconds`` histogram: each one
    stops its event loop, and a full one (generation 2) walks every object it holds."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as response:
        text = response.read().decode()
    buckets: dict[str, list[tuple[float, float]]] = {}
    sums: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name != "gpuscaler_gc_pause_seconds":
            continue
        for sample in family.samples:
            generation = sample.labels["generation"]
            if sample.name.endswith("_bucket"):
                buckets.setdefault(generation, []).append((float(sample.labels["le"]), sample.value))
            elif sample.name.endswith("_sum"):
                sums[generation] = sample.value
    result: dict[str, object] = {}
    for generation, cumulative in sorted(buckets.items()):
        cumulative.sort()
        count = cumulative[-1][1]
        over = count - next(c for bound, c in cumulative if bound >= 0.1)
        longest = next((bound for bound, c in cumulative if c == count), 0.0) if count else 0.0
        result[f"generation_{generation}"] = {
            "collections": int(count),
            "seconds": round(sums.get(generation, 0.0), 3),
            "over_100ms": int(over),
            "longest_at_most_seconds": longest,
        }
    return result


async def wait_for_nodes(stub: keda.ExternalScalerStub, gpus: int) -> None:
    """Wait (up to 60 s) until the gateway's summed temperature counts all ``gpus`` simulated GPUs (50 °C each)."""
    async with asyncio.timeout(60):
        while True:
            try:
                spec = await stub.get_metric_spec(ref(aggregation="sum", metric="temperature"))
                request = keda.GetMetricsRequest(scaled_object_ref=ref(aggregation="sum", metric="temperature"))
                request.metric_name = spec.metric_specs[0].metric_name
                value = (await stub.get_metrics(request)).metric_values[0].metric_value_float
                if value >= 50.0 * gpus - 1e-6:
                    return
            except Exception:
                pass
            await asyncio.sleep(0.2)


async def until_answered(ask: Callable[[], Awaitable[float]], *, seconds: float = 60.0) -> float:
    """``ask()``'s answer, asking again every 0.5 s while it is UNAVAILABLE (as KEDA's next poll would)."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            return await ask()
        except GRPCError as error:
            if error.status is not Status.UNAVAILABLE or time.monotonic() > deadline:
                raise
        await asyncio.sleep(0.5)


async def node_wide_sum(stub: keda.ExternalScalerStub, **window: str) -> float:
    """gpu_utilization summed over every GPU, as KEDA would ask for it."""
    query = ref(metric="gpu_utilization", **window)
    spec = await stub.get_metric_spec(query)
    request = keda.GetMetricsRequest(scaled_object_ref=query, metric_name=spec.metric_specs[0].metric_name)
    return float((await stub.get_metrics(request)).metric_values[0].metric_value_float)


# The push stream: one GPU of node 0, named as a user names it (the gateway finds it among all the nodes').
PUSH_SELECTOR = {"gpuUUID": "GPU-sim-0000-0", "activationThreshold": "50"}


async def push_latency(
    stub: keda.ExternalScalerStub, stdin: asyncio.StreamWriter, stdout: asyncio.StreamReader, tries: int
) -> tuple[list[float], list[float]]:
    """Node 0 alone crosses the threshold: time its true at the gateway from the request and from its tick."""
    selector = PUSH_SELECTOR
    queue: asyncio.Queue[tuple[float, bool]] = asyncio.Queue()

    async def listen() -> None:
        async for message in stub.stream_is_active(ref(**selector)):
            queue.put_nowait((time.monotonic(), message.result))

    listener = asyncio.create_task(listen())
    from_request: list[float] = []
    from_tick: list[float] = []
    try:
        await queue.get()  # the state at open
        for _ in range(tries):
            for value, expected in ((90.0, True), (0.0, False)):
                requested = time.monotonic()
                stdin.write(f"{value}\n".encode())
                await stdin.drain()
                tick = float(await read_line(stdout, "tick "))
                while True:
                    arrived, active = await asyncio.wait_for(queue.get(), 10)
                    if active is expected:
                        break
                if expected:
                    from_request.append(arrived - requested)
                    from_tick.append(arrived - tick)
            await asyncio.sleep(0.1)
    finally:
        listener.cancel()
        await asyncio.gather(listener, return_exceptions=True)
    return from_request, from_tick


def summary(seconds: list[float]) -> dict[str, float]:
    """Median, p99, max and min of durations given in seconds, in milliseconds."""
    ms = sorted(1000 * s for s in seconds)
    p99 = ms[min(len(ms) - 1, round(0.99 * (len(ms) - 1)))]
    return {
        "median": round(statistics.median(ms), 1),
        "p99": round(p99, 1),
        "max": round(max(ms), 1),
        "min": round(min(ms), 1),
    }


def main() -> None:
    """Run the bench and write its result; with the hidden ``--simulate``, be the simulated agents instead."""
    parser = argparse.ArgumentParser(prog="python -m bench.gateway", description=__doc__.splitlines()[0])
    parser.add_argument("--agents", type=int, default=100)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--poll", type=float, default=0.5, help="the simulated agents' poll interval, seconds")
    parser.add_argument("--seconds", type=float, default=60, help="how long to measure CPU")
    parser.add_argument("--tries", type=int, default=20, help="push latency tries")
    parser.add_argument(
        "--receive-only",
        action="store_true",
        help="measure the transport's floor instead: a process that only receives the snapshots, no gateway",
    )
    parser.add_argument("--simulate", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--receive-only-from", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.simulate:
        asyncio.run(simulate(args.agents, args.gpus, args.poll))
        return
    if args.receive_only_from:
        asyncio.run(receive_only(args.receive_only_from.split(",")))
        return
    result = asyncio.run(run_receive_only(args) if args.receive_only else run(args))
    results = RECEIVE_ONLY_RESULTS if args.receive_only else RESULTS
    results.parent.mkdir(parents=True, exist_ok=True)
    results.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
