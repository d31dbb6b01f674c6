"""Rule detectors: small units that read the agent's history and return findings."""
