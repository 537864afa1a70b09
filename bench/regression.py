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
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
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

from bench import gateway
from bench.common import cpu_seconds, print_table, rss_mib, write_result
from bench.harness import Bench, bench_folder
from bench.target import Target, client, ours_command, running
from bench.unary import call_until

REPOSITORY = Path(__file__).resolve().parents[1]
CONSOLE_SCRIPT = Path(sys.executable).with_name("gpuscaler")
SIDES = ("base", "head")
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


def figures(rounds: dict[str, list[dict[str, float]]]) -> dict[str, dict[str, Any]]:
    """Every figure the rounds share, keyed as in each round's record; CPU figures (``cpu`` in the key) get the goal."""
    keys = [key for key in rounds["base"][0] if all(key in record for side in SIDES for record in rounds[side])]
    return {
        key: figure(
            [record[key] for record in rounds["base"]],
            [record[key] for record in rounds["head"]],
            CPU_BOUND if "cpu" in key else None,
        )
        for key in keys
    }


# The two sides


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPOSITORY, check=True, capture_output=True, text=True).stdout.strip()


def _launcher(folder: Path, side: str, root: Path) -> Path:
    """A script that runs the console script with ``root`` first on PYTHONPATH (``exec``: /proc reads its pid)."""
    path = folder / f"gpuscaler-{side}"
    path.write_text(
        f'#!/bin/sh\nPYTHONPATH={shlex.quote(str(root))} exec {shlex.quote(str(CONSOLE_SCRIPT))} "$@"\n',
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
def sides(base: str) -> Iterator[dict[str, Side]]:
    """The base commit in a temporary detached worktree and this working tree, each with its launcher; the
    worktree is removed at the end, whatever happened."""
    folder = Path(tempfile.mkdtemp(prefix="gpuscaler-regression-"))
    worktree = folder / "base"
    try:
        _git("worktree", "add", "--detach", "--quiet", str(worktree), base)
        result = {
            "base": Side("base", worktree, _launcher(folder, "base", worktree)),
            "head": Side("head", REPOSITORY, _launcher(folder, "head", REPOSITORY)),
        }
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


async def measure_unary(bench: Bench, side: Side, args: argparse.Namespace) -> dict[str, Any]:
    """GetMetrics from 1, 10 and 50 grpcio callers on one channel: the agent's CPU per call answered, and latency."""
    target = side.target()
    rows = []
    async with running(target, bench.folder) as server, client(server, bench.proto) as scaler:
        assert server.pid is not None
        environ = Path(f"/proc/{server.pid}/environ").read_bytes().split(b"\0")  # noqa: ASYNC240 - a small /proc file
        if f"PYTHONPATH={side.root}".encode() not in environ:
            raise RuntimeError(f"the {side.name} agent (pid {server.pid}) does not run with {side.root} on PYTHONPATH")
        [spec] = await scaler.get_metric_spec(target.query)
        await call_until(scaler, target.query, spec.metric_name, time.monotonic() + WARM_UP_SECONDS, [], Counter())
        for callers in args.callers:
            latencies: list[float] = []
            errors: Counter[str] = Counter()
            cpu_before, started = cpu_seconds(server.pid), time.monotonic()
            deadline = started + args.seconds
            await asyncio.gather(
                *(
                    call_until(scaler, target.query, spec.metric_name, deadline, latencies, errors)
                    for _ in range(callers)
                )
            )
            cpu_used, elapsed = cpu_seconds(server.pid) - cpu_before, time.monotonic() - started
            rows.append(
                {
                    "callers": callers,
                    "calls": len(latencies),
                    "calls_per_second": round(len(latencies) / elapsed, 1),
                    "cpu_us_per_call": round(1e6 * cpu_used / len(latencies), 1) if latencies else None,
                    "median_ms": round(1000 * statistics.median(latencies), 3) if latencies else None,
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
    raw: dict[str, list[dict[str, Any]]] = {side: [] for side in SIDES}
    with bench_folder() as bench:
        for number in range(args.rounds):
            order = list(SIDES) if number % 2 == 0 else list(reversed(SIDES))
            records: dict[str, dict[str, Any]] = {side: {} for side in SIDES}
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
            for name in SIDES:
                raw[name].append({"round": number + 1, "first": order[0] == name, **records[name]})
    per_round = {name: [round_figures(record) for record in raw[name]] for name in SIDES}
    return {"figures": figures(per_round), "raw": raw}


def show(result: dict[str, Any]) -> None:
    """Print each figure for both sides, their ratio, its goal, and whether it was met."""
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
    parser.add_argument("--output", help="result file name without .json (default: regression-<base>)")
    args = parser.parse_args(argv)
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
    with sides(base_commit) as both:
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
