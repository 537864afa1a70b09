"""The working tree beside an earlier commit (``--base``), alternating runs: the gateway's and the agent's CPU per call.

    .venv/bin/python -m bench.regression --base 71c1bd1 [--rounds 3] [--agents 2000] [--seconds 20] [--tries 3]

The base's code is checked out into a temporary detached git worktree (removed at the end, whatever
happens) and run by the servers this bench starts: each side's ``gpuscaler`` console script is started
through a small launcher that puts that side's source tree first on PYTHONPATH, which wins over the
editable install's path entry. Everything else (the simulated agents, the grpcio client, the timing,
the /proc readings) is this tree's bench code for both sides, so only the server under test differs.

Each round runs two measures on both sides, one right after the other, and swaps which side goes first
from round to round, so that load from elsewhere on the machine lands on both:

- the gateway bench (``bench.gateway``'s ``run``) over ``--agents`` simulated agents of 8 GPUs: its CPU
  per snapshot received and its RSS;
- the agent's unary path: ``gpuscaler serve --collector fake --fake-gpus 8`` on loopback, GetMetrics from
  1, 10 and 50 grpcio callers for ``--seconds`` each, the agent's CPU (utime + stime from /proc) over the
  calls divided by the calls answered, and the callers' median latency.

A figure is the median over the rounds; ``ratio`` is head / base; a CPU figure's goal is ratio <= 1.05
(issue 32). Writes bench/results/regression-<base>.json.

``--side-connection-interval S`` adds, to every unary cell, a second channel (its own connection) that makes one
GetMetrics every S seconds, as the other of KEDA's two components (operator and metrics adapter) does beside the
busy one: the shape a deployed agent sees. ``--variant NAME:SETTING[,SETTING...]`` adds the working tree once more,
as side NAME, with each SETTING applied in its launcher: ``GPUSCALER_X=V`` sets a variable, ``module.NAME=V`` a
module constant (an int or float) before ``gpuscaler`` runs; an experiment's knob, measured in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from bench import gateway
from bench.common import cpu_seconds, print_table, rss_mib, write_result
from bench.harness import Bench, bench_folder
from bench.target import Target, client, ours_command, running
from bench.unary import call_until
from e2e.support.clients import GrpcioScaler, Metadata, RpcFailure

REPOSITORY = Path(__file__).resolve().parents[1]
CONSOLE_SCRIPT = Path(sys.executable).with_name("gpuscaler")
SIDES = ("base", "head")  # the two that every run has; --variant adds more, each compared with the base
CPU_BOUND = 1.05  # head's CPU per call at most 5% over the base's
WARM_UP_SECONDS = 1.0  # calls before the measured ones: first-call costs (imports, caches) are not the path's


@dataclass(frozen=True, slots=True)
class Side:
    """One side of the comparison: the source tree its servers import ``gpuscaler`` from, and how they start."""

    name: str
    root: Path
    launcher: Path

    def target(self) -> Target:
        """Our agent with 8 fake GPUs, started through this side's launcher."""
        return Target(f"gpuscaler-{self.name}", (str(self.launcher), *ours_command()[1:]))


# The arithmetic


def figure(base: Sequence[float], head: Sequence[float], bound: float | None) -> dict[str, Any]:
    """Each side's median over the rounds, head / base, and whether that ratio meets ``bound`` (if there is one)."""
    base_median = round(statistics.median(base), 3)
    head_median = round(statistics.median(head), 3)
    ratio = round(head_median / base_median, 3) if base_median else None
    result: dict[str, Any] = {
        "base": base_median,
        "head": head_median,
        "ratio": ratio,
        "base_rounds": list(base),
        "head_rounds": list(head),
    }
    if bound is not None:
        result["goal"] = f"ratio <= {bound:g}"
        result["met"] = ratio is not None and ratio <= bound
    return result


