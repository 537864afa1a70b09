"""The KEDA e2e suite: a real control plane and the real KEDA operator on loopback, against gpuscaler processes."""
