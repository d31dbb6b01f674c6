"""Prometheus rules generated from the agent's thresholds (`python -m rules.generate`)."""