def figures(rounds: dict[str, list[dict[str, float]]], head: str = "head") -> dict[str, dict[str, Any]]:
    """Every figure the rounds share, keyed as in each round's record, ``head`` (a side's name) against the base;
    CPU figures (``cpu`` in the key) get the goal."""
    keys = [
        key for key in rounds["base"][0] if all(key in record for side in ("base", head) for record in rounds[side])
    ]
    return {
        key: figure(
            [record[key] for record in rounds["base"]],
            [record[key] for record in rounds[head]],
            CPU_BOUND if "cpu" in key else None,
        )
        for key in keys
    }


# The two sides


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPOSITORY, check=True, capture_output=True, text=True).stdout.strip()


def _launcher(folder: Path, side: str, root: Path, settings: Sequence[str] = ()) -> Path:
    """A script that runs the console script with ``root`` first on PYTHONPATH (``exec``: /proc reads its pid),
    and with ``settings`` (``--variant``'s): variables set, and module constants set before ``gpuscaler`` runs."""
    path = folder / f"gpuscaler-{side}"
    environ = " ".join(shlex.quote(item) for item in settings if "." not in item.split("=", 1)[0])
    constants = [item.split("=", 1) for item in settings if "." in item.split("=", 1)[0]]
    if constants:
        lines = ["import importlib, sys", f"sys.argv[0] = {str(CONSOLE_SCRIPT)!r}"]
        for name, value in constants:
            module, attribute = name.rsplit(".", 1)
            lines.append(f"setattr(importlib.import_module({module!r}), {attribute!r}, {value})")
        lines.append("from gpuscaler.cli import main; sys.exit(main())")
        command = f"{shlex.quote(sys.executable)} -c {shlex.quote('; '.join(lines))}"
    else:
        command = shlex.quote(str(CONSOLE_SCRIPT))
    path.write_text(
        f'#!/bin/sh\n{environ} PYTHONPATH={shlex.quote(str(root))} exec {command} "$@"\n',
        encoding="utf-8",
    )
    path.chmod(0o755)
    return path


def imported_from(side: Side) -> Path:
    """Where a process started as the console script is under this side's environment imports ``gpuscaler`` from.

    A script's first path entry is its own folder (not the working directory, as with ``-c``): set it so.
    """
    code = f"import sys; sys.path[0] = {str(CONSOLE_SCRIPT.parent)!r}; import gpuscaler; print(gpuscaler.__file__)"
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "PYTHONPATH": str(side.root)},
        cwd=tempfile.gettempdir(),
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    return Path(out).resolve()


@contextlib.contextmanager
def sides(base: str, variants: dict[str, tuple[str, ...]] | None = None) -> Iterator[dict[str, Side]]:
    """The base commit in a temporary detached worktree and this working tree, each with its launcher, and the
    working tree again for each of ``variants`` with its settings; the worktree is removed at the end, whatever
    happened."""
    folder = Path(tempfile.mkdtemp(prefix="gpuscaler-regression-"))
    worktree = folder / "base"
    try:
        _git("worktree", "add", "--detach", "--quiet", str(worktree), base)
        result = {
            "base": Side("base", worktree, _launcher(folder, "base", worktree)),
            "head": Side("head", REPOSITORY, _launcher(folder, "head", REPOSITORY)),
        }
        for name, settings in (variants or {}).items():
            result[name] = Side(name, REPOSITORY, _launcher(folder, name, REPOSITORY, settings))
        for side in result.values():
            found = imported_from(side)
            if not found.is_relative_to(side.root.resolve()):
                raise RuntimeError(f"the {side.name} side imports gpuscaler from {found}, not from {side.root}")
            # Compiled once, as installing the wheel does: no side compiles its modules at each start.
            subprocess.run([sys.executable, "-m", "compileall", "-q", str(side.root / "gpuscaler")], check=True)
        yield result
    finally:
        with contextlib.suppress(subprocess.CalledProcessError):
            _git("worktree", "remove", "--force", str(worktree))
        shutil.rmtree(folder, ignore_errors=True)
        with contextlib.suppress(subprocess.CalledProcessError):
            _git("worktree", "prune")


