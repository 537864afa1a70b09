"""The vocabulary every layer shares: GPU metrics, samples, pods, errors, durations, aggregation."""
