"""``python -m bench [NAME...]``: run the agent's benchmarks, write ``bench/results/<name>.json``, print tables.

Names: push, unary, idle, startup (all four by default); compare (ours beside ``--command``, alternating
runs); gateway (``bench.gateway``, run on its own); and attacks (``bench.attacks``, issue 19's attacks on the
gRPC port, run on its own: ``python -m bench.attacks --quick`` for a short check). unary, idle and startup
measure our agent unless ``--command`` (a server to start, with ``{port}`` where it listens) or ``--address``
(unary only: a server already running) names another ExternalScaler server.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Callable, Coroutine
from types import ModuleType
from typing import Any

from bench import compare, idle, push, startup, unary
from bench.common import write_result
from bench.harness import Bench, Options, bench_folder
from bench.target import OURS_NAME, Target, python_bytecode

BENCHES: dict[str, ModuleType] = {"push": push, "unary": unary, "idle": idle, "startup": startup}
OTHERS = ("compare", "gateway", "attacks")


def _numbers(kind: Callable[[str], Any]) -> Callable[[str], tuple[Any, ...]]:
    def parse(text: str) -> tuple[Any, ...]:
        return tuple(kind(item) for item in text.split(","))

    return parse


def _pair(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE")
    return key, value


def main(argv: list[str] | None = None) -> int:
    """Run the named benchmarks (push, unary, idle and startup by default), write each result file, print its table."""
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    parser.add_argument(
        "names", nargs="*", metavar="NAME", help="push, unary, idle, startup, compare, gateway, attacks"
    )
    defaults = Options()
    parser.add_argument("--tries", type=int, default=defaults.tries, help="push and start-up samples (20)")
    parser.add_argument("--seconds", type=float, default=defaults.seconds, help="seconds per unary cell (5)")
    parser.add_argument(
        "--idle-seconds", type=float, default=defaults.idle_seconds, help="seconds per idle CPU measurement (30)"
    )
    parser.add_argument("--command", help="start this server instead of ours; {port}: its gRPC port, {free_port}: any")
    parser.add_argument("--address", help="HOST:PORT of a running server to measure (unary only)")
    parser.add_argument("--name", help="label of the --command/--address server in results (its program name)")
    parser.add_argument(
        "--metadata", type=_pair, action="append", metavar="KEY=VALUE", help="trigger metadata (gpuIndex=0)"
    )
    parser.add_argument("--streams", type=_numbers(int), default=defaults.streams, help="unary: 0,1000,10000")
    parser.add_argument("--callers", type=_numbers(int), default=defaults.callers, help="unary: 1,10,50")
    parser.add_argument("--poll-intervals", type=_numbers(float), default=defaults.poll_intervals, help="push")
    parser.add_argument("--rounds", type=int, default=3, help="compare: rounds of alternating runs (3)")
    parser.add_argument("--output", help="result file name without .json (default: the benchmark's name)")
    args = parser.parse_args(argv)
    names = args.names or list(BENCHES)
    unknown = [name for name in names if name not in (*BENCHES, *OTHERS)]
    if unknown:
        parser.error(f"unknown benchmark {unknown[0]!r}; use: {', '.join([*BENCHES, *OTHERS])}")
    if args.output and len(names) > 1:
        parser.error("--output names one result file: run one benchmark")
    try:
        target = Target.from_options(
            name=args.name, command=args.command, address=args.address, metadata=dict(args.metadata or [])
        )
    except ValueError as error:
        parser.error(str(error))
    if "compare" in names and target.name == OURS_NAME:
        parser.error("compare needs --command: the server to measure beside ours")
    options = Options(
        tries=args.tries,
        seconds=args.seconds,
        idle_seconds=args.idle_seconds,
        target=target,
        streams=args.streams,
        callers=args.callers,
        poll_intervals=args.poll_intervals,
    )
    python_bytecode()

    with bench_folder() as bench:
        for name in names:
            if name in ("gateway", "attacks"):
                subprocess.run([sys.executable, "-m", f"bench.{name}"], check=True)
                continue
            started = time.monotonic()
            result = asyncio.run(_run(name, bench, options, args.rounds))
            result["bench_seconds"] = round(time.monotonic() - started, 1)
            default = name if target.name == OURS_NAME or name in ("push", "compare") else f"{name}-{target.name}"
            path = write_result(args.output or default, result)
            (compare if name == "compare" else BENCHES[name]).show(result)
            print(f"wrote {path.parent.name}/{path.name}\n")
    return 0


async def _run(name: str, bench: Bench, options: Options, rounds: int) -> dict[str, Any]:
    if name == "compare":
        return await compare.run(bench, options, rounds)
    run: Callable[[Bench, Options], Coroutine[Any, Any, dict[str, Any]]] = BENCHES[name].run
    if name == "push":
        return await run(bench, Options(tries=options.tries, poll_intervals=options.poll_intervals))
    return await run(bench, options)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
