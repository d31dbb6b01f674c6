"""POST /api/v1/bench starts an offload benchmark beside a live server; GET /api/v1/bench says how it
goes. Starting one is guarded three ways, because a benchmark saturates the PCIe link and takes GPU
memory from whatever runs there:

- a bearer token (the file named by bench.api_token_file; without one the endpoint is off);
- a GPU in use (compute processes, or busy over the last minute, as the agent sees it) is refused
  unless the request says "force": true;
- one benchmark at a time.
"""
from __future__ import annotations

import hmac
import logging
import os
import stat
import threading
import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from hybridmon.agent.bench.build import BenchBuildError, locate_binary
from hybridmon.agent.bench.runner import BenchError, BenchRunner, GpuActivity, busy_reason
from hybridmon.agent.config import AgentConfig
from hybridmon.agent.detectors import common, windows
from hybridmon.agent.loop.history import History
from hybridmon.exporters.bench_report import Progress, ReportError
from hybridmon.exporters.gpu import GPU_INFO, PROCESS_MEMORY_USED, UTILIZATION
from hybridmon.exporters.jsonsafe import loads_bounded
from hybridmon.exporters.nvml import GpuLostError

log = logging.getLogger(__name__)

MIN_TOKEN_LENGTH = 16
MAX_TOKEN_FILE_CHARS = 4096
MAX_BODY_BYTES = 4096
MAX_BODY_DEPTH = 4
"""The body is one flat object; a little nesting still gets pydantic's error naming the field."""


class BenchRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    gpu: int | None = Field(default=None, ge=0, le=1023)
    force: bool = False


def load_token(path: str | None) -> str | None:
    """The bearer token, or None (endpoint off) with the reason logged."""
    if not path:
        return None
    try:
        mode = os.stat(path).st_mode
        with open(path, encoding="utf-8") as handle:
            token = handle.read(MAX_TOKEN_FILE_CHARS).strip()  # bounded: the path may be a device
    except (OSError, UnicodeDecodeError) as error:
        log.error("benchmark endpoint off: token file %s cannot be read (%s)", path, error)
        return None
    if len(token) < MIN_TOKEN_LENGTH or any(c.isspace() for c in token):
        log.error("benchmark endpoint off: the token in %s must be at least %d characters without "
                  "spaces (e.g. `openssl rand -hex 32`)", path, MIN_TOKEN_LENGTH)
        return None
    if mode & (stat.S_IRGRP | stat.S_IROTH | stat.S_IWGRP | stat.S_IWOTH):
        # Anyone who can read it can start benchmarks; anyone who can write it can set their own.
        log.error("benchmark endpoint off: token file %s is open to other users (mode %s); "
                  "`chmod 600 %s` and restart", path, stat.filemode(mode), path)
        return None
    return token


