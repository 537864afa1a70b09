"""A fake inference server's /metrics page, as each engine writes it, and hostile variants of it.

The pages carry what the real ones do around the series gpuscaler reads: HELP and TYPE lines, model labels,
histograms under other names. ``mode`` turns the server hostile.
"""

from __future__ import annotations

import asyncio
import gzip
from dataclasses import dataclass, field
from decimal import Decimal

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


# The EPP's flow-control histogram buckets (pkg/epp/metrics: the same in GIE v1.5.0 and llm-d).
EPP_QUEUE_BUCKETS = (
    "0.0001", "0.0005", "0.001", "0.005", "0.01", "0.025", "0.05", "0.1", "0.25", "0.5", "1", "2.5", "5", "10", "30",
    "60", "+Inf",
)  # fmt: skip
# What client_golang writes for each of the EPP's series: HELP ("[ALPHA] " from HelpMsgWithStability) and TYPE.
EPP_HELP = {
    "flow_control_queue_size": "[ALPHA] Current number of requests actively held in the Flow Control queue.",
    "flow_control_request_queue_duration_seconds": "[ALPHA] Distribution of total time requests spend in the Flow "
    "Control layer (from enqueue to final outcome).",
    "gie_saturation": "[ALPHA] Current saturation level of the inference pool (0.0 = empty, 1.0 = fully saturated).",
    "llmd_saturation": "[ALPHA] Pool saturation signal gating Flow Control dispatch. The stage label partitions by "
    "pipeline role: 'prefill' and 'decode' are per-stage signals, 'effective' is max(prefill, decode) and is the "
    "value used for gating. 1.0 is the gating set point; values above 1.0 indicate the magnitude of "
    "oversubscription past it. An empty pool reads as 1.0. With the default utilization detector, endpoints with "
    "missing or stale metrics score as fully saturated (fail-closed; see flow_control_stale_endpoints).",
    "running_requests": "[ALPHA] Inference objective number of running requests in each model.",
    "request_running": "[ALPHA] Current number of active running requests.",
    "info": "[ALPHA] General information of the current build of Inference Extension.",
}


def epp_page(values: dict[str, float], *, llmd: bool, pool: str = "vllm-llama3-8b-instruct") -> str:
    """An EPP's page as client_golang writes it (label pairs sorted by name, ``le`` last): GIE v1.5.0's
    ``inference_extension_*`` names, or current llm-d's, which writes ``llm_d_epp_*`` beside them.

    ``values``: ``waiting`` (queued), ``running``, ``kv`` (saturation, a fraction), ``queue_us`` (the histogram's
    sum, in seconds) over ``success`` (its count); a key left out leaves its series off, as a vector with no label
    set yet is. ``saturation_stages`` (llm-d) writes prefill and decode too."""
    model = {"model_name": "meta-llama/Llama-3.1-8B-Instruct", "target_model_name": "meta-llama/Llama-3.1-8B-Instruct"}
    flow = _labels(fairness_id="default", inference_pool=pool, priority="0", **model)
    lines = [
        "# HELP go_goroutines Number of goroutines that currently exist.",
        "# TYPE go_goroutines gauge",
        "go_goroutines 212",
    ]
    for prefix in ("llm_d_epp_", "inference_extension_") if llmd else ("inference_extension_",):
        lines += [f"# HELP {prefix}info {EPP_HELP['info']}", f"# TYPE {prefix}info gauge"]
        lines.append(f'{prefix}info{{build_ref="v1.5.0",commit="df9f8909"}} 1')
        if "waiting" in values:
            name = f"{prefix}flow_control_queue_size"
            lines += [f"# HELP {name} {EPP_HELP['flow_control_queue_size']}", f"# TYPE {name} gauge"]
            lines.append(f"{name}{{{flow}}} {go_float(values['waiting'])}")
        if "success" in values:
            name = f"{prefix}flow_control_request_queue_duration_seconds"
            help_text = EPP_HELP["flow_control_request_queue_duration_seconds"]
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
            for outcome, share in (("Dispatched", 1.0), ("RejectedCapacity", 0.0)):
                labels = _labels(fairness_id="default", inference_pool=pool, outcome=outcome, priority="0", **model)
                count = values["success"] if share else 7.0  # requests rejected at once: 7 of them, no wait
                lines += [f'{name}_bucket{{{labels},le="{le}"}} {go_float(count)}' for le in EPP_QUEUE_BUCKETS]
                lines.append(f"{name}_sum{{{labels}}} {go_float(values.get('queue_us', 0.0) * share)}")
                lines.append(f"{name}_count{{{labels}}} {go_float(count)}")
        if "kv" in values:
            name = f"{prefix}flow_control_pool_saturation"
            lines += [f"# HELP {name} {EPP_HELP['llmd_saturation' if llmd else 'gie_saturation']}"]
            lines.append(f"# TYPE {name} gauge")
            if llmd:
                stages = (("decode", values["kv"]), ("effective", values["kv"]), ("prefill", values["kv"] / 2))
                lines += [f'{name}{{inference_pool="{pool}",stage="{s}"}} {go_float(v)}' for s, v in stages]
            else:
                lines.append(f'{name}{{inference_pool="{pool}"}} {go_float(values["kv"])}')
        if "running" in values:
            name = "llm_d_epp_request_running" if prefix == "llm_d_epp_" else "inference_objective_running_requests"
            labels = (
                _labels(fairness_id="default", priority="0", **model)
                if prefix == "llm_d_epp_"
                else _labels(model_name=model["model_name"])
            )
            key = "request_running" if prefix == "llm_d_epp_" else "running_requests"
            lines += [
                f"# HELP {name} {EPP_HELP[key]}",
                f"# TYPE {name} gauge",
                f"{name}{{{labels}}} {go_float(values['running'])}",
            ]
    return "\n".join(lines) + "\n"


def go_float(value: float) -> str:
    """``value`` as client_golang writes a sample (Go's ``strconv.FormatFloat(v, 'g', -1, 64)``): the shortest digits
    that read back the same, in exponent form from 1e+06 up and below 1e-04."""
    sign, digits, exponent = Decimal(repr(float(value))).normalize().as_tuple()
    assert isinstance(exponent, int)
    if not any(digits):
        return "0"
    point = len(digits) + exponent - 1  # the decimal exponent of the first digit
    text = "".join(map(str, digits))
    if point < -4 or point >= 6:
        mantissa = text[0] + ("." + text[1:] if len(text) > 1 else "")
        return f"{'-' if sign else ''}{mantissa}e{'-' if point < 0 else '+'}{abs(point):02d}"
    return f"{'-' if sign else ''}{format(Decimal(repr(float(value))).normalize(), 'f')}"


def _labels(**pairs: str) -> str:
    """Label pairs as client_golang writes them: sorted by name."""
    return ",".join(f'{name}="{value}"' for name, value in sorted(pairs.items()))


@dataclass
class FakeEngine:
    """One engine's page; set ``values`` (series -> value) and ``mode`` while it serves."""

    engine: Engine
    values: dict[str, float] = field(default_factory=dict)
    mode: str = "ok"  # ok, hang, slow, huge, malformed, redirect, gzip, status
    v0: bool = False  # vLLM: the V0 engine's KV-cache name; the EPP: GIE v1.5.0's names alone, not llm-d's
    requests: int = 0
    port: int = 0
    _runner: web.AppRunner | None = None

    def page(self) -> str:
        v = self.values
        if self.engine is Engine.EPP:
            return epp_page(v, llmd=not self.v0)
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
