"""bench/nvml_probe.py, the script a GPU machine runs once, against the fake pynvml so that it cannot rot."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.nvml_probe import probe
from gpuscaler.agent.attribution.processes import ProcReader
from gpuscaler.agent.collectors.nvml import NvmlCollector
from tests.fakes.fake_nvml import FakeDevice, FakeNvml, FakeProcess


def test_the_probe_prints_and_summarises_every_reading(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Idle phase only without a CUDA package: every reading per tick, GPM from the second, processes, a summary."""
    (tmp_path / "42").mkdir()
    (tmp_path / "42" / "cgroup").write_text(
        "0::/kubepods/burstable/pod1b4e2a3c-1111-2222-3333-444455556666/" + "c" * 64
    )
    nvml = FakeNvml([FakeDevice("GPU-0", gpu_percent=0, watts=80.0, processes=[FakeProcess(42, live=(0, 0))])])
    collector = NvmlCollector(node="probe", nvml=nvml, processes=ProcReader(tmp_path))
    result = probe(collector, seconds=0.5, interval=0.1, package=None)

    printed = capsys.readouterr().out
    assert "no torch or cupy to run a CUDA load: idle only" in printed
    assert "sm_active_percent=35.500" in printed
    assert "absent sm_active_percent: other: GPM metrics are rates between two samples" in printed  # the first tick
    assert "pod_uid': '1b4e2a3c-1111-2222-3333-444455556666'" in printed
    [(name, figures)] = result["summary"].items()
    assert name == "idle gpu 0 GPU-0"
    assert figures["mean"]["sm_active_percent"] == 35.5
    assert figures["power_average_watts"] == pytest.approx(80.0, rel=0.25)
    assert figures["idle_energy_joules"] > 0
    assert nvml.gpm_live == {}  # the probe closes the collector, which frees every GPM sample