@contextlib.contextmanager
def gateway_started_by(side: Side) -> Iterator[None]:
    """``bench.gateway`` starts the gateway as its module's CONSOLE_SCRIPT: this side's launcher, for the block."""
    before = gateway.CONSOLE_SCRIPT
    gateway.CONSOLE_SCRIPT = side.launcher
    try:
        yield
    finally:
        gateway.CONSOLE_SCRIPT = before


# The measures


async def measure_gateway(side: Side, args: argparse.Namespace) -> dict[str, Any]:
    """The gateway bench over ``--agents`` simulated agents, this side's gateway; its whole result."""
    options = argparse.Namespace(agents=args.agents, gpus=8, poll=0.5, seconds=args.seconds, tries=args.tries)
    with gateway_started_by(side):
        return await gateway.run(options)


async def call_every(
    scaler: GrpcioScaler,
    query: Metadata,
    metric_name: str,
    deadline: float,
    args: argparse.Namespace,
    latencies: list[float],
    errors: Counter[str],
) -> None:
    """The side connection: one GetMetrics every ``--side-connection-interval`` seconds until ``deadline``."""
    while time.monotonic() < deadline:
        started = time.monotonic()
        try:
            await scaler.get_metrics(query, metric_name)
        except RpcFailure as failure:
            errors[f"side {failure.code}"] += 1
        else:
            latencies.append(time.monotonic() - started)
        await asyncio.sleep(args.side_connection_interval)


async def measure_unary(bench: Bench, side: Side, args: argparse.Namespace) -> dict[str, Any]:
    """GetMetrics from 1, 10 and 50 grpcio callers on one channel (and, with ``--side-connection-interval``, one
    call every so often on a second connection): the agent's CPU per call answered, and latency."""
    target = side.target()
    rows = []
    async with contextlib.AsyncExitStack() as stack:
        server = await stack.enter_async_context(running(target, bench.folder))
        scaler = await stack.enter_async_context(client(server, bench.proto))
        side_scaler = None
        if args.side_connection_interval:
            # Its own subchannel pool: grpcio would otherwise share the first channel's connection.
            channel = grpc.aio.insecure_channel(server.address, options=[("grpc.use_local_subchannel_pool", 1)])
            side_scaler = GrpcioScaler(channel, bench.proto)
            stack.push_async_callback(side_scaler.close)
        assert server.pid is not None
        environ = Path(f"/proc/{server.pid}/environ").read_bytes().split(b"\0")  # noqa: ASYNC240 - a small /proc file
        if f"PYTHONPATH={side.root}".encode() not in environ:
            raise RuntimeError(f"the {side.name} agent (pid {server.pid}) does not run with {side.root} on PYTHONPATH")
        [spec] = await scaler.get_metric_spec(target.query)
        await call_until(scaler, target.query, spec.metric_name, time.monotonic() + WARM_UP_SECONDS, [], Counter())
        if side_scaler is not None:
            await side_scaler.get_metrics(target.query, spec.metric_name)  # its connection made before the cells
        for callers in args.callers:
            latencies: list[float] = []
            errors: Counter[str] = Counter()
            side_latencies: list[float] = []
            cpu_before, started = cpu_seconds(server.pid), time.monotonic()
            deadline = started + args.seconds
            await asyncio.gather(
                *(
                    call_until(scaler, target.query, spec.metric_name, deadline, latencies, errors)
                    for _ in range(callers)
                ),
                *(
                    [call_every(side_scaler, target.query, spec.metric_name, deadline, args, side_latencies, errors)]
                    if side_scaler is not None
                    else []
                ),
            )
            cpu_used, elapsed = cpu_seconds(server.pid) - cpu_before, time.monotonic() - started
            calls = len(latencies) + len(side_latencies)
            rows.append(
                {
                    "callers": callers,
                    "calls": len(latencies),
                    "calls_per_second": round(len(latencies) / elapsed, 1),
                    "cpu_us_per_call": round(1e6 * cpu_used / calls, 1) if latencies else None,
                    "median_ms": round(1000 * statistics.median(latencies), 3) if latencies else None,
                    **(
                        {
                            "side_calls": len(side_latencies),
                            "side_median_ms": round(1000 * statistics.median(side_latencies), 3),
                            "side_max_ms": round(1000 * max(side_latencies), 3),
                        }
                        if side_latencies
                        else {}
                    ),
                    "errors": dict(errors),
                }
            )
        rss = rss_mib(server.pid)
    return {"rows": rows, "rss_mib": round(rss, 1)}


