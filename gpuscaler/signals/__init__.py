"""Answering a query from snapshots: evaluation, the evaluator, engine signals, shares, energy, activation."""
