"""``python -m bench [NAME...]``: run the agent's benchmarks, write ``bench/results/<name>.json``, print tables.

Names: push, unary, idle, startup (all four by default), and gateway (``bench.gateway``, run on its own).
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time
from collections.abc import Callable, Coroutine
from types import ModuleType
from typing import Any

from bench import idle, push, startup, unary
from bench.common import write_result
from bench.harness import Bench, Options, bench_folder

BENCHES: dict[str, ModuleType] = {"push": push, "unary": unary, "idle": idle, "startup": startup}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", metavar="NAME", help="push, unary, idle, startup, gateway")
    defaults = Options()
    parser.add_argument("--tries", type=int, default=defaults.tries, help="push and start-up samples (20)")
    parser.add_argument("--seconds", type=float, default=defaults.seconds, help="seconds per unary cell (5)")
    parser.add_argument(
        "--idle-seconds", type=float, default=defaults.idle_seconds, help="seconds per idle CPU measurement (30)"
    )
    args = parser.parse_args(argv)
    names = args.names or list(BENCHES)
    unknown = [name for name in names if name not in (*BENCHES, "gateway")]
    if unknown:
        parser.error(f"unknown benchmark {unknown[0]!r}; use: {', '.join([*BENCHES, 'gateway'])}")
    options = Options(tries=args.tries, seconds=args.seconds, idle_seconds=args.idle_seconds)

    with bench_folder() as bench:
        for name in names:
            if name == "gateway":
                subprocess.run([sys.executable, "-m", "bench.gateway"], check=True)
                continue
            module = BENCHES[name]
            run: Callable[[Bench, Options], Coroutine[Any, Any, dict[str, Any]]] = module.run
            started = time.monotonic()
            result = asyncio.run(run(bench, options))
            result["bench_seconds"] = round(time.monotonic() - started, 1)
            path = write_result(name, result)
            module.show(result)
            print(f"wrote {path.parent.name}/{path.name}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
