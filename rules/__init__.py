"""Prometheus rules generated from the agent's thresholds (`python -m hybridmon.rules.generate`)."""
