"""Which pods hold which GPUs: the kubelet's PodResources API on the agent, pod labels and owners on the gateway."""
