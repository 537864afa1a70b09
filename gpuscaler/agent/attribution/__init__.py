"""Which pods hold which GPUs on a node: the kubelet's PodResources API, and its device ids mapped to NVML's GPUs."""
