"""HTTP API: /metrics for Prometheus and /healthz for liveness checks (503 once the agent stalled:
agent/loop/liveness.py).

/metrics answers GET and HEAD (the same headers, no body: uvicorn drops a HEAD response's body and
keeps its Content-Length), in the text format unless Accept negotiates OpenMetrics, gzipped when
Accept-Encoding allows it (agent/publish/exposition.py: choose_format, accepts_gzip).

The routes live here; the server under them, and what it does against hostile clients, in
agent/api/httpserver.py.
"""
from __future__ import annotations

import logging
import socket
import sys

import anyio
from fastapi import FastAPI, Query, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response

from hybridmon import __version__
from hybridmon.agent.api.bench_api import BenchService, router as bench_router
from hybridmon.agent.daemon import Agent
from hybridmon.agent.publish.exposition import CONTENT_TYPES, accepts_gzip, choose_format
from hybridmon.agent.publish.findings import findings_json, iso_time
from hybridmon.agent.loop import liveness
from hybridmon.agent.api.httpserver import LISTEN_BACKLOG, ServerLimits, build_server, stop_aggregating
from hybridmon.agent.api.runbooks import RunbookLibrary
from hybridmon.agent.api.web_config import WebConfigFile, WebConfigMiddleware
from hybridmon.agent.warmup import warming_up

log = logging.getLogger(__name__)

SWITCH_INTERVAL_SECONDS = 0.001  # sys.setswitchinterval while serving; see serve()


# On every answer (issue 30). nosniff: a browser never reads a body as another type than declared
# (a model name echoed in /metrics text rendered as HTML). Framing denied: nothing here is meant to
# be embedded, so no page can be clickjacked. no-store: every answer is a live reading, and a
# proxy's stale /healthz or /metrics would hide an outage. No referrer: runbook links leave nothing
# of the agent's address behind.
PROTECTIVE_HEADERS = ((b"x-content-type-options", b"nosniff"), (b"x-frame-options", b"DENY"),
                      (b"cache-control", b"no-store"), (b"referrer-policy", b"no-referrer"))
# The status page and the runbooks are HTML with inline <style> and style attributes and inline SVG,
# no script, no form, nothing fetched: everything else is refused, so an injected <script> or
# <img> (were escaping ever missed) does nothing.
PAGE_POLICY = (b"default-src 'none'; style-src 'unsafe-inline'; img-src data:; base-uri 'none'; "
               b"form-action 'none'; frame-ancestors 'none'")


