"""Monitoring artefacts built from code: the Grafana dashboard the chart ships (``python -m monitoring.dashboard``)."""
