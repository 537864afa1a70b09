"""Answering a query from snapshots: evaluation, the evaluator, rates, shares, energy, activation, HPA math."""