def round_figures(record: dict[str, Any]) -> dict[str, float]:
    """One round's figures for one side, from its raw results."""
    result: dict[str, float] = {}
    if "gateway" in record:
        result["gateway_cpu_us_per_snapshot"] = float(record["gateway"]["gateway_cpu_us_per_snapshot"])
        result["gateway_rss_mib"] = float(record["gateway"]["gateway_rss_mib"])
    if "unary" in record:
        for row in record["unary"]["rows"]:
            if row["cpu_us_per_call"] is not None:
                result[f"unary_cpu_us_per_call_callers_{row['callers']}"] = float(row["cpu_us_per_call"])
                result[f"unary_p50_ms_callers_{row['callers']}"] = float(row["median_ms"])
        result["unary_agent_rss_mib"] = float(record["unary"]["rss_mib"])
    return result


async def run(args: argparse.Namespace, both: dict[str, Side]) -> dict[str, Any]:
    """Every measure on both sides, alternating which goes first, ``--rounds`` times."""
    names = list(both)  # base, head, then each --variant
    raw: dict[str, list[dict[str, Any]]] = {side: [] for side in names}
    with bench_folder() as bench:
        for number in range(args.rounds):
            order = names if number % 2 == 0 else list(reversed(names))
            records: dict[str, dict[str, Any]] = {side: {} for side in names}
            for measure in args.measures:
                for name in order:
                    print(f"round {number + 1}/{args.rounds}: {measure} of {name}", flush=True)
                    side = both[name]
                    started = time.monotonic()
                    if measure == "gateway":
                        records[name]["gateway"] = await measure_gateway(side, args)
                    else:
                        records[name]["unary"] = await measure_unary(bench, side, args)
                    records[name][measure]["wall_seconds"] = round(time.monotonic() - started, 1)
            for name in names:
                raw[name].append({"round": number + 1, "first": order[0] == name, **records[name]})
    per_round = {name: [round_figures(record) for record in raw[name]] for name in names}
    variants = {name: figures(per_round, name) for name in names if name not in SIDES}
    return {"figures": figures(per_round), **({"variant_figures": variants} if variants else {}), "raw": raw}


def show(result: dict[str, Any]) -> None:
    """Print each figure for both sides, their ratio, its goal, and whether it was met; each variant's the same."""
    for name, found in result.get("variant_figures", {}).items():
        print_table(
            f"variant {name} ({', '.join(result['variants'][name])}) beside base",
            ["figure", "base", name, "ratio"],
            [
                (_label(key), f["base"], f["head"], "-" if f["ratio"] is None else f["ratio"])
                for key, f in found.items()
            ],
        )
    print_table(
        f"head ({result['head']['commit'][:7]}) beside base ({result['base']['commit'][:7]}), "
        f"medians of {result['rounds']} rounds",
        ["figure", "base", "head", "head/base", "goal", "met"],
        [
            (
                _label(key),
                f["base"],
                f["head"],
                "-" if f["ratio"] is None else f["ratio"],
                f.get("goal", "-"),
                f.get("met", "-"),
            )
            for key, f in result["figures"].items()
        ],
    )


def _label(key: str) -> str:
    """A figure's key, short enough for an 80-column table."""
    for long, short in (("gateway_", "gw "), ("unary_", "unary "), ("_callers_", " x"), ("_per_", "/"), ("_", " ")):
        key = key.replace(long, short)
    return key


def _numbers(text: str) -> tuple[int, ...]:
    return tuple(int(item) for item in text.split(","))


