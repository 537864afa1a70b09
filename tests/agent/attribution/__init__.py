"""Tests of pod attribution: kubelet device ids to GPUs, the PodResources reader, pods through an agent."""
