"""The dev stack's keda-view: ``gpuscaler query`` for each given query, in turn, every few seconds, until stopped.

It runs the queries in this one process, so compose.yaml's keda-view needs no shell (the image has none), and it
stops at SIGTERM with status 0 (as a container's first process, it would otherwise ignore SIGTERM).

Usage: ``python dev/keda_view.py --address gateway:6000 --every 10 'profile=training' '--scaled-object ml/vllm
profile=vllm-queue workload=vllm'``: each QUERY is one ``gpuscaler query``'s arguments after ``--address``.
"""

from __future__ import annotations

import argparse
import shlex
import signal
import sys
import time
from types import FrameType

from gpuscaler import cli


def _stop(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(0)


def main(argv: list[str] | None = None) -> int:
    """Prints each query's report every ``--every`` seconds until SIGTERM or Ctrl-C."""
    parser = argparse.ArgumentParser(description="Print what KEDA would get, every few seconds.")
    parser.add_argument("--address", required=True, help="the gateway's (or an agent's) HOST:PORT")
    parser.add_argument("--every", type=float, default=10.0, help="seconds between rounds (default 10)")
    parser.add_argument("queries", nargs="+", metavar="QUERY", help="one `gpuscaler query`'s arguments, quoted")
    args = parser.parse_args(argv)
    if args.every <= 0:
        parser.error(f"--every {args.every:g}: a number of seconds above 0")
    signal.signal(signal.SIGTERM, _stop)
    try:
        while True:
            for query in args.queries:
                # A failed query says why on stderr, and the next round asks again; 130 is Ctrl-C during it.
                if cli.main(["query", "--address", args.address, *shlex.split(query)]) == 130:
                    return 0
                sys.stdout.flush()
            time.sleep(args.every)
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
