"""The chart on a real node: kubelet, containerd, kube-scheduler, kube-proxy, CoreDNS (``make e2e-node``)."""
