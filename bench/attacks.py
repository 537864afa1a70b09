"""Issue 19's attacks on the gRPC port at full size: what a good caller sees beside each, and the memory it costs.

    .venv/bin/python -m bench attacks                       # every attack, full size: about 12 minutes on 2 cores
    .venv/bin/python -m bench.attacks --quick               # every attack at a 20th of the size: about 3 minutes
    .venv/bin/python -m bench.attacks rapid_reset ping_flood  # some of them

Each attack gets a fresh agent (``gpuscaler serve --collector fake --fake-gpus 8``, 0.5 s poll, the default
connection limits) and, for the ``*_gateway`` ones, a ``gpuscaler gateway`` over it that is attacked instead.
A good caller (GetMetrics one after another on its own grpcio channel and connection, as KEDA polls) runs
for ``--baseline`` seconds before the attack, through it, and for ``--after`` seconds after it. The attack runs
in its own process (``python -m e2e.support.attacks``), so the attacker's CPU is not the measuring loop's; on
2 cores it still competes with the server for them. Resident memory (VmRSS) and open file descriptors of the
attacked process (and the agent behind a gateway) are read every 0.1 s: before, at the peak, and at the end
of the ``--after`` seconds.

The ``engine_*`` rows (issue 31, rows 1 and 3; ``EnginePageAttack``) attack a gateway's engine reads instead: a
gateway over a fake agent with a static pod directory, the hostile pods of namespace evil served by a process of
their own (``python -m e2e.support.engine_pods``), another tenant's good vLLM pod (queue 3) in namespace ml, and
two good callers on their own connections, KEDA's GetMetrics of all GPUs and of the good tenant's queue. The
attacker's ScaledObject asks for its pods every 5 s for the attack's 30 s; then its pods are killed and ``--after``
seconds are measured. Reported: both callers' latencies and errors, any answer to the good tenant that is not 3
and any value the attacker got (its pods are past a limit or a bound: a value is made up), the gateway's RSS and
CPU, and its reads by outcome.

Goals (issue 19), each row's in ``goals`` and all of them in ``met``: resident memory back within 50 MiB of before,
``--after`` seconds after the attack; the good caller's p99 during the attack at most 3 times its baseline, and no
error; for the rows with fresh callers (issue 31), every one tried admitted;
and 10,000 StreamIsActive open on one connection fit the chart's agent memory limit
(charts/gpuscaler/values.yaml) with 25% to spare. Writes bench/results/attacks.json (attacks-quick.json with
``--quick``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import signal
import sys
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import yaml

from bench.common import RESULTS, print_table, summary_ms, write_result
from bench.common import cpu_seconds as bench_cpu_seconds
from bench.target import python_bytecode
from e2e.support import attacks, engine_pods
from e2e.support.agent import AgentProcess
from e2e.support.certs import TlsFiles, grpcio_credentials, make_certificates
from e2e.support.clients import GrpcioScaler, RpcFailure, grpc_probe, http_probe
from e2e.support.keda_grpcio import KedaProto, generate
from e2e.support.process import Process
from gpuscaler.server.transport.limits import LIMITS

ROOT = Path(__file__).resolve().parents[1]
VALUES = ROOT / "charts" / "gpuscaler" / "values.yaml"
OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]
SAMPLE_EVERY_SECONDS = 0.1
RSS_BACK_WITHIN_MIB = 50.0
P99_AT_MOST_TIMES_BASELINE = 3.0
MEMORY_SPARE = 0.25
ATTACK_TIMEOUT_SECONDS = 300.0


@dataclass(frozen=True, slots=True)
class Attack:
    """One row: the attacker's arguments at full size, what ``--quick`` divides, and what it is aimed at."""

    name: str
    what: str
    argv: tuple[str, ...]
    scaled: tuple[str, ...] = ("--count",)  # the flags ``--quick`` divides by QUICK_DIVISOR
    gateway: bool = False
    tls: bool = False
    agent_flags: tuple[str, ...] = ()
    mtls: bool = False  # with ``tls``: callers present a client certificate, as under --tls-client-ca
    module: str = "e2e.support.attacks"  # the attacker's module (``python -m``)
    on_metrics_port: bool = False  # aimed at --metrics-listen instead of the gRPC port
    fresh: tuple[str, ...] = ()  # fresh callers tried while it runs (FRESH_CALLERS), each counted as admitted/tried
    poll_lag: bool = False  # the agent's poll ticks' lateness (gpuscaler_poll_lag_seconds) sampled and reported


