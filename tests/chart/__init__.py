"""Tests of the Helm chart with the real helm, and of its manifests against the Kubernetes API schemas."""
