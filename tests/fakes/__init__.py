"""Hand-written stand-ins for what CI does not have: NVML, GPUs, a kubelet."""