QUICK_DIVISOR = 20
QUICK_HOLD_SECONDS = 12.0
HOLDING = (
    "idle-tcp",
    "idle-tls",
    "streams",
    "headers-only",
    "continuation-flood",
    "hold",
    "slowloris",
)  # attacks that hold, then end
ATTACKS = (
    Attack("rapid_reset", "100k HEADERS+DATA+RST_STREAM on one connection", ("rapid-reset", "--count", "100000")),
    Attack(
        "rapid_reset_reconnecting",
        "100k HEADERS+DATA+RST_STREAM, a new connection each time one is closed",
        ("rapid-reset", "--count", "100000", "--reconnect", "--seconds", "120"),
    ),
    Attack(
        "rapid_reset_gateway",
        "100k HEADERS+DATA+RST_STREAM on one connection to the gateway",
        ("rapid-reset", "--count", "100000"),
        gateway=True,
    ),
    Attack(
        "grpcio_cancels",
        "grpcio cancels (push streams after their first message, unary calls in flight), 50/s",
        ("grpcio-cancels", "--count", "3000", "--rate", "50", "--seconds", "120"),
    ),
    Attack("idle_tcp", "2,000 TCP connections that send nothing", ("idle-tcp", "--count", "2000", "--seconds", "20")),
    Attack(
        "idle_tls_no_client_hello",
        "200 connections to a TLS port that never send a ClientHello",
        ("idle-tcp", "--count", "200", "--seconds", "20"),
        tls=True,
    ),
    Attack(
        "idle_tls_no_preface",
        "200 TLS connections that finish the handshake and send no HTTP/2 preface",
        ("idle-tls", "--count", "200", "--seconds", "20"),
        tls=True,
    ),
    Attack(
        "streams_10000",
        "10,000 StreamIsActive on one connection, held 20 s",
        ("streams", "--count", "10000", "--seconds", "20"),
    ),
    Attack(
        "headers_only_3x10000",
        "3 connections x 10,000 HEADERS-only streams (no request message), held 20 s",
        ("headers-only", "--count", "10000", "--connections", "3", "--seconds", "20"),
    ),
    Attack(
        "ping_flood",
        "PINGs as fast as they go from a peer that never reads, 20 s",
        ("ping-flood", "--count", "2000000", "--seconds", "20"),
    ),
    Attack(
        "ping_flood_gateway",
        "PINGs as fast as they go from a peer that never reads, at the gateway",
        ("ping-flood", "--count", "2000000", "--seconds", "20"),
        gateway=True,
    ),
    Attack(
        "settings_flood",
        "SETTINGS as fast as they go from a peer that never reads, 20 s",
        ("settings-flood", "--count", "2000000", "--seconds", "20"),
    ),
    Attack(
        "deadlines_1ms",
        "50k GetMetrics with a 1 ms deadline, 50 in flight, one grpcio channel",
        ("deadlines", "--count", "50000", "--concurrency", "50", "--seconds", "120"),
    ),
    Attack(
        "deadline_resets",
        "100k HEADERS+DATA+RST_STREAM on one connection, each call claiming grpc-timeout 100m",
        ("rapid-reset", "--count", "100000", "--timeout", "100m", "--seconds", "120"),
    ),
    Attack(
        "rapid_reset_reconnect_per_1000",
        "100k HEADERS+DATA+RST_STREAM, a new connection after every 1,000 resets",
        ("rapid-reset", "--count", "100000", "--per-connection", "1000", "--seconds", "120"),
    ),
    Attack(
        "call_flood",
        "100k GetMetrics on one connection as fast as they are answered, 1,000 in flight, none reset",
        ("call-flood", "--count", "100000", "--seconds", "120"),
        poll_lag=True,
    ),
    Attack(
        "continuation_flood",
        "200 connections, each a header block of 63 x 16 kB CONTINUATIONs never ended, held 20 s",
        ("continuation-flood", "--connections", "200", "--seconds", "20"),
        scaled=("--connections",),
    ),
    # Issue 31, row 4: strangers holding every connection without using it, from 64 addresses, reopening as they are
    # closed; fresh callers (a restarted KEDA, the kubelet's probe, a gateway dialling the agent) must get in.
    Attack(
        "connections_nothing_64_addresses",
        "300 connections that send nothing, from 64 addresses, each reopened as it closes, 30 s",
        ("hold", "--count", "300", "--sources", "64", "--first", "nothing", "--seconds", "30"),
        module="e2e.support.hogs",
        fresh=("keda", "grpc_probe", "gateway"),
    ),
    Attack(
        "connections_partial_64_addresses",
        "300 connections that send 10 bytes of the preface, from 64 addresses, each reopened as it closes, 30 s",
        ("hold", "--count", "300", "--sources", "64", "--first", "partial", "--seconds", "30"),
        module="e2e.support.hogs",
        fresh=("keda", "grpc_probe", "gateway"),
    ),
    Attack(
        "connections_preface_64_addresses",
        "300 connections that send a preface only, from 64 addresses, each reopened as it closes, 30 s",
        ("hold", "--count", "300", "--sources", "64", "--first", "preface", "--seconds", "30"),
        module="e2e.support.hogs",
        fresh=("keda", "grpc_probe", "gateway"),
    ),
    Attack(
        "connections_no_client_hello_mtls",
        "300 connections to an mTLS port that never send a ClientHello, from 64 addresses, reopening, 30 s",
        ("hold", "--count", "300", "--sources", "64", "--first", "nothing", "--seconds", "30"),
        tls=True,
        mtls=True,
        module="e2e.support.hogs",
        fresh=("keda", "healthz"),
    ),
    # Issue 31, row 9: slow /healthz clients from 64 addresses, reopening as they are closed.
    Attack(
        "healthz_slowloris_64_addresses",
        "256 slow /healthz clients (a header byte every 0.5 s) from 64 addresses, each reopened as it closes, 30 s",
        ("slowloris", "--count", "256", "--sources", "64", "--seconds", "30"),
        module="e2e.support.hogs",
        on_metrics_port=True,
        fresh=("healthz",),
    ),
)


# Fresh callers beside an attack: the first FRESH_AFTER_SECONDS in (the strangers fill the pool), then one of each kind
# every FRESH_EVERY_SECONDS, each on a new connection; a gateway (a process) at most FRESH_GATEWAYS times.
FRESH_CALLERS = ("keda", "grpc_probe", "healthz", "gateway")
FRESH_AFTER_SECONDS = 5.0
FRESH_EVERY_SECONDS = 0.5
FRESH_GATEWAYS = 3
FRESH_TIMEOUT_SECONDS = 5.0
PROBE_TIMEOUT_SECONDS = 2.0  # the chart's probes' timeoutSeconds


