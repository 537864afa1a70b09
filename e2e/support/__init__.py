"""Helpers shared by the end-to-end tests and the benchmarks: agent processes, clients, certificates."""
