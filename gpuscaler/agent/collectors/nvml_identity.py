"""The facts that place a device by the names kubelet device plugins and DRA drivers give it: a GPU's minor number
(``/dev/nvidiaN``) and a MIG instance's GPU instance id, profile id and placement start, read from NVML once per
device.

A driver without the call, or a device it does not apply to, answers NOT_SUPPORTED or FUNCTION_NOT_FOUND: the fact
is then None, and a name that needs it is not placed (its pod's share is unknown), never guessed from the index.
Reading a MIG placement needs a privileged user (nvmlDeviceGetGpuInstanceById), which the chart's agent is not: any
refusal but a device gone leaves the placement unknown with NVML's reason, so discovery still lists every GPU; a
refused minor number is unknown too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import structlog

from gpuscaler.agent.collectors.nvml_calls import DEVICE_GONE, FUNCTION_NOT_FOUND, NOT_SUPPORTED, describe_error

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a MIG instance sits on its parent: its GPU instance's id, profile id and first memory slice."""

    # The GPU instance's id on its parent (GKE's device plugin names an instance ``nvidia<minor>/gi<id>``); read
    # before the GPU instance itself (which needs privilege), so it is kept where the profile and placement are refused.
    gpu_instance_id: int | None = None
    profile_id: int | None = None
    start: int | None = None
    # Why NVML would not say, where it refused (no permission) rather than lacked the call: names it cannot place
    # carry this reason.
    problem: str | None = None


def minor_number(nvml: Any, handle: Any) -> int | None:
    """The physical GPU's ``/dev/nvidiaN`` number, or None where NVML does not give one or refuses it (logged: the
    GPU is still listed, and only the names that need its number stay unplaced)."""
    try:
        return int(nvml.nvmlDeviceGetMinorNumber(handle))
    except nvml.NVMLError as error:
        if error.value in (NOT_SUPPORTED, FUNCTION_NOT_FOUND):
            return None
        if error.value in DEVICE_GONE:
            raise  # the device went: the discovery fails, as a device lost while listed does
        log.warning("minor_number_unreadable", reason=describe_error(error))
        return None


def mig_placement(nvml: Any, parent: Any, instance: Any) -> Placement:
    """A MIG instance's GPU instance id, profile id and placement start, through its GPU instance on ``parent``."""
    try:
        gpu_instance_id = int(nvml.nvmlDeviceGetGpuInstanceId(instance))
    except nvml.NVMLError as error:
        return _unread(nvml, error, None)
    try:
        info = nvml.nvmlGpuInstanceGetInfo(nvml.nvmlDeviceGetGpuInstanceById(parent, gpu_instance_id))
    except nvml.NVMLError as error:
        return _unread(nvml, error, gpu_instance_id)
    return Placement(gpu_instance_id=gpu_instance_id, profile_id=int(info.profileId), start=int(info.placement.start))


def _unread(nvml: Any, error: Any, gpu_instance_id: int | None) -> Placement:
    """The placement NVML would not give, keeping the GPU instance id where it was read."""
    if error.value in (NOT_SUPPORTED, FUNCTION_NOT_FOUND):
        return Placement(gpu_instance_id=gpu_instance_id)
    if error.value in DEVICE_GONE:
        raise error  # the device went: the discovery fails, as a device lost while listed does
    problem = f"NVML refused to read MIG placement: {describe_error(error)}"
    return Placement(gpu_instance_id=gpu_instance_id, problem=problem)