@dataclass
class Samples:
    """RSS (MiB) and fds of some processes, every SAMPLE_EVERY_SECONDS, with their monotonic times."""

    pids: dict[str, int]
    rows: list[tuple[float, dict[str, tuple[float, int]]]] = field(default_factory=list)

    def take(self) -> None:
        """One reading of every process (one that has exited is left out)."""
        reading = {}
        for name, pid in self.pids.items():
            with contextlib.suppress(OSError, AssertionError):
                reading[name] = (attacks.rss_mib(pid), attacks.open_fds(pid))
        self.rows.append((time.monotonic(), reading))

    async def run(self) -> None:
        """Readings until cancelled."""
        while True:
            self.take()
            await asyncio.sleep(SAMPLE_EVERY_SECONDS)

    def between(self, name: str, start: float, end: float) -> list[tuple[float, int]]:
        """``name``'s (RSS, fds) readings taken from ``start`` to ``end``."""
        return [row[name] for at, row in self.rows if start <= at <= end and name in row]


def poll_loop_record(folder: Path) -> dict[str, int]:
    """The newest agent's (this row's: each row starts its own) ``poll_behind`` lines, ticks missed, and turns of its
    health to NOT_SERVING, from its log in ``folder``/logs."""
    logs = sorted((folder / "logs").glob("agent-*.log"), key=lambda path: int(path.stem.split("-")[-1]))
    if not logs:
        return {}
    events = []
    for line in logs[-1].read_text(encoding="utf-8", errors="replace").splitlines():
        with contextlib.suppress(ValueError):
            events.append(json.loads(line))
    behind = [e for e in events if isinstance(e, dict) and e.get("event") == "poll_behind"]
    return {
        "poll_behind": len(behind),
        "missed_ticks": sum(int(e.get("missed_ticks", 0)) for e in behind),
        "health_not_serving": sum(
            1 for e in events if isinstance(e, dict) and e.get("event") == "health_changed" and not e.get("serving")
        ),
    }


def agent_memory_limit_mib() -> float:
    """The chart's agent memory limit (agent.resources.limits.memory), MiB."""
    values = yaml.safe_load(VALUES.read_text(encoding="utf-8"))
    text = str(values["agent"]["resources"]["limits"]["memory"])
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(Ki|Mi|Gi)?", text)
    if match is None:
        raise ValueError(f"agent memory limit {text!r} is not a quantity this bench reads")
    number, unit = float(match.group(1)), match.group(2) or ""
    return number * {"Ki": 1 / 1024, "Mi": 1.0, "Gi": 1024.0, "": 1 / 2**20}[unit]


