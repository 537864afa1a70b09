"""Per-process reads against the fake pynvml and a fixture /proc tree: utilisation, memory, and the pod of each PID."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuscaler.agent.attribution.processes import ProcReader, container_of
from gpuscaler.agent.collectors.nvml import NvmlCollector
from gpuscaler.model.pods import uid_key
from gpuscaler.model.samples import PROCESSES_FIELD, GpuSample, ProcessUsage, ReadError, ReadErrorKind
from tests.fakes.fake_nvml import FUNCTION_NOT_FOUND, NOT_SUPPORTED, FakeDevice, FakeNvml, FakeProcess

NOW = 1_700_000_000.0
NOW_US = int(NOW * 1_000_000)
POD_A = "1b4e2a3c-1111-2222-3333-444455556666"
POD_B = "9f8e7d6c-aaaa-bbbb-cccc-ddddeeeeffff"
CONTAINER_A = "a" * 64
CONTAINER_B = "b" * 64


def systemd_cgroup(pod_uid: str, container: str, qos: str = "burstable") -> str:
    """A /proc/PID/cgroup line for a container of pod ``pod_uid`` under the systemd cgroup driver (cgroup v2)."""
    slice_uid = pod_uid.replace("-", "_")
    pod_slice = f"kubepods-{qos}-pod{slice_uid}.slice"
    return f"0::/kubepods.slice/kubepods-{qos}.slice/{pod_slice}/cri-containerd-{container}.scope\n"


@pytest.fixture
def proc(tmp_path: Path) -> Path:
    """A /proc tree: PID 101 and 102 in pod A, 201 in pod B (cgroupfs, v1), 301 a host daemon."""
    files = {
        101: systemd_cgroup(POD_A, CONTAINER_A),
        102: systemd_cgroup(POD_A, CONTAINER_A),
        201: "".join(
            f"{n}:{c}:/kubepods/besteffort/pod{POD_B}/{CONTAINER_B}\n" for n, c in ((12, "memory"), (11, "cpu"))
        ),
        301: "0::/system.slice/nvidia-persistenced.service\n",
    }
    for pid, text in files.items():
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "cgroup").write_text(text)
    return tmp_path


def collector_for(nvml: FakeNvml, proc_root: Path) -> NvmlCollector:
    """An opened collector that reads processes under ``proc_root``, its wall clock fixed at NOW."""
    collector = NvmlCollector(node="node-a", nvml=nvml, processes=ProcReader(proc_root), wall_clock=lambda: NOW)
    collector.open()
    return collector


def read(collector: NvmlCollector) -> GpuSample:
    """A read of the first GPU."""
    return collector.read(collector.discover()[0])


def process_errors(sample: GpuSample) -> list[ReadError]:
    """The sample's errors about processes: listing them, or reading their utilisation."""
    return [e for e in sample.errors if e.field in (PROCESSES_FIELD, "process_utilization")]


def shared_gpu() -> FakeDevice:
    """A time-sliced GPU: pod A runs two processes, pod B one, a host daemon one that never ran a kernel."""
    return FakeDevice(
        "GPU-shared",
        processes=[
            FakeProcess(101, used_bytes=2 * 1024**3, samples=[(NOW_US - 1_500_000, 10, 5), (NOW_US - 200_000, 30, 12)]),
            FakeProcess(102, used_bytes=1024**3, samples=[(NOW_US - 300_000, 15, 3)]),
            FakeProcess(201, used_bytes=4 * 1024**3, samples=[(NOW_US - 100_000, 40, 20)]),
            FakeProcess(301, used_bytes=64 * 1024**2),
        ],
    )


def test_each_process_has_its_pod_its_newest_utilisation_and_its_memory(proc: Path) -> None:
    """Every process NVML lists gets its pod UID and container from /proc, its newest sample, and its VRAM."""
    sample = read(collector_for(FakeNvml([shared_gpu()]), proc))
    assert sample.processes == (
        ProcessUsage(101, POD_A, CONTAINER_A, 30.0, 12.0, 2 * 1024**3),
        ProcessUsage(102, POD_A, CONTAINER_A, 15.0, 3.0, 1024**3),
        ProcessUsage(201, POD_B, CONTAINER_B, 40.0, 20.0, 4 * 1024**3),
        ProcessUsage(301, "", None, 0.0, 0.0, 64 * 1024**2),  # listed, no sample: it ran no kernel
    )
    assert process_errors(sample) == []


def test_no_process_ran_reads_as_zero_for_each_listed_process(proc: Path) -> None:
    """NVML's NOT_FOUND means no process ran since the timestamp: every listed process is at 0, not unknown."""
    device = FakeDevice("GPU-idle", processes=[FakeProcess(101, samples=[(NOW_US - 5_000_000, 90, 50)])])
    sample = read(collector_for(FakeNvml([device]), proc))
    assert sample.processes is not None
    [process] = sample.processes
    assert (process.sm_percent, process.memory_utilization_percent) == (0.0, 0.0)


