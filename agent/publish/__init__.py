"""What the agent hands out, below the daemon that assembles it: Prometheus exposition of the
samples and of its own series (exposition.py, exposition_lines.py), findings as metrics and JSON
(findings.py), pushes to Alertmanager (alertmanager.py)."""
