"""Tests of the collectors: NVML against a fake pynvml (GPM, processes), and fake GPUs with their scenarios."""
