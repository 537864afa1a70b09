"""Busy processes beside a command, as other jobs share a CI runner's cores: ``python -m tests.load -- make test``.

One spinning process per core (``--processes`` to change), at the same priority as the command, for as long
as the command runs; the exit code is the command's.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import subprocess
import sys
from collections.abc import Iterator


@contextlib.contextmanager
def busy_processes(count: int) -> Iterator[None]:
    """``count`` processes that each keep one core busy until the block ends."""
    context = multiprocessing.get_context("spawn")
    spinners = [context.Process(target=_spin, daemon=True) for _ in range(count)]
    for spinner in spinners:
        spinner.start()
    try:
        yield
    finally:
        for spinner in spinners:
            spinner.terminate()
            spinner.join()


def _spin() -> None:
    while True:
        pass


def main(argv: list[str] | None = None) -> int:
    """Run the command after ``--`` beside the busy processes; its exit code is ours."""
    parser = argparse.ArgumentParser(prog="python -m tests.load", description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=os.cpu_count() or 2, help="busy processes (one per core)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command to run, after --")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --")
    print(f"running {' '.join(command)!r} beside {args.processes} busy processes", flush=True)
    with busy_processes(args.processes):
        return subprocess.call(command)


if __name__ == "__main__":
    sys.exit(main())
