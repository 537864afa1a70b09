"""Tests of the gateway: its flags, pod and ScaledObject watches, cluster view, telemetry and the whole process."""
