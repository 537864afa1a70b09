"""Measurements of the agent (and the gateway) on the machine at hand; ``make bench`` runs them."""
