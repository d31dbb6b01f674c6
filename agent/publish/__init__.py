"""What the agent hands out: the HTTP server and API (server.py, httpserver.py, bench_api.py),
Prometheus exposition (exposition.py), findings as metrics and JSON (findings.py), pushes to
Alertmanager (alertmanager.py) and the runbooks rendered to HTML (runbooks.py)."""
