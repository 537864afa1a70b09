"""Through a gateway in-process, KEDA's GetMetrics averages a data-parallel pod's usage and sums its queues."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from gpuscaler.model.engines import Engine
from tests.fakes.fake_engine import FakeEngine
from tests.gateway.calls import value
from tests.gateway.conftest import StartGateway, StartNode


@dataclass
class DataParallelEngine(FakeEngine):
    """A pod whose engine runs one data-parallel rank per entry of ``ranks``, each a label set of every series."""

    ranks: tuple[dict[str, float], ...] = ()

    def page(self) -> str:
        if self.engine is Engine.VLLM:
            labels = 'engine="{rank}",model_name="meta-llama/Llama-3.1-8B-Instruct"'
            series = (("vllm:num_requests_waiting", "waiting"), ("vllm:kv_cache_usage_perc", "kv"))
        else:
            labels = 'model_name="qwen",engine_type="unified",tp_rank="0",pp_rank="0",dp_rank="{rank}"'
            series = (("sglang:num_queue_reqs", "waiting"), ("sglang:token_usage", "kv"))
        lines = []
        for name, key in series:
            lines += [f"# HELP {name} {name}.", f"# TYPE {name} gauge"]
            lines += [f"{name}{{{labels.format(rank=r)}}} {rank[key]}" for r, rank in enumerate(self.ranks)]
        return "\n".join(lines) + "\n"


@pytest.fixture
async def engines() -> AsyncIterator[list[FakeEngine]]:
    """Fake engines a test starts, stopped after it."""
    started: list[FakeEngine] = []
    yield started
    for engine in started:
        await engine.stop()


async def test_get_metrics_averages_a_dp_pods_cache_and_sums_its_queue(
    start_node: StartNode, start_gateway: StartGateway, engines: list[FakeEngine], tmp_path: Path
) -> None:
    """A vLLM pod of two engines at 50% and 70% KV cache counts as 60% beside a one-engine pod at 80% (KEDA gets
    their average, 70), while their queues (3 + 4 and 1) sum to 8; an SGLang pod of two ranks at 0.5 and 0.7 gets
    60."""
    dp = DataParallelEngine(Engine.VLLM, ranks=({"waiting": 3, "kv": 0.5}, {"waiting": 4, "kv": 0.7}))
    single = DataParallelEngine(Engine.VLLM, ranks=({"waiting": 1, "kv": 0.8},))
    sglang = DataParallelEngine(Engine.SGLANG, ranks=({"waiting": 2, "kv": 0.5}, {"waiting": 6, "kv": 0.7}))
    for fake in (dp, single, sglang):
        engines.append(await fake.start())
    pods = [
        {"namespace": "ml", "pod": pod, "workload": workload, "ip": "127.0.0.1"}
        | {"annotations": {"prometheus.io/port": str(fake.port)}}
        for pod, workload, fake in (("llm-dp", "llm", dp), ("llm-one", "llm", single), ("sg-dp", "sg", sglang))
    ]
    (tmp_path / "pods.yaml").write_text(yaml.safe_dump({"pods": pods}), encoding="utf-8")
    gateway = await start_gateway(await start_node("node-a"), pod_directory=tmp_path / "pods.yaml")
    assert await value(gateway, metric="vllm_kv_cache", workload="llm") == pytest.approx(70.0)
    assert await value(gateway, metric="vllm_queue", workload="llm") == 8.0
    assert await value(gateway, metric="sglang_token_usage", workload="sg") == pytest.approx(60.0)
    assert await value(gateway, metric="sglang_queue", workload="sg") == 8.0