def main(argv: list[str] | None = None) -> int:
    """Compare the working tree with ``--base`` and write bench/results/regression-<base>.json."""
    parser = argparse.ArgumentParser(prog="python -m bench.regression", description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="the commit to compare with (e.g. 71c1bd1)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of alternating runs (3)")
    parser.add_argument("--agents", type=int, default=2000, help="simulated agents of 8 GPUs under the gateway (2000)")
    parser.add_argument(
        "--seconds", type=float, default=20, help="seconds of CPU measured per gateway run and unary cell"
    )
    parser.add_argument("--tries", type=int, default=3, help="push latency tries per gateway run (3)")
    parser.add_argument("--callers", type=_numbers, default=(1, 10, 50), help="unary callers (1,10,50)")
    parser.add_argument(
        "--measures", type=lambda text: tuple(text.split(",")), default=("gateway", "unary"), help="gateway,unary"
    )
    parser.add_argument(
        "--side-connection-interval",
        type=float,
        default=0.0,
        help="seconds between calls on a second connection beside the unary callers, as KEDA's other component (off)",
    )
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME:SETTING[,SETTING]",
        help="the working tree again as side NAME with GPUSCALER_X=V variables or module.NAME=V constants set",
    )
    parser.add_argument("--output", help="result file name without .json (default: regression-<base>)")
    args = parser.parse_args(argv)
    variants: dict[str, tuple[str, ...]] = {}
    for text in args.variant:
        name, _, settings = text.partition(":")
        if not name or name in SIDES or name in variants or not re.fullmatch(r"[A-Za-z0-9_-]+", name):
            parser.error(f"--variant: {text!r} needs a new name of letters, digits, - and _ before ':'")
        items = tuple(item for item in settings.split(",") if item)
        if not items or not all(re.fullmatch(r"[A-Za-z_][\w.]*=[\w.+-]+", item) for item in items):
            parser.error(f"--variant: {text!r} needs settings NAME=VALUE (a GPUSCALER_ variable or module.CONSTANT)")
        variants[name] = items
    if args.side_connection_interval < 0:
        parser.error(f"--side-connection-interval: {args.side_connection_interval} must be 0 (off) or more")
    if args.rounds < 1 or args.agents < 1 or args.seconds <= 0 or args.tries < 1:
        parser.error("--rounds, --agents and --tries must be at least 1 and --seconds above 0")
    unknown = [measure for measure in args.measures if measure not in ("gateway", "unary")]
    if unknown:
        parser.error(f"--measures: {unknown[0]!r} is not a measure; use gateway, unary or both")
    try:
        base_commit = _git("rev-parse", "--verify", f"{args.base}^{{commit}}")
    except subprocess.CalledProcessError:
        parser.error(f"--base: {args.base!r} is not a commit of this repository")
    head_commit = _git("rev-parse", "HEAD")
    dirty = bool(_git("status", "--porcelain", "--untracked-files=no"))
    load_before = [round(load, 2) for load in os.getloadavg()]
    started = time.monotonic()
    with sides(base_commit, variants) as both:
        measured = asyncio.run(run(args, both))
    result = {
        "benchmark": "the working tree beside --base, alternating runs, medians over rounds; ratio is head / base",
        "base": {"given": args.base, "commit": base_commit},
        "head": {"commit": head_commit, "dirty": dirty, "measured": "the working tree"},
        "rounds": args.rounds,
        "agents": args.agents,
        "seconds": args.seconds,
        "push_tries_per_gateway_run": args.tries,
        "callers": list(args.callers),
        "side_connection_interval_seconds": args.side_connection_interval or None,
        "variants": {name: list(items) for name, items in variants.items()},
        "load_average_before": load_before,
        "load_average_after": [round(load, 2) for load in os.getloadavg()],
        "bench_seconds": round(time.monotonic() - started, 1),
        **measured,
    }
    path = write_result(args.output or f"regression-{base_commit[:7]}", result)
    show(result)
    print(
        f"wrote {path.parent.name}/{path.name}; load average before {load_before}, after {result['load_average_after']}"
    )
    return 0 if all(f.get("met", True) for f in result["figures"].values()) else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
