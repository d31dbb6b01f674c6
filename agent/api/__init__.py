"""The agent's HTTP API over the running agent (server.py): /metrics, /healthz, the findings,
the runbooks rendered to HTML (runbooks.py), the status page, POST /api/v1/bench (bench_api.py),
on a uvicorn hardened against idle and dripping clients (httpserver.py)."""
