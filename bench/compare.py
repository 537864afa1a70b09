"""Our agent beside another ExternalScaler server (``--command``), alternating runs: the agent figures of issue 12.

Each round runs every measure on both servers, one right after the other, and swaps which goes first
from round to round, so that a burst of load from elsewhere on the machine hits both sides alike.
A figure is the median over the rounds of each round's figure; ``ratio`` is ours / theirs. Push
latency is ours only: it needs fake GPUs that change, and the prior art's mock GPUs never change.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import statistics
from collections.abc import Callable
from typing import Any

from bench import idle, push, startup, unary
from bench.common import percentile, print_table
from bench.harness import Bench, Options
from bench.target import Target

PUSH_POLL_SECONDS = 0.5  # the agent's default --poll-interval
IDLE_SECONDS = 10.0  # enough for the RSS to settle; CPU at rest is the idle bench's business

# figure -> (what it is, what the goal compares: "ratio" or "ours", "<=" or ">=", the bound)
GOALS: dict[str, tuple[str, str, str, float]] = {
    "getmetrics_p50_ms_callers_1": ("GetMetrics p50, 1 caller, no streams", "ratio", "<=", 1.5),
    "getmetrics_p50_ms_callers_10": ("GetMetrics p50, 10 callers, no streams", "ratio", "<=", 3.0),
    "getmetrics_p50_ms_callers_50": ("GetMetrics p50, 50 callers, no streams", "ratio", "<=", 4.0),
    "getmetrics_calls_per_second_callers_50": ("GetMetrics calls/s, 50 callers", "ratio", ">=", 0.3),
    "getmetrics_p50_streams_1000_over_none": ("GetMetrics p50, 1,000 streams / none", "ours", "<=", 1.1),
    "getmetrics_p50_streams_10000_over_none": ("GetMetrics p50, 10,000 streams / none", "ours", "<=", 2.0),
    "start_to_serving_ms": ("start to SERVING, median", "ours", "<=", 300.0),
    "idle_rss_mib": ("idle RSS, 8 GPUs", "ours", "<=", 35.0),
    "push_p99_ms_poll_0_5": ("push latency p99 at poll 0.5 s", "ours", "<=", 1000 * PUSH_POLL_SECONDS + 20),
}


def _per_round(record: dict[str, Any]) -> dict[str, float]:
    """One round's figures for one server, from its raw results."""
    results = record["unary"]

    def p50(streams: int, callers: int) -> float:
        return float(unary.row(results, streams, callers)["median_ms"])

    figures = {f"getmetrics_p50_ms_callers_{c}": p50(0, c) for c in (1, 10, 50)}
    figures["getmetrics_calls_per_second_callers_50"] = float(unary.row(results, 0, 50)["calls_per_second"])
    for streams in (1_000, 10_000):
        figures[f"getmetrics_p50_streams_{streams}_over_none"] = round(p50(streams, 1) / p50(0, 1), 3)
    figures["start_to_serving_ms"] = float(record["startup"]["start_to_serving"]["median_ms"])
    figures["idle_rss_mib"] = float(record["idle"]["rows"][0]["rss_mib"])
    return figures


async def run(bench: Bench, options: Options, rounds: int) -> dict[str, Any]:
    """Every measure of both servers, alternating which goes first, ``rounds`` times; medians and the goals met."""
    theirs = options.target
    if not theirs.startable:
        raise ValueError("compare needs --command: the other server, started by the benchmark")
    ours = Target.ours(theirs.query)
    measures: list[tuple[str, Callable[[Bench, Options], Any]]] = [
        ("startup", startup.run),
        ("idle", functools.partial(idle.run, at_rest_only=True)),
        ("unary", unary.run),
    ]
    raw: dict[str, list[dict[str, Any]]] = {"ours": [], "theirs": []}
    push_samples: list[float] = []
    for number in range(rounds):
        sides = [("ours", ours), ("theirs", theirs)]
        if number % 2:
            sides.reverse()
        records: dict[str, dict[str, Any]] = {"ours": {}, "theirs": {}}
        for name, measure in measures:
            for side, target in sides:
                side_options = dataclasses.replace(options, target=target, idle_seconds=IDLE_SECONDS)
                print(f"round {number + 1}/{rounds}: {name} of {target.name}", flush=True)
                records[side][name] = await measure(bench, side_options)
        push_samples += await push.latencies(bench, PUSH_POLL_SECONDS, options.tries)
        for side in raw:
            raw[side].append({"round": number + 1, "first": sides[0][0] == side, **records[side]})

    per_round = {side: [_per_round(record) for record in raw[side]] for side in raw}
    figures: dict[str, dict[str, Any]] = {}
    for key, (label, compared, relation, bound) in GOALS.items():
        if key == "push_p99_ms_poll_0_5":
            ours_value: float | None = round(percentile([1000 * s for s in push_samples], 99), 2)
            theirs_value: float | None = None
            ours_rounds: list[float] = []
            theirs_rounds: list[float] = []
        else:
            ours_rounds = [figures_of[key] for figures_of in per_round["ours"]]
            theirs_rounds = [figures_of[key] for figures_of in per_round["theirs"]]
            ours_value = round(statistics.median(ours_rounds), 3)
            theirs_value = round(statistics.median(theirs_rounds), 3)
        ratio = round(ours_value / theirs_value, 3) if ours_value is not None and theirs_value else None
        checked = ratio if compared == "ratio" else ours_value
        met = None if checked is None else (checked <= bound if relation == "<=" else checked >= bound)
        figures[key] = {
            "figure": label,
            "ours": ours_value,
            "theirs": theirs_value,
            "ratio": ratio,
            "goal": f"{compared} {relation} {bound:g}",
            "met": met,
            "ours_rounds": ours_rounds,
            "theirs_rounds": theirs_rounds,
        }
    figures["push_p99_ms_poll_0_5"]["tries"] = len(push_samples)
    for streams in (1_000, 10_000):
        for side in raw:
            figures[f"getmetrics_p50_streams_{streams}_over_none"][f"{side}_streams_without_first_message"] = [
                unary.row(record["unary"], streams, 1)["streams_without_first_message"] for record in raw[side]
            ]
    return {
        "benchmark": "ours beside another ExternalScaler server, alternating runs, medians over rounds",
        "ours": ours.name,
        "theirs": theirs.name,
        "query": theirs.query,
        "rounds": rounds,
        "seconds_per_unary_cell": options.seconds,
        "startup_tries_per_round": options.tries,
        "load_average_at_end": [round(load, 2) for load in os.getloadavg()],
        "figures": figures,
        "raw": raw,
    }


def show(result: dict[str, Any]) -> None:
    """Print each figure for both servers, their ratio, its goal, and whether it was met."""
    print_table(
        f"{result['ours']} beside {result['theirs']}, medians of {result['rounds']} rounds",
        ["figure", "ours", "theirs", "ours/theirs", "goal", "met"],
        [
            (f["figure"], f["ours"], _or_dash(f["theirs"]), _or_dash(f["ratio"]), f["goal"], f["met"])
            for f in result["figures"].values()
        ],
    )


def _or_dash(value: float | None) -> object:
    return "-" if value is None else value
