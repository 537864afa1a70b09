"""A fake inference server's /metrics page, as each engine writes it, and hostile variants of it.

The pages carry what the real ones do around the series gpuscaler reads: HELP and TYPE lines, model labels,
histograms under other names. ``mode`` turns the server hostile.
"""

from __future__ import annotations

import asyncio
import gzip
from dataclasses import dataclass, field

from aiohttp import web

from gpuscaler.model.engines import Engine

# Lines a real page carries that no signal reads: the prefilter must drop them, the parser never see them.
NOISE = """# HELP vllm:e2e_request_latency_seconds Histogram of end to end request latency in seconds.
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_bucket{engine="0",le="0.3",model_name="m"} 1.0
vllm:e2e_request_latency_seconds_sum{engine="0",model_name="m"} 0.2
vllm:e2e_request_latency_seconds_count{engine="0",model_name="m"} 1.0
# HELP process_cpu_seconds_total Total user and system CPU time spent in seconds.
# TYPE process_cpu_seconds_total counter
process_cpu_seconds_total 12.5
"""


@dataclass
class FakeEngine:
    """One engine's page; set ``values`` (series -> value) and ``mode`` while it serves."""

    engine: Engine
    values: dict[str, float] = field(default_factory=dict)
    mode: str = "ok"  # ok, hang, slow, huge, malformed, redirect, gzip, status
    v0: bool = False  # vLLM: the V0 engine's KV-cache name
    requests: int = 0
    port: int = 0
    _runner: web.AppRunner | None = None

    def page(self) -> str:
        v = self.values
        if self.engine is Engine.VLLM:
            cache = "vllm:gpu_cache_usage_perc" if self.v0 else "vllm:kv_cache_usage_perc"
            labels = '{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"}'
            return NOISE + "".join(
                f"# HELP {name} {name}.\n# TYPE {name} gauge\n{name}{labels} {v.get(key, 0.0)}\n"
                for name, key in (
                    ("vllm:num_requests_waiting", "waiting"),
                    ("vllm:num_requests_running", "running"),
                    (cache, "kv"),
                )
            )
        if self.engine is Engine.TRITON:
            lines = []
            for name, kind, key in (
                ("nv_inference_pending_request_count", "gauge", "pending"),
                ("nv_inference_request_success", "counter", "success"),
                ("nv_inference_queue_duration_us", "counter", "queue_us"),
            ):
                lines.append(f"# HELP {name} {name}\n# TYPE {name} {kind}")
                # Two models: the signal is their sum.
                half = v.get(key, 0.0) / 2
                lines += [f'{name}{{model="{m}",version="1"}} {half}' for m in ("resnet", "bert")]
            return "\n".join(lines) + "\n"
        if self.engine is Engine.SGLANG:
            labels = '{model_name="qwen",engine_type="unified",tp_rank="0",pp_rank="0"}'
            return "".join(
                f"# HELP {name} {name}\n# TYPE {name} gauge\n{name}{labels} {v.get(key, 0.0)}\n"
                for name, key in (
                    ("sglang:num_queue_reqs", "waiting"),
                    ("sglang:num_running_reqs", "running"),
                    ("sglang:token_usage", "kv"),
                )
            )
        return "".join(
            f"# HELP {name} {name}\n# TYPE {name} gauge\n{name} {v.get(key, 0.0)}\n"
            for name, key in (("tgi_queue_size", "waiting"), ("tgi_batch_current_size", "running"))
        )

    async def _metrics(self, request: web.Request) -> web.StreamResponse:
        self.requests += 1
        if self.mode == "hang":
            await asyncio.Event().wait()
        if self.mode == "slow":
            await asyncio.sleep(10)
        if self.mode == "status":
            return web.Response(status=503, text="loading")
        if self.mode == "redirect":
            raise web.HTTPFound("http://169.254.169.254/latest/meta-data/")
        if self.mode == "malformed":
            return web.Response(text='vllm:num_requests_waiting{model_name="m" 3\n')
        if self.mode == "gzip":
            body = gzip.compress(self.page().encode())
            return web.Response(body=body, headers={"Content-Encoding": "gzip"})
        if self.mode == "huge":
            response = web.StreamResponse()  # no Content-Length: the limit must hold while reading
            await response.prepare(request)
            line = b"# filler " + b"x" * 1014 + b"\n"
            for _ in range(100 * 1024):  # 100 MiB, unless the reader stops first
                await response.write(line)
            return response
        return web.Response(text=self.page(), content_type="text/plain")

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> FakeEngine:
        """Serves on ``host``:``port`` (any free port when 0): another loopback address stands for another pod."""
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/custom/path", self._metrics)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        server = site._server
        assert server is not None
        self.port = server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