class BenchService:
    """Runs at most one benchmark in a background thread and keeps its status."""

    def __init__(self, config: AgentConfig, history: History, mode: str) -> None:
        self.config, self.history, self.mode = config, history, mode
        self.token = load_token(config.bench.api_token_file)
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.status: dict[str, Any] = {"state": "idle"}

    def authorized(self, header: str | None) -> bool:
        """An `Authorization: Bearer <token>` header with this agent's token; the scheme name is
        case-insensitive (RFC 7235 section 2.1), the token is not."""
        if self.token is None or not header:
            return False
        scheme, _, credentials = header.strip().partition(" ")
        if scheme.lower() != "bearer":
            return False
        # compare_digest on bytes: a str with non-ASCII characters would raise TypeError.
        return hmac.compare_digest(credentials.strip().encode("utf-8", "surrogateescape"),
                                   self.token.encode())

    def known_gpus(self) -> list[int]:
        """GPUs the agent saw in its last minute of samples."""
        now = time.time()
        seen = common.gpu_latest(self.history, GPU_INFO.name, now)
        return sorted(int(gpu) for gpu, _uuid in seen if gpu.isdigit())

    def activity(self, gpu: int) -> GpuActivity:
        """What the agent saw on the GPU: its processes now, its utilization over the last minute."""
        now, wanted = time.time(), str(gpu)
        processes = []
        for series in self.history.series(PROCESS_MEMORY_USED.name, gpu=wanted):
            used = windows.latest(series, now)
            if used is not None:
                processes.append((int(series.labels["pid"]), series.labels["process_name"], int(used)))
        utilization = next((value for (index, _uuid), value in common.gpu_averages(
            self.history, UTILIZATION.name, now).items() if index == wanted), None)
        return GpuActivity(tuple(sorted(processes)), utilization)

    def start(self, request: BenchRequest) -> tuple[int, dict]:
        """(HTTP status, body) for a request that passed authentication."""
        if self.mode == "replay":
            return 409, {"error": "this agent replays a trace: there is no GPU to benchmark"}
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                return 409, {"error": "a benchmark is already running", "status": self.status}
            gpus = [request.gpu] if request.gpu is not None else self.known_gpus()
            if not gpus:
                return 409, {"error": "the agent has not seen any GPU (is the NVIDIA driver loaded?)"}
            threshold = self.config.bench.busy_utilization_at_least
            busy = {gpu: busy_reason(self.activity(gpu), threshold) for gpu in gpus}
            in_use = {str(gpu): why for gpu, why in busy.items() if why}
            if in_use and not request.force:
                return 409, {"error": "GPU in use: a benchmark would compete with it for the PCIe "
                             "link and GPU memory; retry in a quiet moment or send \"force\": true",
                             "busy": in_use}
            self.status = {"state": "running", "started_at": time.time(), "gpus": gpus,
                           "force": request.force, "busy": in_use, "progress": None}
            self._thread = threading.Thread(target=self._run, args=(gpus, request.force, busy),
                                            name="bench", daemon=True)
            self._thread.start()
            return 202, self.status

    def _progress(self, gpu: str, placement: str, step: Progress) -> None:
        self.status["progress"] = {"gpu": gpu, "placement": placement, "step": step.step,
                                   "steps": step.steps, "direction": step.direction,
                                   "memory": step.memory, "issue": step.issue,
                                   "transfer_bytes": step.transfer_bytes}

    def _run(self, gpus: list[int], force: bool, busy: dict[int, str | None]) -> None:
        results, errors = [], []
        try:
            bench = self.config.bench
            runner = BenchRunner(locate_binary(bench.binary), self.config.resolved_state_dir(),
                                 nvml_module=self.config.gpu.nvml_module, sysfs=self.config.paths.sysfs,
                                 procfs=self.config.paths.procfs,
                                 max_seconds=bench.max_seconds, repeat=bench.repeat,
                                 busy_utilization_at_least=bench.busy_utilization_at_least,
                                 progress=self._progress)
            for gpu in gpus:
                try:
                    record = runner.run_gpu(gpu, force=force, busy=busy.get(gpu))
                    results.append({"gpu": gpu, "pci_bus_id": record["gpu"]["pci_bus_id"]})
                except (BenchError, ReportError, GpuLostError, OSError) as error:
                    errors.append({"gpu": gpu, "error": str(error)})
        except (BenchBuildError, OSError) as error:
            errors.append({"gpu": None, "error": f"cannot build or find the benchmark: {error}"})
        except Exception as error:  # the status must end whatever happened in the thread
            log.exception("benchmark run failed")
            errors.append({"gpu": None, "error": f"internal error: {error}"})
        for problem in errors:
            log.error("benchmark: %s", problem["error"])
        self.status = {**self.status, "state": "failed" if errors else "finished",
                       "finished_at": time.time(), "results": results, "errors": errors}

    def wait(self, timeout: float) -> bool:
        """For tests and shutdown: True when no run is going on after `timeout`."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
            return not thread.is_alive()
        return True


def router(service: BenchService) -> APIRouter:
    routes = APIRouter()

    @routes.get("/api/v1/bench")
    def bench_status() -> JSONResponse:
        return JSONResponse({**service.status, "enabled": service.token is not None})

    @routes.post("/api/v1/bench")
    async def bench_start(request: Request) -> JSONResponse:
        if service.token is None:
            return JSONResponse({"error": "the benchmark endpoint is off: set bench.api_token_file "
                                 "to a file holding a token"}, status_code=403)
        if not service.authorized(request.headers.get("authorization")):
            return JSONResponse({"error": "a valid bearer token is required"}, status_code=401,
                                headers={"WWW-Authenticate": 'Bearer realm="hybridmon"'})
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > MAX_BODY_BYTES:
                return JSONResponse({"error": f"body over {MAX_BODY_BYTES} bytes"}, status_code=413)
        try:
            parsed = BenchRequest.model_validate(loads_bounded(bytes(body) or b"{}", MAX_BODY_BYTES,
                                                               MAX_BODY_DEPTH))
        except (ValueError, ValidationError) as error:
            return JSONResponse({"error": f"body must be JSON like {{\"gpu\": 0, \"force\": false}}: "
                                 f"{str(error)[:300]}"}, status_code=400)
        status, answer = service.start(parsed)
        return JSONResponse(answer, status_code=status)

    return routes
