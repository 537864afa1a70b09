"""A real Prometheus scraping live agents and a gateway as the chart's ServiceMonitor says, with the shipped rules."""
