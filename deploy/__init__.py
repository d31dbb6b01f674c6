"""Deployment files for hybridmon; see deploy/README.md."""
