"""Where samples come from: NVML on a GPU node, or fake GPUs for development and tests."""

from gpuscaler.agent.collectors.base import Collector, CollectorUnavailable

__all__ = ["Collector", "CollectorUnavailable"]
