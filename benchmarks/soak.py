"""Soak: the agent scraped 10 times a second for half an hour while hostile clients hammer it.

Starts `python -m hybridmon.agent.cli run` on the fixture host (tests/fixtures/host-2node, fake NVML) on
127.0.0.1 and a free port, then for --duration seconds runs, each in its own thread:

- scrapes:    GET /metrics at --scrape-rate per second over one keep-alive connection (as
              Prometheus does), latency of each, failures counted (a new connection after one);
- idle:       20 connections a second that send nothing, up to 400 held at once (oldest closed);
- slowloris:  10 connections dripping one header byte a second, reopened when closed;
- garbage:    5 malformed requests a second;
- non-reader: a connection every 2 s with a 4 KiB receive buffer that pipelines 50 scrapes and
              never reads, up to 20 held at once.

With --watched N, N real processes named llama-server (copies of sleep) run beside it and the
agent reads this machine's /proc, so it watches N processes; with --models M, an inference
endpoint (tests/support/fake_inference_server.py) answers a vLLM body of M models, three series
each (36,000 is a 7.9 MB body, under the 8 MiB max_body_bytes, 2,250 times the 16 models kept),
as a peer that publishes more than it should (issue 30).

Every second it samples the agent's RSS, open fds and CPU time (psutil). At the end it sends
SIGTERM and times the stop, and prints p50/p99/max scrape latency, max RSS, max fds, CPU % of one
core, log bytes written and the stop time; --json prints the same as JSON. Everything it starts is
stopped on success, error, Ctrl-C or SIGTERM. Not a test: the suite has the short, bounded
versions (tests/integration/test_server_hostile_clients.py).

    .venv/bin/python benchmarks/soak.py [--duration 1800] [--scrape-rate 10] [--fd-limit 1024]
        [--watched 64] [--models 36000] [--json]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import psutil

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # `tests` (the fixture host, the fake NVML) is not installed

from tests.support.agent_helpers import FIXTURE_ENVIRONMENT, HYBRIDMON, free_port, subprocess_environment  # noqa: E402
from tests.support.fake_inference_server import FakeInferenceServer, vllm_with_models  # noqa: E402

MIB = 1024**2


@dataclass
class Counts:
    scrapes: int = 0
    scrape_failures: int = 0
    idle_opened: int = 0
    slowloris_opened: int = 0
    garbage_sent: int = 0
    non_readers_opened: int = 0
    connect_failures: int = 0
    scrape_seconds: list[float] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, attribute: str) -> None:
        """Several threads count connect failures: += alone could lose some."""
        with self._lock:
            setattr(self, attribute, getattr(self, attribute) + 1)


@dataclass
class Summary:
    duration_seconds: float
    scrapes: int
    scrape_failures: int
    scrape_p50_ms: float
    scrape_p99_ms: float
    scrape_max_ms: float
    max_rss_mib: float
    final_rss_mib: float
    max_fds: int
    cpu_percent_of_one_core: float
    log_bytes: int
    stop_seconds: float
    exit_code: int | None
    hostile: dict[str, int]


def connect(port: int, receive_buffer: int | None = None) -> socket.socket:
    conn = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    conn.settimeout(2)
    if receive_buffer is not None:
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    try:
        conn.connect(("127.0.0.1", port))
    except OSError:
        conn.close()
        raise
    return conn


def paced(stop: threading.Event, per_second: float):
    """Yields at `per_second`, on a fixed schedule (a slow iteration is not made up twice)."""
    period = 1.0 / per_second
    next_at = time.monotonic()
    while not stop.is_set():
        yield
        next_at = max(next_at + period, time.monotonic())
        stop.wait(max(0.0, next_at - time.monotonic()))


def scraper(port: int, rate: float, stop: threading.Event, counts: Counts) -> None:
    client = httpx.Client(timeout=5)
    try:
        for _ in paced(stop, rate):
            started = time.perf_counter()
            try:
                ok = client.get(f"http://127.0.0.1:{port}/metrics").status_code == 200
            except httpx.HTTPError:
                ok = False
            if ok:
                counts.scrapes += 1
                counts.scrape_seconds.append(time.perf_counter() - started)
            else:
                counts.scrape_failures += 1
                client.close()
                client = httpx.Client(timeout=5)
    finally:
        client.close()


def holder(port: int, stop: threading.Event, counts: Counts, attribute: str, per_second: float, keep: int,
           first_bytes: bytes = b"", receive_buffer: int | None = None) -> None:
    """Opens connections at `per_second`, sends `first_bytes`, holds at most `keep` of them."""
    held: deque[socket.socket] = deque()
    try:
        for _ in paced(stop, per_second):
            try:
                conn = connect(port, receive_buffer)
                if first_bytes:
                    conn.sendall(first_bytes)
            except OSError:
                counts.add("connect_failures")
                continue
            counts.add(attribute)
            held.append(conn)
            while len(held) > keep:
                held.popleft().close()
    finally:
        for conn in held:
            conn.close()


def slowloris(port: int, stop: threading.Event, counts: Counts, connections: int = 10) -> None:
    open_: list[socket.socket] = []
    try:
        for _ in paced(stop, 1.0):
            alive = []
            for conn in open_:
                try:
                    conn.sendall(b"X")
                    alive.append(conn)
                except OSError:
                    conn.close()
            open_ = alive
            while len(open_) < connections and not stop.is_set():
                try:
                    conn = connect(port)
                    conn.sendall(b"GET /metrics HTTP/1.1\r\nX-Slow: ")
                except OSError:
                    counts.add("connect_failures")
                    break
                counts.add("slowloris_opened")
                open_.append(conn)
    finally:
        for conn in open_:
            conn.close()


def garbage(port: int, stop: threading.Event, counts: Counts) -> None:
    for _ in paced(stop, 5.0):
        try:
            with connect(port) as conn:
                conn.sendall(b"\x00\xff\xfe not http \r\n\r\n")
                conn.recv(4096)
            counts.add("garbage_sent")
        except OSError:
            counts.add("connect_failures")


def percentile(values: list[float], fraction: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def watched_processes(workdir: Path, count: int) -> list[subprocess.Popen]:
    """`count` processes named llama-server (sleep, copied under that name): the agent's default
    patterns watch them."""
    if not count:
        return []
    binary = workdir / "llama-server"
    shutil.copy(shutil.which("sleep"), binary)
    return [subprocess.Popen([str(binary), "86400"]) for _ in range(count)]


def soak(duration: float, scrape_rate: float, fd_limit: int | None, watched: int = 0, models: int = 0) -> Summary:
    port = free_port()
    workdir = Path(tempfile.mkdtemp(prefix="hybridmon-soak-"))
    log_path = workdir / "agent.log"
    environment = dict(FIXTURE_ENVIRONMENT)
    sleepers = watched_processes(workdir, watched)
    if watched:
        environment["HYBRIDMON_PATHS__PROCFS"] = "/proc"
    peer = FakeInferenceServer({"/metrics": [vllm_with_models(models)]}).__enter__() if models else None
    if peer is not None:
        environment["HYBRIDMON_INFERENCE__ENDPOINTS"] = json.dumps([{"url": peer.url("/metrics"), "server": "vllm"}])

    def lower_fd_limit() -> None:
        if fd_limit is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (fd_limit, fd_limit))

    with open(log_path, "wb") as log:
        agent = subprocess.Popen(HYBRIDMON + ["run", "--listen", f"127.0.0.1:{port}"],
                                 env=subprocess_environment(environment), cwd=REPO,
                                 stdout=log, stderr=subprocess.STDOUT, preexec_fn=lower_fd_limit)
    stop = threading.Event()
    threads: list[threading.Thread] = []
    counts = Counts()
    try:
        deadline = time.monotonic() + 30
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=1).status_code == 200:
                    break
            if agent.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the agent did not start:\n" + log_path.read_text()[-3000:])
            time.sleep(0.1)
        process = psutil.Process(agent.pid)
        workers = [
            (scraper, (port, scrape_rate, stop, counts)),
            (holder, (port, stop, counts, "idle_opened", 20.0, 400)),
            (holder, (port, stop, counts, "non_readers_opened", 0.5, 20,
                      b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n" * 50, 4096)),
            (slowloris, (port, stop, counts)),
            (garbage, (port, stop, counts)),
        ]
        for target, args in workers:
            thread = threading.Thread(target=target, args=args, daemon=True)
            thread.start()
            threads.append(thread)

        started = time.monotonic()
        cpu_start = sum(process.cpu_times()[:2])
        rss, fds = [], []
        while time.monotonic() - started < duration:
            rss.append(process.memory_info().rss)
            fds.append(process.num_fds())
            if agent.poll() is not None:
                raise RuntimeError(f"the agent exited (rc {agent.returncode}):\n" + log_path.read_text()[-3000:])
            time.sleep(min(1.0, max(0.0, duration - (time.monotonic() - started))))
        elapsed = time.monotonic() - started
        cpu = sum(process.cpu_times()[:2]) - cpu_start
        final_rss = process.memory_info().rss
        stop.set()
        for thread in threads:
            thread.join(10)

        stopping = time.monotonic()
        agent.send_signal(signal.SIGTERM)
        try:
            exit_code: int | None = agent.wait(60)
        except subprocess.TimeoutExpired:
            exit_code = None
        stop_seconds = time.monotonic() - stopping
        latencies = counts.scrape_seconds
        return Summary(
            duration_seconds=round(elapsed, 1),
            scrapes=counts.scrapes,
            scrape_failures=counts.scrape_failures,
            scrape_p50_ms=round(statistics.median(latencies) * 1000, 2) if latencies else float("nan"),
            scrape_p99_ms=round(percentile(latencies, 0.99) * 1000, 2),
            scrape_max_ms=round(max(latencies, default=float("nan")) * 1000, 2),
            max_rss_mib=round(max(rss) / MIB, 1),
            final_rss_mib=round(final_rss / MIB, 1),
            max_fds=max(fds),
            cpu_percent_of_one_core=round(100 * cpu / elapsed, 1),
            log_bytes=log_path.stat().st_size,
            stop_seconds=round(stop_seconds, 2),
            exit_code=exit_code,
            hostile={"idle": counts.idle_opened, "slowloris": counts.slowloris_opened,
                     "garbage": counts.garbage_sent, "non_readers": counts.non_readers_opened,
                     "connect_failures": counts.connect_failures},
        )
    finally:
        stop.set()
        for thread in threads:
            thread.join(10)
        if agent.poll() is None:
            agent.kill()
            agent.wait(10)
        for sleeper in sleepers:
            sleeper.kill()
            sleeper.wait(10)
        if peer is not None:
            peer.__exit__(None, None, None)
        shutil.rmtree(workdir)


def render(summary: Summary) -> str:
    hostile = ", ".join(f"{name} {count}" for name, count in summary.hostile.items())
    return "\n".join([
        f"soak: {summary.duration_seconds:.0f} s, {summary.scrapes} scrapes, {summary.scrape_failures} failed",
        f"scrape latency: p50 {summary.scrape_p50_ms} ms, p99 {summary.scrape_p99_ms} ms, max {summary.scrape_max_ms} ms",
        f"agent: max RSS {summary.max_rss_mib} MiB (at the end {summary.final_rss_mib} MiB), max fds {summary.max_fds}, "
        f"CPU {summary.cpu_percent_of_one_core} % of one core, log {summary.log_bytes} bytes",
        f"stop: exit {summary.exit_code} {summary.stop_seconds} s after SIGTERM",
        f"hostile connections: {hostile}",
    ])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=1800.0, metavar="SECONDS", help="default 1800")
    parser.add_argument("--scrape-rate", type=float, default=10.0, metavar="PER_SECOND", help="default 10")
    parser.add_argument("--fd-limit", type=int, metavar="N", help="the agent's RLIMIT_NOFILE (systemd's default: 1024)")
    parser.add_argument("--watched", type=int, default=0, metavar="N",
                        help="N processes named llama-server beside it, read from this machine's /proc")
    parser.add_argument("--models", type=int, default=0, metavar="M",
                        help="an inference endpoint publishing M models")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    args = parser.parse_args(argv)
    if args.duration <= 0 or args.scrape_rate <= 0:
        parser.error("--duration and --scrape-rate must be positive")
    # SIGTERM to the benchmark: the same clean-up as Ctrl-C.
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 4096)), hard))  # 400+ held sockets
    try:
        summary = soak(args.duration, args.scrape_rate, args.fd_limit, args.watched, args.models)
    except KeyboardInterrupt:
        print("soak: interrupted", file=sys.stderr)
        return 130
    except RuntimeError as error:
        print(f"soak: {error}", file=sys.stderr)
        return 1
    print(json.dumps(asdict(summary), indent=2) if args.json else render(summary))
    healthy = summary.scrape_failures == 0 and summary.exit_code == 0
    return 0 if healthy else 1


if __name__ == "__main__":
    sys.exit(main())
