"""What one engine page of label sets costs the gateway: CPU per read, and the event loop's longest turn meanwhile.

    .venv/bin/python -m bench.page_cost        # pages of 64 KiB, 1 MiB and 4 MiB of label sets, and 3 odd ones, ~30 s

Each page is ``vllm:num_requests_waiting`` once per label set (``{m="1aa6d"} 1``), as issue 31's row 1 sent it,
handed to the reader in 64 KiB chunks as a socket gives them. It is read as the gateway reads it (the
``page_reader`` of this tree: the chunked filter, ``--engine-max-label-sets``, the parser in turns) two ways: with
the default limit, and with the limit raised past the page so that all of it is parsed; where the tree has no
``page_reader`` (before issue 31), by ``page.read_page`` (``read_whole_page`` since) on the whole body, as its
scraper did on the event loop. Three more are the pages issue 31's review found costly under every limit
(``ODD_PAGES``), read with the default limits: 256 label sets of 15 kB each (3.85 MB), 8,000 TYPE lines of the
series before its 8,000 samples (600 kB), and one label set of 3 MB handed over as one chunk (aiohttp's
``iter_any`` joins reads). A task beside it on the same loop notes the longest time between two of its turns: how
long the read held the loop, in the thread's CPU time (wall time adds the preemptions of a busy machine: up to
12 ms between two turns of an idle loop on 2 shared cores), and in wall time. Writes bench/results/page_cost.json.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import os
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

from bench.common import print_table, write_result
from gpuscaler.gateway.engines import page as page_module
from gpuscaler.gateway.engines.page import prefilter
from gpuscaler.model.engines import Engine, engine_series

SIZES = {"64 KiB": 64 * 1024, "1 MiB": 1024 * 1024, "4 MiB": 4 * 1024 * 1024 - 1}
CHUNK_BYTES = 64 * 1024
REPEATS = 3
WAITING = "vllm:num_requests_waiting"
ODD_PAGES = {
    "256 x 15 kB label sets": (
        "".join(f'{WAITING}{{m="{index:x}{"a" * 15_000}"}} 1\n' for index in range(256)).encode(),
        256,
        CHUNK_BYTES,
    ),
    "8,000 TYPE lines": (
        (f"# TYPE {WAITING} gauge\n" * 8_000 + "".join(f'{WAITING}{{m="{i:x}"}} 1\n' for i in range(8_000))).encode(),
        8_000,
        CHUNK_BYTES,
    ),
    "one 3 MB line": (f'{WAITING}{{m="{"a" * 3_000_000}"}} 1\n'.encode(), 1, 3_000_100),
}


def label_sets_page(most_bytes: int) -> tuple[bytes, int]:
    """As many label sets of vllm:num_requests_waiting as fit in ``most_bytes``: (the page, how many)."""
    lines: list[str] = []
    size = 0
    while True:
        line = f'{WAITING}{{m="{len(lines):x}"}} 1\n'
        if size + len(line) > most_bytes:
            return "".join(lines).encode(), len(lines)
        lines.append(line)
        size += len(line)


async def held(read: Callable[[], Awaitable[object]]) -> tuple[float, float, float, str]:
    """CPU seconds ``read`` took, the longest turn of the loop meanwhile in CPU and in wall seconds, and its
    outcome."""
    longest = longest_wall = 0.0
    stop = False

    async def beside() -> None:
        nonlocal longest, longest_wall
        last, last_wall = time.thread_time(), time.perf_counter()
        while not stop:
            await asyncio.sleep(0)
            now, now_wall = time.thread_time(), time.perf_counter()
            longest, longest_wall = max(longest, now - last), max(longest_wall, now_wall - last_wall)
            last, last_wall = now, now_wall

    task = asyncio.create_task(beside())
    await asyncio.sleep(0)
    started = time.process_time()
    try:
        await read()
        outcome = "ok"
    except Exception as error:  # a refused page is an outcome here
        outcome = f"{getattr(error, 'outcome', type(error).__name__)}"
    cpu = time.process_time() - started
    stop = True
    await task
    return cpu, longest, longest_wall, outcome


async def measure() -> list[dict[str, Any]]:
    """Every page size, each way this tree reads it, best of REPEATS."""
    try:
        page_reader: Any = importlib.import_module("gpuscaler.gateway.engines.page_reader")
        limits_module: Any = importlib.import_module("gpuscaler.gateway.engines.limits")
    except ImportError:
        page_reader = None
    wanted = prefilter(engine_series(Engine.VLLM))
    rows = []
    pages = {label: (*label_sets_page(most), CHUNK_BYTES, True) for label, most in SIZES.items()}
    pages.update({label: (*page, False) for label, page in ODD_PAGES.items()})
    for label, (body, count, chunk_bytes, raised) in pages.items():
        ways: dict[str, Callable[[], Awaitable[object]]] = {}
        if page_reader is None or not asyncio.iscoroutinefunction(getattr(page_reader.PageReader, "parse", None)):

            async def whole(body: bytes = body) -> object:
                whole_page = vars(page_module).get("read_whole_page") or vars(page_module)["read_page"]  # its old name
                return whole_page(body, wanted, at=0.0)  # as the scraper did: one call on the loop

            ways["on the loop, whole (before)"] = whole
        else:
            limits_tried = (("default limit", None), ("limit past the page", count + 1))
            for name, limit in limits_tried if raised else limits_tried[:1]:
                base = limits_module.DEFAULT_SCRAPE_LIMITS
                limits = base if limit is None else type(base)(**{**_fields(base), "max_label_sets": limit})
                reader = page_reader.PageReader(limits)

                async def chunked(reader: Any = reader, body: bytes = body, size: int = chunk_bytes) -> object:
                    chunks = [body[i : i + size] for i in range(0, len(body), size)]
                    return await reader.parse(chunks, Engine.VLLM, at=0.0)

                ways[f"in turns, {name} ({limit or base.max_label_sets})"] = chunked
        for way, read in ways.items():
            runs = [await held(read) for _ in range(REPEATS)]
            cpu, _, _, outcome = min(runs)
            rows.append(
                {
                    "page": label,
                    "bytes": len(body),
                    "label_sets": count,
                    "way": way,
                    "cpu_ms": round(cpu * 1000, 1),
                    "longest_turn_cpu_ms": round(min(r[1] for r in runs) * 1000, 2),
                    "longest_turn_wall_ms": round(min(r[2] for r in runs) * 1000, 2),
                    "outcome": outcome,
                }
            )
    return rows


def _fields(limits: Any) -> dict[str, Any]:
    return {name: getattr(limits, name) for name in limits.__dataclass_fields__}


def main(argv: list[str] | None = None) -> int:
    """Measure, write results/page_cost.json, print the table."""
    parser = argparse.ArgumentParser(prog="python -m bench.page_cost", description=__doc__.splitlines()[0])
    parser.add_argument("--name", default="page_cost", help="the results file's name (page_cost)")
    args = parser.parse_args(argv)
    rows = asyncio.run(measure())
    path = write_result(
        args.name, {"benchmark": __doc__.splitlines()[0], "load_average": os.getloadavg(), "rows": rows}
    )
    print_table(
        "One engine page of label sets",
        ["page", "label sets", "read", "CPU ms", "longest turn: CPU ms", "wall ms", "outcome"],
        [
            [r[key] for key in ("page", "label_sets", "way", "cpu_ms", "longest_turn_cpu_ms", "longest_turn_wall_ms")]
            + [r["outcome"]]
            for r in rows
        ],
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