def test_an_older_driver_answers_through_the_older_call(proc: Path) -> None:
    """Without nvmlDeviceGetProcessesUtilizationInfo, nvmlDeviceGetProcessUtilization gives the same figures."""
    device = shared_gpu()
    device.errors["nvmlDeviceGetProcessesUtilizationInfo"] = FUNCTION_NOT_FOUND
    nvml = FakeNvml([device])
    sample = read(collector_for(nvml, proc))
    assert sample.processes is not None
    assert [p.sm_percent for p in sample.processes] == [30.0, 15.0, 40.0, 0.0]
    assert nvml.calls["nvmlDeviceGetProcessUtilization"] == 1
    assert process_errors(sample) == []


def test_without_per_process_utilisation_the_shares_are_unknown_not_zero(proc: Path) -> None:
    """A GPU that reports no per-process utilisation keeps the processes' memory and leaves SM shares unknown."""
    device = shared_gpu()
    device.errors["nvmlDeviceGetProcessesUtilizationInfo"] = NOT_SUPPORTED
    device.errors["nvmlDeviceGetProcessUtilization"] = NOT_SUPPORTED
    sample = read(collector_for(FakeNvml([device]), proc))
    assert sample.processes is not None
    assert [p.sm_percent for p in sample.processes] == [None] * 4
    assert [p.memory_used_bytes for p in sample.processes] == [2 * 1024**3, 1024**3, 4 * 1024**3, 64 * 1024**2]
    [error] = [e for e in sample.errors if e.field == "process_utilization"]
    assert error.kind is ReadErrorKind.NOT_SUPPORTED
    assert "nvmlDeviceGetProcessUtilization(gpu 0)" in error.detail


def test_pids_outside_our_pid_namespace_say_what_to_change(tmp_path: Path) -> None:
    """When no PID NVML lists is in /proc, processes are absent with a reason naming the host PID namespace."""
    sample = read(collector_for(FakeNvml([shared_gpu()]), tmp_path))
    assert sample.processes is None
    [error] = [e for e in sample.errors if e.field == PROCESSES_FIELD]
    assert "none of the 4 processes" in error.detail
    assert "hostPID" in error.detail
    assert "agent.processes.enabled" in error.detail


def test_a_process_that_exited_between_the_calls_has_no_pod(proc: Path) -> None:
    """A PID whose cgroup cannot be read has pod_uid None (unknown), not a pod's and not a host's."""
    device = shared_gpu()
    device.processes.append(FakeProcess(999, samples=[(NOW_US - 100_000, 5, 1)]))
    sample = read(collector_for(FakeNvml([device]), proc))
    assert sample.processes is not None
    assert sample.processes[-1] == ProcessUsage(999, None, None, 5.0, 1.0, 1024**3)


def test_processes_off_reads_none_and_asks_nvml_nothing(proc: Path) -> None:
    """Without a ProcReader the collector lists no processes: processes is None, with no error."""
    nvml = FakeNvml([shared_gpu()])
    collector = NvmlCollector(node="node-a", nvml=nvml)
    collector.open()
    sample = read(collector)
    assert sample.processes is None
    assert "nvmlDeviceGetComputeRunningProcesses" not in nvml.calls


@pytest.mark.parametrize(
    ("cgroup", "pod_uid", "container"),
    [
        pytest.param(systemd_cgroup(POD_A, CONTAINER_A, "besteffort"), POD_A, CONTAINER_A, id="systemd-containerd"),
        pytest.param(f"0::/kubepods/pod{POD_B}/crio-{CONTAINER_B}.scope\n", POD_B, CONTAINER_B, id="cgroupfs-crio"),
        pytest.param(
            f"0::/kubepods.slice/kubepods-pod{POD_A.replace('-', '_')}.slice/docker-{CONTAINER_A}.scope",
            POD_A,
            CONTAINER_A,
            id="guaranteed-docker",
        ),
        pytest.param(f"0::/kubepods/burstable/pod{POD_A}\n", POD_A, "", id="pod-level-process"),
        pytest.param("0::/kubepods/burstable/pod" + "c" * 32 + "/" + "d" * 64, "c" * 32, "d" * 64, id="static-pod"),
        pytest.param("0::/user.slice/user-1000.slice/session-2.scope\n", "", "", id="host-process"),
        pytest.param("", "", "", id="empty"),
    ],
)
def test_cgroup_paths_name_the_pod_and_container(cgroup: str, pod_uid: str, container: str) -> None:
    """The runtimes' and cgroup drivers' spellings all give the pod UID (with dashes) and the container id."""
    found = container_of(cgroup)
    assert (found.pod_uid, found.container_id) == (pod_uid, container)


def test_uid_keys_match_across_spellings() -> None:
    """A UID from the API and the same UID from a systemd slice compare equal by their key."""
    assert uid_key(POD_A) == uid_key(POD_A.replace("-", "_").upper())
    assert uid_key(POD_A) != uid_key(POD_B)
