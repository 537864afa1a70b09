"""What every benchmark shares: summaries (median, p99, max), /proc readings, the machine, result files."""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

RESULTS = Path(__file__).with_name("results")
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between the nearest ranks, like numpy's default."""
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summary_ms(seconds: Sequence[float]) -> dict[str, float]:
    """Count, median, p99 and max of durations given in seconds, in milliseconds."""
    ms = [1000 * s for s in seconds]
    return {
        "n": len(ms),
        "median_ms": round(statistics.median(ms), 2),
        "p99_ms": round(percentile(ms, 99), 2),
        "max_ms": round(max(ms), 2),
    }


def cpu_seconds(pid: int) -> float:
    """User plus system CPU seconds the process has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def rss_mib(pid: int) -> float:
    """Resident memory now, MiB."""
    pages = int(Path(f"/proc/{pid}/statm").read_text().split()[1])
    return pages * PAGE_SIZE / 2**20


def machine() -> dict[str, Any]:
    """What the numbers were measured on: no host names, no paths."""
    return {
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "system": f"{platform.system()} {platform.machine()}",
        "processor": _cpu_model(),
    }


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def write_result(name: str, result: dict[str, Any]) -> Path:
    """``bench/results/<name>.json``, with the machine added."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps({"machine": machine(), **result}, indent=2) + "\n", encoding="utf-8")
    return path


def print_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    """Print ``rows`` under ``columns`` as a table, its title noting this machine's core count."""
    table = Table(title=f"{title} ({os.cpu_count()} cores)", title_justify="left")
    for column in columns:
        table.add_column(column, justify="right" if column != columns[0] else "left")
    for row in rows:
        table.add_row(*(f"{cell:g}" if isinstance(cell, float) else str(cell) for cell in row))
    Console().print(table)