class ProtectiveHeaders:
    """ASGI middleware adding PROTECTIVE_HEADERS to every response, and PAGE_POLICY as the
    Content-Security-Policy of every HTML one; a header the route set itself is kept. Plain ASGI,
    not Starlette's BaseHTTPMiddleware, which would run each /metrics answer through a second task."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def with_headers(message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", ()))
                present = {name.lower() for name, _ in headers}
                headers += [(name, value) for name, value in PROTECTIVE_HEADERS if name not in present]
                html = any(name.lower() == b"content-type" and value.startswith(b"text/html")
                           for name, value in headers)
                if html and b"content-security-policy" not in present:
                    headers.append((b"content-security-policy", PAGE_POLICY))
                message = {**message, "headers": headers}
            await send(message)
        await self.app(scope, receive, with_headers)


def create_app(agent: Agent, web_config: WebConfigFile | None = None) -> FastAPI:
    app = FastAPI(title="hybridmon", version=__version__, docs_url=None, redoc_url=None, openapi_url=None)
    if web_config is not None:
        # Every route, /healthz included, as exporter-toolkit protects every path; added first, so
        # that it runs inside ProtectiveHeaders and a 401 gets the protective headers too.
        app.add_middleware(WebConfigMiddleware, source=web_config)
    app.add_middleware(ProtectiveHeaders)

    # async: answered on the event loop's thread. A sync route runs in a worker thread, and each
    # hand-over between threads waits for the GIL, up to the switch interval while a tick's
    # collectors or the detectors hold it: paced scrapes paid those waits. The samples are rendered
    # and compressed at each collector's commit (agent/publish/exposition.py); a scrape joins them
    # and renders what changes at every scrape (~0.5 ms on the 8-GPU host).
    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        exposition_format = choose_format(request.headers.get("accept"))
        gzipped = accepts_gzip(request.headers.get("accept-encoding"))
        body = agent.exposition.render(exposition_format, gzipped=gzipped)
        # The answer depends on both headers: a cache in between must key on them.
        headers = {"Vary": "Accept, Accept-Encoding"}
        if gzipped:
            headers["Content-Encoding"] = "gzip"
        return Response(body, media_type=CONTENT_TYPES[exposition_format], headers=headers)

    # HEAD by the same function, as its own route: one route with both methods gives the OpenAPI
    # description two operations with one id (FastAPI warns "Duplicate Operation ID").
    app.add_api_route("/metrics", metrics, methods=["HEAD"], include_in_schema=False)

    @app.get("/healthz")
    def healthz() -> JSONResponse:
        collectors = {
            item.collector.name: {
                "success": item.state.last_success,
                "no_data": item.state.no_data_reason,
                "last_error": item.state.last_error,
                "runs": item.state.runs,
                "running_seconds": (None if item.state.running_since is None
                                    else round(agent.sampler.monotonic() - item.state.running_since, 1)),
            }
            for item in agent.sampler.scheduled
        }
        # 503 with the reasons when the loop, every collector or the detectors stalled
        # (agent/loop/liveness.py): the liveness probe restarts the agent, a person reads why.
        stalled = liveness.problems(agent)
        # A hung collector is shown, not fatal: a restart would not unblock its source (a wedged
        # driver) and would blind the other collectors (agent/loop/liveness.py). Its series are
        # withheld from /metrics meanwhile.
        hung_seconds = agent.exposition.hung_seconds or agent.thresholds.collector_failing.hung_seconds
        degraded = [f"collector {name} has not returned from its run for {running:.0f} s (hung from "
                    f"{hung_seconds:g} s): its series are withheld from /metrics"
                    for name, running in sorted(agent.sampler.hung(hung_seconds).items())]
        status = "stalled" if stalled else "degraded" if degraded else "ok"
        return JSONResponse({"status": status, "problems": stalled, "degraded": degraded,
                             "mode": agent.mode, "version": __version__, "collectors": collectors,
                             "alertmanager": _alertmanager_health(agent)},
                            status_code=503 if stalled else 200)

    finding_states = ("pending", "firing", "resolved")

    @app.get("/api/v1/findings")
    def findings(state: str = Query("firing,pending", max_length=64)) -> JSONResponse:
        wanted = [part for part in state.split(",") if part]
        unknown = sorted(set(wanted) - set(finding_states))
        if unknown or not wanted:
            return JSONResponse(
                {"error": f"state must be a comma-separated subset of {', '.join(finding_states)}"},
                status_code=400,
            )
        # An empty list is "nothing wrong" only once every detector has judged: until then,
        # warming_up names the ones that have not (agent/warmup.py), and status says so.
        warming = warming_up(agent.engine, agent.sampler.scheduled)
        return JSONResponse({
            "evaluated_at": iso_time(agent.engine.last_evaluated_at),
            "status": "warming_up" if warming else "judged",
            "warming_up": [w.to_json() for w in warming],
            "findings": findings_json(agent.engine, agent.runbook_base_url, wanted),
        })

    from hybridmon.agent.status.page import render_status_page

    @app.get("/", response_class=HTMLResponse)
    async def status_page() -> HTMLResponse:
        # In a worker thread, as a sync route is, but abandoned when the server's shutdown cancels
        # it: a render still running at SIGTERM must not hold the agent's exit (issue 30: 65 s).
        page = await anyio.to_thread.run_sync(render_status_page, agent, abandon_on_cancel=True)
        return HTMLResponse(page)

    runbooks = RunbookLibrary()

    @app.get("/runbooks", response_class=HTMLResponse)
    def runbook_index() -> HTMLResponse:
        return HTMLResponse(runbooks.index_html())

    @app.get("/runbooks/{name}", response_class=HTMLResponse)
    def runbook(name: str) -> HTMLResponse:
        page = runbooks.page_html(name)
        if page is None:
            return HTMLResponse(runbooks.not_found_html(name), status_code=404)
        return HTMLResponse(page)

    app.state.bench = BenchService(agent.config, agent.history, agent.mode)
    app.include_router(bench_router(app.state.bench))
    return app


def _alertmanager_health(agent: Agent) -> dict:
    """Delivery state per Alertmanager (agent/publish/alertmanager.py), {} when pushing is off."""
    health = getattr(agent.pusher, "health", None) if agent.pusher is not None else None
    return health() if health is not None else {}


def listen_url(host: str, port: int, path: str = "/metrics", scheme: str = "http") -> str:
    """http://127.0.0.1:9787/metrics; an IPv6 host in brackets, as a URL needs it: http://[::1]:9787/metrics."""
    return f"{scheme}://{_url_host(host)}:{port}{path}"


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind before starting uvicorn, so a taken port is our clear error, not a server traceback."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP explicitly: asyncio turns TCP_NODELAY on for accepted connections only when the
    # listening socket says it is TCP. Without it Nagle holds the response's second write for the
    # peer's delayed ACK and every keep-alive scrape waits ~40 ms.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as error:
        sock.close()
        raise OSError(error.errno, f"cannot listen on {_url_host(host)}:{port}: {error.strerror}") from None
    sock.listen(LISTEN_BACKLOG)
    sock.set_inheritable(True)
    return sock


def serve(agent: Agent, sock: socket.socket, log_level: str, limits: ServerLimits = ServerLimits(),
          web_config: WebConfigFile | None = None) -> None:
    """Serve until SIGTERM/SIGINT (uvicorn handles them and returns within
    limits.graceful_shutdown_seconds and a little more, whatever the clients do)."""
    # A scrape's thread waits for the GIL whenever a collector or the detectors hold it, up to the
    # switch interval (5 ms by default) at each hand-over; 1 ms keeps a scrape that lands on a tick
    # or an evaluation near its own cost. Only CPU-bound threads running together switch more often.
    # With both cores busy (issue 33, benchmarks/scrape_under_load.py, two daemons side by side
    # under one Prometheus) 1 ms kept p99 at 34 ms where 5 ms let it reach 96 ms.
    sys.setswitchinterval(SWITCH_INTERVAL_SECONDS)
    server = build_server(create_app(agent, web_config), limits, log_level, web_config)
    try:
        server.run(sockets=[sock])
    finally:
        stop_aggregating(server)
