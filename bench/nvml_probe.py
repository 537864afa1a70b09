"""``python -m bench.nvml_probe``: every NVML reading the agent takes, on a real GPU, idle and then under load.

Run once on a machine with an NVIDIA GPU (no GPU was available when GPM, energy and per-process reads were
written; they are tested against the fake pynvml only). It drives the agent's own ``NvmlCollector`` for
``--seconds`` with the GPU idle, then, if a package that ships a CUDA load is importable (torch or cupy),
for ``--seconds`` while a child process multiplies matrices on GPU 0; otherwise it says so and stops after
the idle phase. Each tick prints every reading of every device (GPM metrics and the energy counter
included) and the processes NVML lists, with their utilisation, memory and pod. The end prints a summary
per phase: the mean of each reading, average power from the energy counter, and the energy used while idle.
``--json PATH`` also writes everything, to record in the issue and in docs/metrics.md.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from gpuscaler.agent.attribution.processes import ProcReader
from gpuscaler.agent.collectors.base import CollectorUnavailable
from gpuscaler.agent.collectors.nvml import NvmlCollector
from gpuscaler.model.gpu_metrics import READING_FIELDS
from gpuscaler.model.samples import GpuSample

# A child process that keeps GPU 0 busy with matrix products for the given seconds (torch, else cupy).
LOAD = """
import sys, time
seconds = float(sys.argv[1])
try:
    import torch
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.float16)
    step = lambda: (a @ a, torch.cuda.synchronize())
except ImportError:
    import cupy
    a = cupy.random.rand(8192, 8192, dtype=cupy.float32)
    step = lambda: (a @ a, cupy.cuda.Device().synchronize())
end = time.monotonic() + seconds
while time.monotonic() < end:
    step()
"""


def load_package() -> str | None:
    """The first importable package that can run a CUDA load, or None."""
    for name in ("torch", "cupy"):
        probe = subprocess.run([sys.executable, "-c", f"import {name}"], capture_output=True, check=False)
        if probe.returncode == 0:
            return name
    return None


def describe(sample: GpuSample) -> dict[str, Any]:
    """One device's readings, errors and processes as plain data."""
    return {
        "index": sample.gpu.index,
        "uuid": sample.gpu.uuid,
        "name": sample.gpu.name,
        "mig_parent_uuid": sample.gpu.mig_parent_uuid,
        "readings": {field: getattr(sample, field) for field in READING_FIELDS},
        "errors": [error._asdict() | {"kind": error.kind.value} for error in sample.errors],
        "processes": None if sample.processes is None else [process._asdict() for process in sample.processes],
    }


def sample_phase(collector: NvmlCollector, seconds: float, interval: float, phase: str) -> list[dict[str, Any]]:
    """Read every device every ``interval`` for ``seconds``, printing each tick; the ticks as plain data."""
    devices = collector.discover()
    ticks = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        started = time.monotonic()
        taken_at = time.time()
        samples = [describe(collector.read(gpu)) for gpu in devices]
        ticks.append({"phase": phase, "taken_at": taken_at, "devices": samples})
        for device in samples:
            readings = " ".join(f"{k}={_fmt(v)}" for k, v in device["readings"].items())
            print(f"[{phase} {taken_at:.3f}] gpu {device['index']} {device['uuid']}: {readings}")
            for error in device["errors"]:
                print(f"    absent {error['field']}: {error['kind']}: {error['detail']}")
            for process in device["processes"] or []:
                print(f"    process {process}")
        time.sleep(max(0.0, interval - (time.monotonic() - started)))
    return ticks


def summary(ticks: list[dict[str, Any]]) -> dict[str, Any]:
    """Per phase and device: each reading's mean, average watts from the energy counter, energy while idle."""
    result: dict[str, Any] = {}
    for phase in sorted({tick["phase"] for tick in ticks}):
        mine = [tick for tick in ticks if tick["phase"] == phase]
        for position, first in enumerate(mine[0]["devices"]):
            series = [(tick["taken_at"], tick["devices"][position]) for tick in mine]
            means = {}
            for field in READING_FIELDS:
                values = [d["readings"][field] for _, d in series if d["readings"][field] is not None]
                means[field] = math.fsum(values) / len(values) if values else None
            energy = [(at, d["readings"]["energy_joules"]) for at, d in series if d["readings"]["energy_joules"]]
            watts = None
            if len(energy) >= 2 and energy[-1][0] > energy[0][0]:
                watts = (energy[-1][1] - energy[0][1]) / (energy[-1][0] - energy[0][0])
            idle = 0.0
            for (_, before), (_, after) in itertools.pairwise(series):
                start, stop = before["readings"]["energy_joules"], after["readings"]["energy_joules"]
                if start is not None and stop is not None and after["readings"]["gpu_utilization_percent"] == 0.0:
                    idle += stop - start
            result[f"{phase} gpu {first['index']} {first['uuid']}"] = {
                "mean": means,
                "power_average_watts": watts,
                "idle_energy_joules": idle,
            }
    return result


def probe(collector: NvmlCollector, seconds: float, interval: float, package: str | None) -> dict[str, Any]:
    """Open ``collector``, read an idle phase and (with a load ``package``) a loaded one, close; ticks and summary."""
    collector.open()
    try:
        ticks = sample_phase(collector, seconds, interval, "idle")
        if package is None:
            print("no torch or cupy to run a CUDA load: idle only")
        else:
            print(f"loading GPU 0 with {package} matrix products for {seconds:g}s")
            child = subprocess.Popen([sys.executable, "-c", LOAD, str(seconds + 2)])
            try:
                time.sleep(1.0)  # the child's CUDA context and first kernels
                ticks += sample_phase(collector, seconds, interval, f"load ({package}, pid {child.pid})")
            finally:
                child.wait(timeout=60)
    finally:
        collector.close()
    return {"ticks": ticks, "summary": summary(ticks)}


def _fmt(value: object) -> str:
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def main(argv: list[str] | None = None) -> int:
    """Probe this machine's GPUs and print the summary; exit status 1 when there is no NVML here."""
    parser = argparse.ArgumentParser(prog="python -m bench.nvml_probe", description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=5.0, help="seconds per phase (5)")
    parser.add_argument("--interval", type=float, default=0.5, help="seconds between reads, as --poll-interval (0.5)")
    parser.add_argument("--proc-root", type=Path, default=Path("/proc"), help="where PIDs are looked up (/proc)")
    parser.add_argument("--json", type=Path, help="also write the ticks and the summary here")
    args = parser.parse_args(argv)

    collector = NvmlCollector(node="probe", processes=ProcReader(args.proc_root))
    try:
        result = probe(collector, args.seconds, args.interval, load_package())
    except CollectorUnavailable as error:
        print(f"no NVML here: {error}", file=sys.stderr)
        return 1
    print(json.dumps(result["summary"], indent=2))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
