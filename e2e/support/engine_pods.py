"""Engine pods for attacks and their neighbours: many loopback ports in a process of their own, each one pod's page.

    python -m e2e.support.engine_pods --kind label-sets --pods 1 --label-sets 109230

prints one JSON line, ``{"ports": [...]}``, once every port listens, then serves until its stdin closes. A
process of its own, so that what serving the pages costs is not the measured gateway's, nor the caller's loop.
Kinds (``KINDS``):

- ``good``: a vLLM page as vLLM writes it, ``vllm:num_requests_waiting`` at ``--value`` (3).
- ``label-sets``: ``--label-sets`` label sets of ``vllm:num_requests_waiting``, each 1 (109,230 are 4 MiB).
- ``infinite``: two label sets of ``vllm:num_requests_waiting`` at 1.7e308, whose sum is infinite.
- ``infinite-sum``: a Triton page whose counter ``nv_inference_request_success`` is 1.7e308 in each of two models: a
  counter has no bound per label set (it counts since the engine started), so only their sum, infinite, is refused.
- ``oversized``: a Content-Length of ``--bytes``, and that many bytes of a real page's other lines.
- ``endless``: no Content-Length, and those lines until the reader hangs up.
- ``silent``: the request is read and never answered.

``pod_entries`` writes the pods of a static pod directory (``--pod-directory``) that read these ports.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
KINDS = ("good", "label-sets", "infinite", "infinite-sum", "oversized", "endless", "silent")
WAITING = "vllm:num_requests_waiting"
# A real vLLM page's lines that no signal reads: what oversized and endless pages are made of.
FILLER = (
    b'vllm:e2e_request_latency_seconds_bucket{engine="0",le="0.3",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1.0\n'
)
REQUEST_LIMIT_BYTES = 16 * 1024
STARTED_WITHIN_SECONDS = 30.0


def label_sets_page(count: int, value: float = 1.0) -> bytes:
    """A page of ``count`` label sets of vllm:num_requests_waiting, each ``value`` (``{m="1aa6d"} 1``: 109,230 of
    them make a page just under 4 MiB, the default --engine-max-page-bytes)."""
    lines = (f'{WAITING}{{m="{index:x}"}} {value:g}\n' for index in range(count))
    return "".join(lines).encode()


def good_page(value: float) -> bytes:
    """A small vLLM page with its queue at ``value``."""
    labels = '{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"}'
    gauges = (
        f"# HELP {name} {name}.\n# TYPE {name} gauge\n{name}{labels} {number}\n"
        for name, number in ((WAITING, value), ("vllm:num_requests_running", 1.0), ("vllm:kv_cache_usage_perc", 0.2))
    )
    return FILLER * 40 + "".join(gauges).encode()


@dataclass
class Pages:
    """What every port of one process serves."""

    kind: str
    label_sets: int = 109_230
    value: float = 3.0
    size: int = 8 * 1024 * 1024
    requests: int = 0
    _body: bytes = field(default=b"", repr=False)

    def __post_init__(self) -> None:
        if self.kind == "good":
            self._body = good_page(self.value)
        elif self.kind == "label-sets":
            self._body = label_sets_page(self.label_sets)
        elif self.kind == "infinite":
            self._body = label_sets_page(2, 1.7e308)
        elif self.kind == "infinite-sum":
            self._body = b"# TYPE nv_inference_request_success counter\n" + b"".join(
                b'nv_inference_request_success{model="%s",version="1"} 1.7e308\n' % model for model in (b"a", b"b")
            )

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One connection: a request, its answer (keep-alive where the page has a length)."""
        try:
            while True:
                with contextlib.suppress(asyncio.LimitOverrunError):
                    await reader.readuntil(b"\r\n\r\n")
                self.requests += 1
                if not await self._answer(writer):
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            return
        finally:
            writer.close()

    async def _answer(self, writer: asyncio.StreamWriter) -> bool:
        """Write one answer; whether the connection may take another request."""
        if self.kind == "silent":
            await asyncio.Event().wait()
        if self.kind in ("oversized", "endless"):
            length = f"Content-Length: {self.size}\r\n" if self.kind == "oversized" else ""
            writer.write(f"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n{length}Connection: close\r\n\r\n".encode())
            block = FILLER * (65536 // len(FILLER))
            sent = 0
            while self.kind == "endless" or sent < self.size:
                writer.write(block)
                sent += len(block)
                await writer.drain()
            return False
        head = (
            f"HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {len(self._body)}\r\n\r\n"
        )
        writer.write(head.encode())
        writer.write(self._body)
        await writer.drain()
        return True


def pod_entries(namespace: str, workload: str, ports: Sequence[int]) -> list[dict[str, Any]]:
    """Ready pods of Deployment ``workload`` in ``namespace``, one per port, for a static pod directory."""
    return [
        {
            "namespace": namespace,
            "pod": f"{workload}-{index:04d}",
            "labels": {"app": workload},
            "workload": workload,
            "workloadKind": "Deployment",
            "ip": "127.0.0.1",
            "annotations": {"prometheus.io/port": str(port)},
        }
        for index, port in enumerate(ports)
    ]


@contextlib.asynccontextmanager
async def engine_pods(kind: str, pods: int, *flags: str) -> AsyncIterator[tuple[list[int], int]]:
    """``pods`` pods of ``kind`` served by a process of their own: (their ports, its pid), for the block."""
    child = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "e2e.support.engine_pods",
        "--kind",
        kind,
        "--pods",
        str(pods),
        *flags,
        cwd=ROOT,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )
    try:
        assert child.stdout is not None
        async with asyncio.timeout(STARTED_WITHIN_SECONDS):
            line = await child.stdout.readline()
        if not line:
            raise AssertionError(f"engine pods ({kind}) exited with {await child.wait()} before listening")
        yield list(json.loads(line)["ports"]), child.pid
    finally:
        if child.returncode is None:
            child.kill()
        await child.wait()


async def _main(args: argparse.Namespace) -> None:
    pages = Pages(args.kind, label_sets=args.label_sets, value=args.value, size=args.bytes)
    servers = [
        await asyncio.start_server(pages.serve, "127.0.0.1", 0, limit=REQUEST_LIMIT_BYTES) for _ in range(args.pods)
    ]
    ports = [server.sockets[0].getsockname()[1] for server in servers]
    print(json.dumps({"ports": ports}), flush=True)
    loop = asyncio.get_running_loop()
    stdin = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(stdin), sys.stdin)
    await stdin.read()  # until the parent closes it, or exits


def main(argv: list[str] | None = None) -> None:
    """Serve the pages ``argv`` asks for until stdin closes."""
    parser = argparse.ArgumentParser(prog="python -m e2e.support.engine_pods", description=__doc__.splitlines()[0])
    parser.add_argument("--kind", choices=KINDS, required=True)
    parser.add_argument("--pods", type=int, default=1)
    parser.add_argument("--label-sets", type=int, default=109_230)
    parser.add_argument("--value", type=float, default=3.0)
    parser.add_argument("--bytes", type=int, default=8 * 1024 * 1024)
    asyncio.run(_main(parser.parse_args(argv)))


if __name__ == "__main__":
    main()