def quick_argv(attack: Attack) -> list[str]:
    """The attacker's arguments with the ``scaled`` flags divided by QUICK_DIVISOR, and what is held held for
    QUICK_HOLD_SECONDS: past the default handshake and request timeouts (10 s), so that they act."""
    argv = list(attack.argv)
    for index, arg in enumerate(argv[:-1]):
        if arg in attack.scaled:
            argv[index + 1] = str(max(1, int(argv[index + 1]) // QUICK_DIVISOR))
        if arg == "--seconds" and attack.argv[0] in HOLDING:
            argv[index + 1] = f"{QUICK_HOLD_SECONDS:g}"
    return argv


@contextlib.asynccontextmanager
async def servers(attack: Attack, folder: Path, tls: TlsFiles | None) -> AsyncIterator[tuple[str, dict[str, int], int]]:
    """The attacked server for the block: (its address, the pids to sample, its /metrics port)."""
    agent = await asyncio.to_thread(
        AgentProcess.start,
        *attack.agent_flags,
        log_dir=folder / "logs",
        gpus=8,
        poll_interval=0.5,
        tls=tls if attack.tls else None,
        mtls=attack.mtls,
    )
    gateway: Process | None = None
    try:
        if not attack.gateway:
            yield agent.address, {"agent": agent.pid}, agent.metrics_port
            return
        gateway = await asyncio.to_thread(attacks.gateway_process([agent.address], folder / "logs").start)
        assert gateway.process is not None
        pids = {"gateway": gateway.process.pid, "agent": agent.pid}
        yield f"127.0.0.1:{gateway.port}", pids, attacks.metrics_port_of(gateway)
    finally:
        if gateway is not None:
            await gateway.terminate()
        agent.expect_errors = True  # a measurement, not a test: what it logged is in the logs folder
        await agent.terminate(timeout=60)


def good_client(address: str, proto: KedaProto, tls: TlsFiles | None, *, client_cert: bool = False) -> GrpcioScaler:
    """The good caller's grpcio channel, on a connection of its own (TLS when the server serves it)."""
    if tls is None:
        return GrpcioScaler(grpc.aio.insecure_channel(address, options=OWN_CONNECTION), proto)
    credentials = grpcio_credentials(tls, client_cert=client_cert)
    channel = grpc.aio.secure_channel(address, credentials, options=tls.grpcio_options + OWN_CONNECTION)
    return GrpcioScaler(channel, proto)


def turns_deferred(metrics_port: int) -> float | None:
    """``gpuscaler_grpc_turns_deferred_total`` (reads left in part for a later turn); None where it is not served."""
    try:
        return attacks.metric(metrics_port, "gpuscaler_grpc_turns_deferred_total")
    except attacks.MissingMetric:
        return None


# How often the poll ticks' lateness is read (``Attack.poll_lag``): under the 0.5 s tick, so that every tick is seen.
POLL_LAG_EVERY_SECONDS = 0.2


async def sample_poll_lag(metrics_port: int, into: list[tuple[float, float]]) -> None:
    """``gpuscaler_poll_lag_seconds`` (how late the last tick started) every POLL_LAG_EVERY_SECONDS, until cancelled."""
    while True:
        with contextlib.suppress(OSError, attacks.MissingMetric):
            into.append(
                (time.monotonic(), await asyncio.to_thread(attacks.metric, metrics_port, "gpuscaler_poll_lag_seconds"))
            )
        await asyncio.sleep(POLL_LAG_EVERY_SECONDS)


def poll_lag_ms(samples: list[tuple[float, float]], start: float, end: float) -> dict[str, float | int]:
    """The ticks' lateness read from ``start`` to ``end``: its median and largest, in ms, and how many readings."""
    values = sorted(1000 * lag for at, lag in samples if start <= at < end)
    if not values:
        return {"n": 0}
    return {"n": len(values), "p50_ms": round(values[len(values) // 2], 2), "max_ms": round(values[-1], 2)}


def limited_counts(metrics_port: int) -> dict[str, float]:
    """``gpuscaler_grpc_limited_total`` by limit; empty when the server has no such series."""
    try:
        return {limit: attacks.limited(metrics_port, limit) for limit in LIMITS}
    except attacks.MissingMetric:
        return {}


async def run_attacker(
    argv: Sequence[str], port: int, tls: TlsFiles | None, module: str = "e2e.support.attacks"
) -> dict[str, Any]:
    """``python -m <module>`` in its own process; its last JSON line (or what went wrong)."""
    command = [sys.executable, "-m", module, *argv, "--port", str(port)]
    if tls is not None and argv[0] == "idle-tls":
        command += ["--tls-ca", str(tls.ca)]
    child = await asyncio.create_subprocess_exec(
        *command, cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    try:
        async with asyncio.timeout(ATTACK_TIMEOUT_SECONDS):
            out, err = await child.communicate()
    except TimeoutError:
        child.kill()
        await child.wait()
        return {"error": f"the attacker ran past {ATTACK_TIMEOUT_SECONDS:g}s"}
    lines = out.decode().splitlines()
    if child.returncode != 0 or not lines:
        return {"error": f"the attacker exited {child.returncode}", "stderr": err.decode()[-2000:]}
    report: dict[str, Any] = json.loads(lines[-1])
    return report


async def fresh_keda(address: str, proto: KedaProto, tls: TlsFiles | None, client_cert: bool) -> bool:
    """A restarted KEDA: a new channel and connection, one GetMetrics; whether it was answered."""
    client = good_client(address, proto, tls, client_cert=client_cert)
    try:
        await client.get_metrics(dict(attacks.GOOD_QUERY), attacks.METRIC_NAME, timeout=FRESH_TIMEOUT_SECONDS)
        return True
    except RpcFailure:
        return False
    finally:
        await client.close()


async def fresh_gateway(address: str, proto: KedaProto, folder: Path) -> bool:
    """A gateway started now, dialling ``address``: whether it subscribes and answers KEDA within 15 s."""
    gateway = await asyncio.to_thread(attacks.gateway_process([address], folder / "logs").start)
    client = GrpcioScaler(grpc.aio.insecure_channel(f"127.0.0.1:{gateway.port}", options=OWN_CONNECTION), proto)
    try:
        async with attacks.good_caller(client, {}, warm_seconds=15.0):
            return True
    except RpcFailure:
        return False
    finally:
        await client.close()
        await gateway.terminate()


async def fresh_callers(
    attack: Attack,
    address: str,
    metrics_port: int,
    proto: KedaProto,
    tls: TlsFiles | None,
    folder: Path,
    counts: dict[str, list[int]],
) -> None:
    """Try ``attack.fresh`` callers until cancelled; ``counts[kind]`` is [admitted, tried]."""
    await asyncio.sleep(FRESH_AFTER_SECONDS)
    while True:
        for kind in attack.fresh:
            if kind == "keda":
                admitted = await fresh_keda(address, proto, tls if attack.tls else None, attack.mtls)
            elif kind == "grpc_probe":
                admitted = await asyncio.to_thread(grpc_probe, address, timeout=PROBE_TIMEOUT_SECONDS)
            elif kind == "healthz":
                admitted = await asyncio.to_thread(http_probe, metrics_port, timeout=PROBE_TIMEOUT_SECONDS)
            elif counts.get(kind, [0, 0])[1] < FRESH_GATEWAYS:
                admitted = await fresh_gateway(address, proto, folder)
            else:
                continue
            tally = counts.setdefault(kind, [0, 0])
            tally[0] += admitted
            tally[1] += 1
        await asyncio.sleep(FRESH_EVERY_SECONDS)


async def measure(
    attack: Attack, argv: Sequence[str], folder: Path, proto: KedaProto, tls: TlsFiles | None, args: argparse.Namespace
) -> dict[str, Any]:
    """One attack: baseline, attack, after; the good caller's figures, the samples, the limits that acted."""
    async with servers(attack, folder, tls) as (address, pids, metrics_port):
        client = good_client(address, proto, tls if attack.tls else None, client_cert=attack.mtls)
        samples = Samples(pids)
        fresh: dict[str, list[int]] = {}
        sampler = asyncio.create_task(samples.run())
        lags: list[tuple[float, float]] = []
        if attack.poll_lag:
            lagging = asyncio.create_task(sample_poll_lag(metrics_port, lags))
        try:
            async with attacks.good_caller(client, {} if attack.gateway else None) as good:
                limited_before = await asyncio.to_thread(limited_counts, metrics_port)
                deferred_before = await asyncio.to_thread(turns_deferred, metrics_port)
                baseline_start = time.monotonic()
                await asyncio.sleep(args.baseline)
                attack_start = time.monotonic()
                trying = asyncio.create_task(fresh_callers(attack, address, metrics_port, proto, tls, folder, fresh))
                port = metrics_port if attack.on_metrics_port else int(address.rsplit(":", 1)[1])
                try:
                    report = await run_attacker(argv, port, tls if attack.tls else None, attack.module)
                finally:
                    trying.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await trying
                attack_end = time.monotonic()
                await asyncio.sleep(args.after)
                end = time.monotonic()
                limited_after = await asyncio.to_thread(limited_counts, metrics_port)
                deferred_after = await asyncio.to_thread(turns_deferred, metrics_port)
        finally:
            for task in (sampler, lagging) if attack.poll_lag else (sampler,):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            await client.close()
    baseline = [s for at, s in good.latencies if baseline_start <= at < attack_start]
    during = [s for at, s in good.latencies if attack_start <= at < attack_end]
    after = [s for at, s in good.latencies if attack_end <= at <= end]
    errors = Counter(f.code for at, f in good.errors if at >= baseline_start)
    processes = {}
    for name in pids:
        before = samples.between(name, baseline_start, attack_start)
        peak = samples.between(name, attack_start, end)
        last = samples.between(name, end - 1.0, end)
        processes[name] = {
            "rss_mib_before": round(before[-1][0], 1) if before else None,
            "rss_mib_peak": round(max(r for r, _ in peak), 1) if peak else None,
            "rss_mib_after": round(last[-1][0], 1) if last else None,
            "fds_before": before[-1][1] if before else None,
            "fds_peak": max(f for _, f in peak) if peak else None,
            "fds_after": last[-1][1] if last else None,
        }
    attacked = processes["gateway" if attack.gateway else "agent"]
    baseline_p99 = summary_ms(baseline)["p99_ms"] if baseline else None
    during_summary = summary_ms(during) if during else {"n": 0}
    rss_back = (
        attacked["rss_mib_after"] is not None
        and attacked["rss_mib_before"] is not None
        and attacked["rss_mib_after"] - attacked["rss_mib_before"] <= RSS_BACK_WITHIN_MIB
    )
    p99_ok = (
        baseline_p99 is not None
        and bool(during)
        and during_summary["p99_ms"] <= P99_AT_MOST_TIMES_BASELINE * baseline_p99
    )
    goals = {
        "rss_back_within_50_mib": rss_back,
        "good_caller_p99_at_most_3x_baseline": p99_ok,
        "good_caller_no_error": not errors,
    }
    if attack.fresh:  # issue 31: a fresh KEDA, the kubelet's probe and a gateway always get in
        goals["fresh_callers_all_admitted"] = bool(fresh) and all(
            admitted == tried and tried > 0 for admitted, tried in fresh.values()
        )
    return {
        "attack": attack.name,
        "what": attack.what,
        "target": "gateway" if attack.gateway else "agent",
        "attacker_argv": list(argv),
        "attacker": report,
        "attack_seconds": round(attack_end - attack_start, 2),
        "fresh_callers_admitted_tried": fresh,
        "load_average_1m": round(os.getloadavg()[0], 2),
        "good_caller": {
            "baseline": summary_ms(baseline) if baseline else {"n": 0},
            "during": during_summary,
            "after": summary_ms(after) if after else {"n": 0},
            "errors": dict(errors),
        },
        "processes": processes,
        "limited": {
            k: v - limited_before.get(k, 0.0) for k, v in limited_after.items() if v - limited_before.get(k, 0)
        },
        "turns_deferred": (
            deferred_after - deferred_before if deferred_after is not None and deferred_before is not None else None
        ),
        "poll_loop": poll_loop_record(folder),
        **(
            {
                "poll_lag": {
                    "baseline": poll_lag_ms(lags, baseline_start, attack_start),
                    "during": poll_lag_ms(lags, attack_start, attack_end),
                }
            }
            if attack.poll_lag
            else {}
        ),
        "goals": goals,
        "met": all(goals.values()),
    }


# Engine pages (issue 31 rows 1 and 3): hostile engine pods of one tenant beside another tenant's good one, read by
# a gateway whose own GPU callers and the other tenant's KEDA are measured. Row 2 (pods that never answer) runs on
# the same harness: an EnginePageAttack of kind "silent".

ENGINE_QUERY = {"metric": "vllm_queue", "workload": "llm", "targetValue": "8"}  # the good tenant's, in namespace ml
HOSTILE_QUERY = {"metric": "vllm_queue", "workload": "evil", "targetValue": "8"}  # the attacker's, in namespace evil
GOOD_QUEUE = 3.0  # what the good tenant's one pod says: any other answer is made up
HOSTILE_ASK_EVERY_SECONDS = 5.0  # the attacker's KEDA asks again well within FORGET_AFTER_SECONDS


@dataclass(frozen=True, slots=True)
class EnginePageAttack:
    """One row against the gateway's engine reads: ``pods`` pods of ``kind`` (``e2e.support.engine_pods``) in the
    attacker's namespace, read for ``seconds`` because the attacker's ScaledObject asks for them."""

    name: str
    what: str
    kind: str
    pods: int
    pod_flags: tuple[str, ...] = ()
    gateway_flags: tuple[str, ...] = ()
    seconds: float = 30.0


ENGINE_ATTACKS = (
    EnginePageAttack(
        "engine_label_sets",
        "one Ready pod whose page is 109,230 label sets of vllm:num_requests_waiting, just under 4 MiB",
        "label-sets",
        1,
        ("--label-sets", "109230"),
    ),
    EnginePageAttack(
        "engine_oversized", "80 Ready pods, each a page of 8 MiB that its Content-Length announces", "oversized", 80
    ),
    EnginePageAttack("engine_endless", "80 Ready pods, each a page without end or Content-Length", "endless", 80),
    EnginePageAttack("engine_silent", "160 Ready pods whose pages never answer (row 2)", "silent", 160),
)


@dataclass
class Asker:
    """KEDA's GetMetrics on one query, one after another: each latency, each answer, each error."""

    stub: Any
    request: Any
    pause_seconds: float = 0.02
    timeout: float = 5.0
    latencies: list[tuple[float, float]] = field(default_factory=list)
    values: list[tuple[float, float]] = field(default_factory=list)
    errors: list[tuple[float, str, str]] = field(default_factory=list)

    async def run(self) -> None:
        """Ask until cancelled."""
        while True:
            started = time.monotonic()
            try:
                answer = await self.stub.GetMetrics(self.request, timeout=self.timeout)
            except grpc.aio.AioRpcError as error:
                self.errors.append((started, error.code().name, (error.details() or "")[:300]))
            else:
                self.latencies.append((started, time.monotonic() - started))
                self.values.extend((started, v.metricValueFloat) for v in answer.metricValues)
            await asyncio.sleep(self.pause_seconds)

    def summary(self, start: float, end: float, expected: float | None = None) -> dict[str, Any]:
        """Latencies, errors by code, and answers other than ``expected``, of calls started in [start, end)."""
        latencies = [s for at, s in self.latencies if start <= at < end]
        errors = Counter(code for at, code, _ in self.errors if start <= at < end)
        wrong = [v for at, v in self.values if start <= at < end and expected is not None and v != expected]
        return {
            **(summary_ms(latencies) if latencies else {"n": 0}),
            "errors": dict(errors),
            "error_example": next((d for at, _, d in self.errors if start <= at < end), None),
            "made_up_answers": len(wrong),
        }


async def asker(
    channel: Any, proto: KedaProto, metadata: dict[str, str], namespace: str, pause_seconds: float = 0.02
) -> Asker:
    """An Asker on ``metadata`` in ``namespace``, with the metric name GetMetricSpec gives (retried until the
    gateway answers, as KEDA does)."""
    stub = proto.stub(channel)
    ref = proto.ref(metadata, name=metadata.get("workload", "app"), namespace=namespace)
    deadline = time.monotonic() + 60
    while True:
        try:
            spec = await stub.GetMetricSpec(ref, timeout=5)
            break
        except grpc.aio.AioRpcError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)
    request = proto.pb2.GetMetricsRequest(scaledObjectRef=ref, metricName=spec.metricSpecs[0].metricName)
    return Asker(stub, request, pause_seconds=pause_seconds)


def engine_scrapes(metrics_port: int) -> dict[str, float]:
    """The gateway's engine reads so far by outcome."""
    return {
        labels["outcome"]: value
        for name, labels, value in attacks.scrape(metrics_port)
        if name == "gpuscaler_gateway_engine_scrapes_total"
    }


async def measure_engine_pages(
    attack: EnginePageAttack, folder: Path, proto: KedaProto, args: argparse.Namespace
) -> dict[str, Any]:
    """One engine-page row: baseline, the attacker's pods read, then those pods gone; both good callers' figures,
    the gateway's memory and CPU, and its reads by outcome."""
    agent = await asyncio.to_thread(AgentProcess.start, log_dir=folder / "logs", gpus=8, poll_interval=0.5)
    gateway: Process | None = None
    seconds = attack.seconds / QUICK_DIVISOR * 4 if args.quick else attack.seconds
    pods = max(1, attack.pods // QUICK_DIVISOR * 4) if args.quick else attack.pods
    try:
        async with contextlib.AsyncExitStack() as stack:
            good_ports, _ = await stack.enter_async_context(engine_pods.engine_pods("good", 1))
            hostile = await stack.enter_async_context(engine_pods.engine_pods(attack.kind, pods, *attack.pod_flags))
            hostile_ports, hostile_pid = hostile
            directory = folder / f"pods-{attack.name}.yaml"
            entries = engine_pods.pod_entries("ml", "llm", good_ports)
            entries += engine_pods.pod_entries("evil", "evil", hostile_ports)
            directory.write_text(yaml.safe_dump({"pods": entries}), encoding="utf-8")
            flags = ("--pod-directory", str(directory), *attack.gateway_flags)
            gateway = await asyncio.to_thread(attacks.gateway_process([agent.address], folder / "logs", *flags).start)
            assert gateway.process is not None
            pid, metrics_port = gateway.process.pid, attacks.metrics_port_of(gateway)
            address = f"127.0.0.1:{gateway.port}"
            channels = [grpc.aio.insecure_channel(address, options=OWN_CONNECTION) for _ in range(3)]
            for channel in channels:
                stack.push_async_callback(channel.close)
            gpu = await asker(channels[0], proto, {}, "ml")
            engine = await asker(channels[1], proto, ENGINE_QUERY, "ml")
            attacker = await asker(channels[2], proto, HOSTILE_QUERY, "evil", HOSTILE_ASK_EVERY_SECONDS)
            samples = Samples({"gateway": pid})
            cpu: list[tuple[float, float]] = []

            async def sample_cpu() -> None:
                while True:
                    cpu.append((time.monotonic(), bench_cpu_seconds(pid)))
                    await asyncio.sleep(SAMPLE_EVERY_SECONDS)

            tasks = [asyncio.create_task(t) for t in (samples.run(), sample_cpu(), gpu.run(), engine.run())]
            try:
                await asyncio.sleep(3.0)  # both callers warm: the good pod has been read twice
                baseline_start = time.monotonic()
                await asyncio.sleep(args.baseline)
                scrapes_before = await asyncio.to_thread(engine_scrapes, metrics_port)
                attack_start = time.monotonic()
                attacking = asyncio.create_task(attacker.run())
                await asyncio.sleep(seconds)
                attacking.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await attacking
                scrapes_during = await asyncio.to_thread(engine_scrapes, metrics_port)
                os.kill(hostile_pid, signal.SIGKILL)  # the attack ends: its pods are gone (reads of them fail fast)
                attack_end = time.monotonic()
                await asyncio.sleep(args.after)
                end = time.monotonic()
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        if gateway is not None:
            await gateway.terminate()
        agent.expect_errors = True
        await agent.terminate(timeout=60)

    def cpu_share(start: float, stop: float) -> float | None:
        inside = [(at, used) for at, used in cpu if start <= at <= stop]
        if len(inside) < 2:
            return None
        return round((inside[-1][1] - inside[0][1]) / (inside[-1][0] - inside[0][0]), 3)

    before = samples.between("gateway", baseline_start, attack_start)
    peak = samples.between("gateway", attack_start, end)
    last = samples.between("gateway", end - 1.0, end)
    rss = {
        "rss_mib_before": round(before[-1][0], 1) if before else None,
        "rss_mib_peak": round(max(r for r, _ in peak), 1) if peak else None,
        "rss_mib_after": round(last[-1][0], 1) if last else None,
    }
    callers = {
        "gpu": {
            "baseline": gpu.summary(baseline_start, attack_start),
            "during": gpu.summary(attack_start, attack_end),
            "after": gpu.summary(attack_end, end),
        },
        "engine": {
            "baseline": engine.summary(baseline_start, attack_start, GOOD_QUEUE),
            "during": engine.summary(attack_start, attack_end, GOOD_QUEUE),
            "after": engine.summary(attack_end, end, GOOD_QUEUE),
        },
    }
    attacker_summary = attacker.summary(attack_start, attack_end)
    attacker_summary["answers"] = [v for at, v in attacker.values if attack_start <= at < attack_end][:5]
    goals = {
        "rss_back_within_50_mib": rss["rss_mib_after"] is not None
        and rss["rss_mib_before"] is not None
        and rss["rss_mib_after"] - rss["rss_mib_before"] <= RSS_BACK_WITHIN_MIB,
        "made_up_answers": sum(c["during"]["made_up_answers"] + c["after"]["made_up_answers"] for c in callers.values())
        + len(attacker_summary["answers"]),
    }
    for name, caller in callers.items():
        base, during = caller["baseline"], caller["during"]
        goals[f"{name}_p99_at_most_3x_baseline"] = (
            base.get("n", 0) > 0
            and during.get("n", 0) > 0
            and during["p99_ms"] <= P99_AT_MOST_TIMES_BASELINE * base["p99_ms"]
        )
        goals[f"{name}_no_error"] = not during["errors"] and not caller["after"]["errors"]
    return {
        "attack": attack.name,
        "what": attack.what,
        "pods": pods,
        "attack_seconds": round(attack_end - attack_start, 2),
        "good_callers": callers,
        "attacker": attacker_summary,
        "gateway": {
            **rss,
            "cpu_cores_baseline": cpu_share(baseline_start, attack_start),
            "cpu_cores_during": cpu_share(attack_start, attack_end),
            "cpu_cores_after": cpu_share(attack_end, end),
            "engine_scrapes_during": {
                k: v - scrapes_before.get(k, 0.0) for k, v in scrapes_during.items() if v - scrapes_before.get(k, 0.0)
            },
        },
        "goals": goals,
    }


def show_engine_pages(rows: list[dict[str, Any]], quick: str) -> None:
    """The engine-page rows: both good callers before and during, and the gateway's memory and CPU."""
    callers, gateway = [], []
    for row in rows:
        for name, caller in row["good_callers"].items():
            callers.append(
                (
                    f"{row['attack']} ({name})",
                    caller["baseline"].get("p99_ms", "-"),
                    caller["during"].get("p50_ms", caller["during"].get("median_ms", "-")),
                    caller["during"].get("p99_ms", "-"),
                    ",".join(f"{k}={v}" for k, v in caller["during"]["errors"].items()) or "0",
                    caller["during"]["made_up_answers"],
                )
            )
        g = row["gateway"]
        gateway.append(
            (
                row["attack"],
                f"{g['rss_mib_before']}/{g['rss_mib_peak']}/{g['rss_mib_after']}",
                f"{g['cpu_cores_baseline']}/{g['cpu_cores_during']}/{g['cpu_cores_after']}",
                ",".join(f"{k}={v:g}" for k, v in g["engine_scrapes_during"].items()) or "-",
                ",".join(f"{k}={v}" for k, v in row["attacker"]["errors"].items()) or "-",
            )
        )
    print_table(
        "Good callers beside each engine-page attack" + quick,
        ["attack (caller)", "p99 ms before", "p50 during", "p99 during", "errors", "made up"],
        callers,
    )
    print_table(
        "Gateway under each engine-page attack" + quick,
        ["attack", "RSS MiB before/peak/after", "CPU cores before/during/after", "reads during", "attacker got"],
        gateway,
    )


async def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every chosen attack, one after another, each on fresh servers."""
    chosen = [a for a in ATTACKS if not args.names or a.name in args.names]
    engine_chosen = [a for a in ENGINE_ATTACKS if not args.names or a.name in args.names]
    rows = []
    engine_rows = []
    with tempfile.TemporaryDirectory(prefix="gpuscaler-bench-attacks-") as scratch:
        folder = Path(scratch)
        proto = generate(folder / "stubs")
        tls = make_certificates(folder / "certs") if any(a.tls for a in chosen) else None
        for attack in chosen:
            argv = quick_argv(attack) if args.quick else list(attack.argv)
            print(f"{attack.name}: {attack.what}" + (" (quick)" if args.quick else ""), flush=True)
            rows.append(await measure(attack, argv, folder, proto, tls, args))
        for engine_attack in engine_chosen:
            print(f"{engine_attack.name}: {engine_attack.what}" + (" (quick)" if args.quick else ""), flush=True)
            engine_rows.append(await measure_engine_pages(engine_attack, folder, proto, args))
    limit = agent_memory_limit_mib()
    result: dict[str, Any] = {
        "benchmark": "issue 19's attacks on the gRPC port, a good caller beside each",
        "quick": args.quick,
        "baseline_seconds": args.baseline,
        "after_seconds": args.after,
        "rows": rows,
        "engine_rows": engine_rows,
        "load_average": os.getloadavg(),
    }
    streams = next((r for r in rows if r["attack"] == "streams_10000"), None)
    if streams is not None:
        peak = streams["processes"]["agent"]["rss_mib_peak"]
        held = streams["attacker"].get("with_a_message")
        result["streams_10000_fit"] = {
            "agent_memory_limit_mib": limit,
            "at_most_mib": limit * (1 - MEMORY_SPARE),
            "peak_rss_mib": peak,
            "streams_with_a_message": held,
            "met": peak is not None and peak <= limit * (1 - MEMORY_SPARE) and not args.quick,
        }
    return result


def show(result: dict[str, Any]) -> None:
    """Two tables: the good caller before and during each attack; memory, fds and the limits that acted."""
    quick = " (quick)" if result["quick"] else ""
    callers, memory = [], []
    for row in result["rows"]:
        good, attacked = row["good_caller"], row["processes"][row["target"]]
        goals = row["goals"]
        callers.append(
            (
                row["attack"],
                good["baseline"].get("median_ms", "-"),
                good["baseline"].get("p99_ms", "-"),
                good["during"].get("median_ms", "-"),
                good["during"].get("p99_ms", "-"),
                ",".join(f"{k}={v}" for k, v in good["errors"].items()) or "0",
                "met" if goals["good_caller_p99_at_most_3x_baseline"] and goals["good_caller_no_error"] else "NOT",
            )
        )
        memory.append(
            (
                row["attack"],
                f"{attacked['rss_mib_before']}/{attacked['rss_mib_peak']}/{attacked['rss_mib_after']}",
                f"{attacked['fds_before']}/{attacked['fds_peak']}/{attacked['fds_after']}",
                ",".join(f"{k}={v:g}" for k, v in row["limited"].items()) or "-",
                "met" if goals["rss_back_within_50_mib"] else "NOT",
            )
        )
    print_table(
        "Good caller beside each attack" + quick,
        ["attack", "p50 ms", "p99 ms", "p50 during", "p99 during", "errors", "goal"],
        callers,
    )
    print_table(
        "Attacked process" + quick, ["attack", "RSS MiB before/peak/after", "fds", "limits acted", "goal"], memory
    )
    fresh = [
        (
            row["attack"],
            ", ".join(
                f"{kind} {admitted}/{tried}" for kind, (admitted, tried) in row["fresh_callers_admitted_tried"].items()
            ),
            row["load_average_1m"],
            "met" if row["goals"].get("fresh_callers_all_admitted") else "NOT",
        )
        for row in result["rows"]
        if row.get("fresh_callers_admitted_tried")
    ]
    if fresh:
        print_table(
            "Fresh callers during the attack, admitted/tried" + quick, ["attack", "callers", "load 1m", "goal"], fresh
        )
    for row in result["rows"]:
        if "poll_lag" in row:
            lag = row["poll_lag"]
            print(
                f"{row['attack']}: poll ticks late by p50 {lag['baseline'].get('p50_ms', '-')} / max "
                f"{lag['baseline'].get('max_ms', '-')} ms before, {lag['during'].get('p50_ms', '-')} / "
                f"{lag['during'].get('max_ms', '-')} ms during; {row['poll_loop'].get('missed_ticks', 0)} ticks missed"
            )
    if result.get("engine_rows"):
        show_engine_pages(result["engine_rows"], quick)
    if "streams_10000_fit" in result:
        fit = result["streams_10000_fit"]
        print(
            f"10,000 streams: peak RSS {fit['peak_rss_mib']} MiB, at most {fit['at_most_mib']:g} MiB "
            f"(the chart's {fit['agent_memory_limit_mib']:g} MiB less {MEMORY_SPARE:.0%}): "
            f"{'met' if fit['met'] else 'not met'}"
        )


def main(argv: list[str] | None = None) -> int:
    """Run the chosen attacks (all by default), write results/attacks.json, print the table."""
    parser = argparse.ArgumentParser(prog="python -m bench.attacks", description=__doc__.splitlines()[0])
    parser.add_argument(
        "names", nargs="*", metavar="ATTACK", help=", ".join(a.name for a in (*ATTACKS, *ENGINE_ATTACKS))
    )
    parser.add_argument("--quick", action="store_true", help=f"each attack at 1/{QUICK_DIVISOR} of its size")
    parser.add_argument("--baseline", type=float, default=None, help="seconds of good caller before (5; quick 2)")
    parser.add_argument("--after", type=float, default=None, help="seconds after the attack (10; quick 3)")
    args = parser.parse_args(argv)
    known = [a.name for a in (*ATTACKS, *ENGINE_ATTACKS)]
    unknown = [name for name in args.names if name not in known]
    if unknown:
        parser.error(f"unknown attack {unknown[0]!r}; use: {', '.join(known)}")
    args.baseline = args.baseline if args.baseline is not None else (2.0 if args.quick else 5.0)
    args.after = args.after if args.after is not None else (3.0 if args.quick else 10.0)
    python_bytecode()
    started = time.monotonic()
    result = asyncio.run(run(args))
    result["bench_seconds"] = round(time.monotonic() - started, 1)
    name = "attacks-quick" if args.quick else "attacks"
    if args.names:  # a partial run keeps the full one's file
        name += ("-" + "-".join(args.names)) if len(args.names) <= 2 else "-some"
    path = write_result(name, result)
    show(result)
    print(f"wrote {path.relative_to(RESULTS.parent)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
