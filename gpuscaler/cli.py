"""The ``gpuscaler`` command: ``serve``, ``gateway``, ``fake set|fail|heal``, ``query``, ``version``.

Bad flags exit 2 with a message naming the flag; an agent that cannot start, or an agent a client
command cannot reach, exits 1 with one line that says what to check.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import gc
import os
import re
import signal
import ssl
import sys
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from grpclib.const import Status
from grpclib.exceptions import GRPCError, ProtocolError, StreamTerminatedError

from gpuscaler import __version__, logs
from gpuscaler.agent.collectors.base import CollectorUnavailable
from gpuscaler.agent.settings import add_serve_flags, settings_from_args
from gpuscaler.gateway.settings import add_gateway_flags, gateway_settings_from_args
from gpuscaler.generated.gpuscaler import v1 as pb
from gpuscaler.model.errors import ConfigError, StartupError

# The client commands' modules (rich, the report, the client channel) load only for those commands:
# `serve` starts in less time and memory without them.
if TYPE_CHECKING:
    from grpclib.client import Channel

    from gpuscaler.client.channels import ClientOptions

CLIENT_TIMEOUT_SECONDS = 5.0
T = TypeVar("T")
# Allocations between two young collections of the gateway (the default is 700); see `_gateway`.
GATEWAY_GC_YOUNG_THRESHOLD = 100_000
# Generation-1 collections between two full ones in the agent (the default is 10); see `_serve`.
AGENT_GC_FULL_THRESHOLD = 100
FAILURES = {
    "lost": pb.FakeFailure.LOST,
    "not_supported": pb.FakeFailure.NOT_SUPPORTED,
    "timeout": pb.FakeFailure.TIMEOUT,
}


def build_parser(environ: Mapping[str, str]) -> argparse.ArgumentParser:
    """Every command and its flags; ``serve``'s and ``gateway``'s default to their variables in ``environ``."""
    parser = argparse.ArgumentParser(
        prog="gpuscaler", description="NVIDIA GPU telemetry as autoscaling signals for KEDA."
    )
    # As `gpuscaler version` prints it; the flag is what users of most tools try first.
    parser.add_argument("--version", action="version", version=f"gpuscaler {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = commands.add_parser("serve", help="run the node agent", description="Run the node agent.")
    add_serve_flags(serve, environ)

    gateway = commands.add_parser(
        "gateway",
        help="run the cluster gateway",
        description="Subscribe to every agent and answer KEDA for the whole cluster.",
    )
    add_gateway_flags(gateway, environ)

    fake = commands.add_parser("fake", help="drive an agent's fake GPUs", description="Drive fake GPUs.")
    fake_commands = fake.add_subparsers(dest="fake_command", required=True, metavar="ACTION")
    fake_set = fake_commands.add_parser("set", help="set metric values", description="Set fake GPU values.")
    _add_client_flags(fake_set)
    fake_set.add_argument("--gpu", required=True, help="GPU index, or all")
    fake_set.add_argument("values", nargs="+", metavar="METRIC=VALUE", help="e.g. gpu_utilization=90")
    fake_fail = fake_commands.add_parser("fail", help="make a GPU fail", description="Make reads of a GPU fail.")
    _add_client_flags(fake_fail)
    fake_fail.add_argument("--gpu", required=True, help="GPU index")
    fake_fail.add_argument("--error", required=True, choices=sorted(FAILURES), help="how NVML fails")
    fake_heal = fake_commands.add_parser("heal", help="end a failure", description="End fake GPU failures.")
    _add_client_flags(fake_heal)
    fake_heal.add_argument("--gpu", required=True, help="GPU index, or all")

    query = commands.add_parser(
        "query",
        help="show what KEDA would get for trigger metadata",
        description="Call the four ExternalScaler RPCs (and Explain) with the given trigger metadata.",
    )
    _add_client_flags(query, scaler=True)
    query.add_argument("metadata", nargs="*", metavar="KEY=VALUE", help="trigger metadata, e.g. profile=training")
    query.add_argument("--output", choices=("table", "json"), default="table", help="output format")
    query.add_argument("--replicas", type=int, default=1, help="current replicas, for the HPA's arithmetic")
    query.add_argument(
        "--watch",
        type=float,
        metavar="SECONDS",
        help="ask again every SECONDS until Ctrl-C or SIGTERM; into a pipe or a file, each answer is written in full",
    )
    query.add_argument(
        "--scaled-object",
        metavar="NAMESPACE/NAME",
        help="the ScaledObject to ask for, as KEDA sends it: the default namespace of pod keys, and the one "
        "scaleTargetPods reads (default default/gpuscaler-query)",
    )

    commands.add_parser("version", help="print the version", description="Print the version.")
    return parser


def _add_client_flags(parser: argparse.ArgumentParser, *, scaler: bool = False) -> None:
    """The flags that reach a server: ``scaler`` for a command that asks KEDA's questions (a gateway or an agent
    answers them), else one that drives an agent's fake GPUs."""
    address_help = (
        "the gateway's or an agent's HOST:PORT, as a ScaledObject's scalerAddress names it (default "
        "127.0.0.1:6000: the dev stack's gateway)"
        if scaler
        else "an agent's HOST:PORT, one started with --collector fake (default 127.0.0.1:6000; the dev stack's "
        "agents are 127.0.0.1:6001 to 6003)"
    )
    parser.add_argument("--address", default="127.0.0.1:6000", help=address_help)
    parser.add_argument("--tls-ca", type=Path, help="PEM CA bundle to verify the server; turns TLS on")
    parser.add_argument("--tls-cert", type=Path, help="PEM client certificate, for mTLS")
    parser.add_argument("--tls-key", type=Path, help="PEM private key of --tls-cert")
    parser.add_argument("--tls-server-name", help="name to verify in the server's certificate")


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    """Run one ``gpuscaler`` command; the exit status is 0, 1 when it failed, 2 for a bad flag and 130 on Ctrl-C."""
    environ = os.environ if environ is None else environ
    parser = build_parser(environ)
    args = parser.parse_args(argv)
    try:
        if args.command == "serve":
            return _serve(args, environ)
        if args.command == "gateway":
            return _gateway(args, environ)
        if args.command == "version":
            print(f"gpuscaler {__version__}")
            return 0
        return asyncio.run(_client_command(args))
    except ConfigError as error:
        parser.exit(2, f"{_prog(args)}: error: {error}\n")
    except (CollectorUnavailable, StartupError) as error:
        print(f"gpuscaler {args.command}: {error}", file=sys.stderr)
        return 1
    except GRPCError as error:
        print(f"{_prog(args)}: {error.status.name}: {error.message}", file=sys.stderr)
        return 1
    except (OSError, TimeoutError, StreamTerminatedError, ProtocolError) as error:
        if args.command in ("serve", "gateway"):
            raise  # not a connection of ours: keep the traceback
        reason = _unreachable(error, tls=_client_options(args).tls, fake=args.command == "fake")
        print(f"{_prog(args)}: cannot reach {args.address}: {reason}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def _gateway(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    from gpuscaler.gateway.process import run_gateway

    settings = gateway_settings_from_args(args, environ)
    logs.configure(log_format=settings.server.log_format, level=settings.server.log_level)
    gc.freeze()  # as for serve: the imports' objects live as long as the process
    # A gateway makes and frees thousands of objects per agent snapshot, all freed by reference counting;
    # the cycle collector's default (a young collection every 700 allocations) ran hundreds of times a
    # second for nothing: about 7% of its CPU at 1,000 agents (bench.gateway, alternating runs).
    gc.set_threshold(GATEWAY_GC_YOUNG_THRESHOLD, 50, 50)
    return asyncio.run(run_gateway(settings))


def _prog(args: argparse.Namespace) -> str:
    """The command as typed, for error lines: ``gpuscaler fake set``."""
    return " ".join(["gpuscaler", args.command, *([args.fake_command] if args.command == "fake" else [])])


def _unreachable(error: BaseException, *, tls: bool, fake: bool) -> str:
    """Why a client command got no answer, and what to check; never a bare exception repr. The server is a
    gateway or an agent for ``query``, an agent with fake GPUs for ``fake``."""
    if isinstance(error, ssl.SSLCertVerificationError):
        return (
            f"the server's certificate does not verify ({error.verify_message}); give the CA that signed it "
            "with --tls-ca, and --tls-server-name when the address is not a name in the certificate"
        )
    if isinstance(error, ssl.SSLError):
        if error.reason == "WRONG_VERSION_NUMBER":
            return "the server there does not speak TLS; drop --tls-ca, --tls-cert and --tls-key"
        return f"TLS handshake failed ({error.reason or error}); check --tls-ca, --tls-cert and --tls-key"
    if isinstance(error, ConnectionRefusedError):
        if fake:
            return (
                "connection refused; is an agent with --collector fake (`gpuscaler serve`) running there, and is "
                "this its --listen port? make dev's agents are 127.0.0.1:6001 to 6003"
            )
        return (
            "connection refused; is a gateway (`gpuscaler gateway`) or an agent (`gpuscaler serve`) running there, "
            "and is this its --listen port? The default, 127.0.0.1:6000, is make dev's gateway"
        )
    if isinstance(error, TimeoutError):
        return f"no answer within {CLIENT_TIMEOUT_SECONDS:g}s"
    if isinstance(error, StreamTerminatedError | ProtocolError):
        if tls:
            return (
                "the server closed the connection; if it requires client certificates, give --tls-cert and "
                "--tls-key signed by its --tls-client-ca"
            )
        return (
            "the connection closed before an answer; if the server serves TLS, give --tls-ca (and --tls-cert, "
            "--tls-key for mTLS); check that this is its gRPC port, not /metrics"
        )
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    return str(error) or type(error).__name__


def _serve(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    from gpuscaler.agent.process import serve

    settings = settings_from_args(args, environ)
    logs.configure(log_format=settings.server.log_format, level=settings.server.log_level, node=settings.node_name)
    # The ~35,000 objects made by the imports (modules, classes, functions) live as long as the process;
    # left in the collector, every full collection walks them again: 0.1-0.2 s each on the 2-core machine
    # under GetMetrics load. Frozen, the collector leaves them alone.
    gc.freeze()
    # A full collection walks every push stream's ~80 objects: 0.1-0.4 s at 10,000. At the default (one per 70,000
    # objects kept) 10,000 streams opening made 8 such pauses, the good caller's slowest answers; now at most one.
    # Cyclic garbage left in the old generation waits at most 700,000 kept objects (docs/security.md).
    young, middle, _ = gc.get_threshold()
    gc.set_threshold(young, middle, AGENT_GC_FULL_THRESHOLD)
    return asyncio.run(serve(settings))


def _client_options(args: argparse.Namespace) -> ClientOptions:
    from gpuscaler.client.channels import ClientOptions, client_address

    return ClientOptions(
        address=client_address(args.address),
        tls_ca=args.tls_ca,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        server_name=args.tls_server_name,
    )


async def _client_command(args: argparse.Namespace) -> int:
    from gpuscaler.client.channels import open_channel

    options = _client_options(args)
    async with open_channel(options) as channel:
        if args.command == "query":
            return await _query(args, channel)
        return await _fake(args, channel)


async def _query(args: argparse.Namespace, channel: Channel) -> int:
    from rich.console import Console
    from rich.live import Live

    from gpuscaler.client.explain import DEFAULT_SCALED_OBJECT, Report, collect
    from gpuscaler.client.render import render_table, report_renderable

    metadata = dict(_pairs(args.metadata, "KEY=VALUE"))
    if args.replicas < 1:
        raise ConfigError(f"--replicas {args.replicas}: the HPA's arithmetic needs at least 1 current replica")
    if args.watch is not None and not 0.1 <= args.watch <= 3600:
        raise ConfigError(f"--watch {args.watch:g}: refresh between 0.1 and 3600 seconds")
    scaled_object = _scaled_object(args.scaled_object) if args.scaled_object is not None else DEFAULT_SCALED_OBJECT
    console = Console()

    async def report_now() -> Report:
        return await collect(channel, metadata, current_replicas=args.replicas, scaled_object=scaled_object)

    if args.watch is None:
        report = await report_now()
        if args.output == "json":
            print(report.to_json())
        else:
            render_table(report, console)
        return 0 if report.get_metrics.ok else 1
    live = Live(console=console, auto_refresh=False) if args.output == "table" and console.is_terminal else None

    def show(report: Report) -> None:
        if args.output == "json":  # one JSON document per line, for jq and logs
            print(report.to_json(indent=None), flush=True)
        elif live is not None:  # a terminal: redrawn in place
            live.update(report_renderable(report, width=console.width), refresh=True)
        else:  # a pipe or a file, which Live would write only at the end: each answer in full, under its time
            console.rule(datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"))
            render_table(report, console)
            console.file.flush()

    with live if live is not None else contextlib.nullcontext():
        return await _watch(args.watch, report_now, show)


async def _watch(seconds: float, ask: Callable[[], Awaitable[T]], show: Callable[[T], None]) -> int:
    """Show an answer every ``seconds`` until SIGTERM, which ends the watch with 0 after what it showed was written
    (the default action would kill the process with a pipe's buffer unwritten); Ctrl-C is ``main``'s 130."""
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None
    terminated = False

    def terminate() -> None:
        nonlocal terminated
        terminated = True
        task.cancel()

    loop.add_signal_handler(signal.SIGTERM, terminate)
    try:
        while True:
            show(await ask())
            await asyncio.sleep(seconds)
    except asyncio.CancelledError:
        if not terminated:
            raise
        task.uncancel()
        return 0
    finally:
        loop.remove_signal_handler(signal.SIGTERM)


async def _fake(args: argparse.Namespace, channel: Channel) -> int:
    try:
        return await _drive_fake(args, channel)
    except GRPCError as error:
        # An agent without fake GPUs does not serve FakeControl: UNIMPLEMENTED (older agents
        # answered without a content-type, which grpclib's client reports as UNKNOWN).
        unknown_method = error.status is Status.UNIMPLEMENTED or (
            error.status is Status.UNKNOWN and "content-type" in (error.message or "")
        )
        if not unknown_method:
            raise
        message = (
            f"{args.address} has no fake GPUs: `gpuscaler fake` drives an agent started with `--collector fake`, "
            "and a gateway or an NVML agent has none (in `make dev`, 127.0.0.1:6000 is the gateway and the "
            "agents are 127.0.0.1:6001 to 6003: pass --address)"
        )
        raise GRPCError(Status.UNIMPLEMENTED, message) from None


async def _drive_fake(args: argparse.Namespace, channel: Channel) -> int:
    control = pb.FakeControlStub(channel)
    if args.fake_command == "set":
        updates = {name: _float(name, text) for name, text in _pairs(args.values, "METRIC=VALUE")}
        state = await control.set(
            pb.SetRequest(gpu=_selector(args.gpu), values=updates), timeout=CLIENT_TIMEOUT_SECONDS
        )
    elif args.fake_command == "fail":
        state = await control.fail(
            pb.FailRequest(index=_index(args.gpu), failure=FAILURES[args.error]),
            timeout=CLIENT_TIMEOUT_SECONDS,
        )
    else:
        state = await control.heal(pb.HealRequest(gpu=_selector(args.gpu)), timeout=CLIENT_TIMEOUT_SECONDS)
    for gpu in state.gpus:
        failure = "" if gpu.failure == pb.FakeFailure.UNSPECIFIED else f" failing={gpu.failure.name.lower()}"
        values = " ".join(f"{name}={value:g}" for name, value in sorted(gpu.values.items()))
        print(f"gpu {gpu.index} {gpu.uuid}{failure} {values}")
    return 0


_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")


def _scaled_object(text: str) -> tuple[str, str]:
    namespace, sep, name = text.partition("/")
    if not sep or not _NAME.match(namespace) or not _NAME.match(name):
        raise ConfigError(
            f"--scaled-object {text!r}: use NAMESPACE/NAME of a ScaledObject, lowercase letters, digits, '-' and '.'"
        )
    return namespace, name


def _pairs(items: Sequence[str], form: str) -> list[tuple[str, str]]:
    pairs = []
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"{item!r} is not {form}")
        pairs.append((key, value))
    return pairs


def _float(name: str, text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ConfigError(f"{name}={text!r}: the value must be a number") from None


def _index(text: str) -> int:
    if not text.isdigit():
        raise ConfigError(f"--gpu {text!r}: use a GPU index (0, 1, ...)")
    return int(text)


def _selector(text: str) -> pb.GpuSelector:
    return pb.GpuSelector(all=True) if text == "all" else pb.GpuSelector(index=_index(text))
