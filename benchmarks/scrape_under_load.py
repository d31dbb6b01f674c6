"""hybridmon's and node_exporter's scrape durations as a real Prometheus sees them, quiet or under load.

Issue 33: with both cores busy, a real Prometheus scraping every second saw hybridmon's
scrape_duration_seconds p99 at 9.9-94x node_exporter's p50. This runs, side by side on loopback:

- node_exporter (Debian's prometheus-node-exporter, its default collectors);
- the real `hybridmon run` on the 8-GPU / 16-process fake host, as benchmarks/daemon_long_run.py
  builds it (daemon_on_scaled_host: fake NVML, real watched children, a fake vLLM server);
- a real Prometheus (Debian's /usr/bin/prometheus) scraping both every second, with its own
  Accept and Accept-Encoding headers (OpenMetrics negotiated, gzip);
- with `--load busy`, one busy-loop process per CPU at normal priority (`--hogs` to change the
  count), started once both targets are up, running for the whole measurement;
- with `--frozen-copy`, a third job: benchmarks/frozen_copy_server.py serving one copy of
  hybridmon's /metrics, taken just before the measured window in the format Prometheus
  negotiates, and doing nothing else.
  Its scrape_duration_seconds is Prometheus's own share of a scrape of that body (decompressing,
  parsing and storing every sample), the floor under hybridmon's: at 256 watched processes
  (4,565 samples) it is most of hybridmon's p50 (docs/performance.md, "Scrapes under load"). It
  is one more body of that size a second for Prometheus to parse, so it is off by default and its
  runs are not compared with runs without it.

After a warm-up (WARMUP_SECONDS, not measured) it measures `--minutes`, then reads every
scrape_duration_seconds sample of each job in that window from Prometheus's API (and `up`, for
failed scrapes), and reports p50/p90/p99/max per job with the load average over the window, as a
table and with `--json-out` as JSON.

    .venv/bin/python benchmarks/scrape_under_load.py --minutes 3 --load busy --json-out busy.json
    .venv/bin/python benchmarks/scrape_under_load.py --minutes 3 --load quiet --json-out quiet.json

Everything it starts is stopped on success, failure, Ctrl-C, SIGTERM and when the time limit
(the run plus TIME_LIMIT_SLACK_SECONDS) runs out; its children also get SIGTERM if this script is
killed, and the temporary directory is removed.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.agent_bench import (NODE_EXPORTER, _die_with_parent, free_port, machine,  # noqa: E402
                                    managed_process, percentile, process_cpu_seconds, stop_process, tail,
                                    wait_for_metrics)
from benchmarks.daemon_long_run import daemon_on_scaled_host  # noqa: E402

PROMETHEUS = "prometheus"
JOBS = ("hybridmon", "node_exporter")
FROZEN_COPY_JOB = "hybridmon_frozen_copy"
FROZEN_COPY_SERVER = REPO / "benchmarks/frozen_copy_server.py"
# The frozen copy passes scrapes on to the daemon while it warms up (its findings fire in the
# first ~10 s) and keeps the body of the first scrape after it is told to, this long before the
# measured window: a scrape a second, so the window's scrapes all get the copy.
FREEZE_BEFORE_WINDOW_SECONDS = 3
# Scrapes before this are not measured: Prometheus's first scrapes, the daemon's first detector
# evaluations, the hogs' start.
WARMUP_SECONDS = 20
# Prometheus's scrape interval (the 1 s) and its timeout: a scrape slower than this fails
# (up = 0, counted as failed, its duration still recorded by Prometheus).
SCRAPE_INTERVAL = "1s"
# Starting node_exporter, the daemon (about 2 s, 60 s at most) and Prometheus, and stopping them.
TIME_LIMIT_SLACK_SECONDS = 240
LOAD_SAMPLE_SECONDS = 5.0
HOG = "while True:\n    pass\n"


def read_loadavg() -> tuple[float, float, float]:
    with open("/proc/loadavg", encoding="ascii") as handle:
        one, five, fifteen = handle.read().split()[:3]
    return float(one), float(five), float(fifteen)


@contextlib.contextmanager
def node_exporter(workdir: Path):
    """node_exporter with its default collectors on a free loopback port; yields (its process, host:port)."""
    import httpx

    binary = shutil.which(NODE_EXPORTER)
    if binary is None:
        raise SystemExit(f"{NODE_EXPORTER} is not installed: apt-get install prometheus-node-exporter")
    address = f"127.0.0.1:{free_port()}"
    log_path = workdir / "node_exporter.log"
    with managed_process([binary, f"--web.listen-address={address}"], log_path) as exporter, \
            httpx.Client(timeout=10.0) as client:
        wait_for_metrics(client, f"http://{address}/metrics", ("node_cpu_seconds_total",), exporter, 30.0,
                         log_path)
        yield exporter, address


@contextlib.contextmanager
def prometheus(workdir: Path, targets: dict[str, str]):
    """A real Prometheus scraping each job's target (host:port) every SCRAPE_INTERVAL; yields its
    base URL once it is ready."""
    import httpx

    binary = shutil.which(PROMETHEUS)
    if binary is None:
        raise SystemExit(f"{PROMETHEUS} is not installed: apt-get install prometheus")
    config = workdir / "prometheus.yml"
    config.write_text(json.dumps({  # JSON is YAML
        "global": {"scrape_interval": SCRAPE_INTERVAL, "scrape_timeout": SCRAPE_INTERVAL},
        "scrape_configs": [{"job_name": job, "static_configs": [{"targets": [target]}]}
                           for job, target in targets.items()],
    }))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = workdir / "prometheus.log"
    command = [binary, f"--config.file={config}", f"--storage.tsdb.path={workdir / 'tsdb'}",
               f"--web.listen-address=127.0.0.1:{port}"]
    with managed_process(command, log_path) as server, httpx.Client(timeout=10.0) as client:
        deadline = time.monotonic() + 30
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"prometheus exited with {server.returncode}:\n{tail(log_path)}")
            with contextlib.suppress(httpx.HTTPError):
                if client.get(f"{url}/-/ready").status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"prometheus not ready within 30 s:\n{tail(log_path)}")
            time.sleep(0.2)
        yield url


@contextlib.contextmanager
def frozen_copy(workdir: Path, upstream_url: str, wanted: bool):
    """benchmarks/frozen_copy_server.py copying `upstream_url` on a free loopback port; yields
    {FROZEN_COPY_JOB: (its process, its host:port)}, or {} when not `wanted`."""
    if not wanted:
        yield {}
        return
    port = free_port()
    command = [sys.executable, str(FROZEN_COPY_SERVER), upstream_url, str(port)]
    with managed_process(command, workdir / "frozen_copy.log") as server:
        yield {FROZEN_COPY_JOB: (server, f"127.0.0.1:{port}")}


@contextlib.contextmanager
def cpu_hogs(count: int):
    """`count` busy-loop processes at normal priority, stopped on exit."""
    hogs = [subprocess.Popen([sys.executable, "-c", HOG], stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent)
            for _ in range(count)]
    try:
        yield hogs
    finally:
        for hog in hogs:
            stop_process(hog)


def query(url: str, expr: str, at: float) -> list[dict]:
    import httpx

    body = httpx.get(f"{url}/api/v1/query", params={"query": expr, "time": at}, timeout=30).json()
    if body.get("status") != "success":
        raise RuntimeError(f"{expr}: {body}")
    return body["data"]["result"]


def raw_samples(url: str, metric: str, job: str, start: float, end: float) -> list[float]:
    """Every sample of `metric` for `job` stored in (start, end], by a range selector at `end`."""
    window = max(1, round(end - start))
    result = query(url, f'{metric}{{job="{job}"}}[{window}s]', end)
    return [float(value) for series in result for _at, value in series["values"]]


def summarize(durations: list[float], up: list[float]) -> dict:
    if not durations:
        return {"scrapes": 0, "failed": sum(1 for value in up if value == 0.0)}
    ms = [seconds * 1000 for seconds in durations]
    return {"scrapes": len(ms), "failed": sum(1 for value in up if value == 0.0),
            **{f"p{q}_ms": round(percentile(ms, q), 2) for q in (50, 90, 99)}, "max_ms": round(max(ms), 2)}


def wait_until_up(url: str, jobs: tuple[str, ...], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        up = {series["metric"]["job"]: series["value"][1] for series in query(url, "up", time.time())}
        if all(up.get(job) == "1" for job in jobs):
            return
        time.sleep(0.5)
    raise RuntimeError(f"Prometheus did not see {jobs} up within {timeout:.0f} s")


def measure(minutes: float, load: str, hogs: int, gpus: int, processes: int, workdir: Path,
            with_frozen_copy: bool = False) -> dict:
    with node_exporter(workdir) as (exporter, node_address), \
            daemon_on_scaled_host(workdir, gpus, processes) as (daemon, daemon_url, log_path), \
            frozen_copy(workdir, daemon_url, with_frozen_copy) as copies, \
            prometheus(workdir, {"hybridmon": daemon_url.split("/")[2], "node_exporter": node_address,
                                 **{job: address for job, (_server, address) in copies.items()}}) as url, \
            cpu_hogs(hogs if load == "busy" else 0):
        jobs_scraped = JOBS + tuple(copies)
        wait_until_up(url, jobs_scraped, 30)
        time.sleep(WARMUP_SECONDS - FREEZE_BEFORE_WINDOW_SECONDS)
        for server, _address in copies.values():
            server.send_signal(signal.SIGUSR1)  # the copy is taken from the warmed-up daemon
        time.sleep(FREEZE_BEFORE_WINDOW_SECONDS)
        start = time.time()
        end = start + minutes * 60
        loads = []
        pids = {"hybridmon": daemon.pid, "node_exporter": exporter.pid,
                **{job: server.pid for job, (server, _address) in copies.items()}}
        cpu_before = {job: process_cpu_seconds(pid) for job, pid in pids.items()}
        while time.time() < end:
            if daemon.poll() is not None:
                raise RuntimeError(f"the daemon exited with {daemon.returncode}:\n{tail(log_path)}")
            loads.append(read_loadavg()[0])
            time.sleep(min(LOAD_SAMPLE_SECONDS, max(0.0, end - time.time())))
        # Each exporter's own CPU over the window, whatever its threads did (ms per second).
        cpu = {job: round((process_cpu_seconds(pid) - cpu_before[job]) / (time.time() - start) * 1000, 2)
               for job, pid in pids.items()}
        time.sleep(1.5)  # the last scrape of the window is stored
        jobs = {job: summarize(raw_samples(url, "scrape_duration_seconds", job, start, end),
                               raw_samples(url, "up", job, start, end)) for job in jobs_scraped}
        for job in jobs_scraped:
            jobs[job]["cpu_ms_per_second"] = cpu[job]
            # scrape_duration_seconds includes Prometheus parsing and storing every sample (its
            # scrape loop reports the duration after the append): the count is part of the figure.
            jobs[job]["samples_scraped"] = int(max(raw_samples(url, "scrape_samples_scraped", job, start, end),
                                                   default=0))
        version = subprocess.run([shutil.which(NODE_EXPORTER), "--version"], capture_output=True, text=True,
                                 timeout=10)
        jobs["node_exporter"]["version"] = ((version.stdout or version.stderr).splitlines() or ["?"])[0]
    return {
        "load": load, "hogs": hogs if load == "busy" else 0, "minutes": minutes, "warmup_seconds": WARMUP_SECONDS,
        "scrape_interval": SCRAPE_INTERVAL, "gpus": gpus, "watched_processes": processes,
        "loadavg_1m": {"min": min(loads), "mean": round(sum(loads) / len(loads), 2), "max": max(loads)},
        "loadavg_at_end": read_loadavg(),
        "jobs": jobs,
    }


def verdict(result: dict) -> dict:
    """The issue's targets: busy, hybridmon's p99 <= node_exporter's p99; quiet, < its p50."""
    ours, theirs = result["jobs"]["hybridmon"], result["jobs"]["node_exporter"]
    if not ours["scrapes"] or not theirs["scrapes"]:
        return {"target": "no scrapes to compare", "met": False}
    if result["load"] == "busy":
        return {"target": "hybridmon p99 <= node_exporter p99", "ratio": round(ours["p99_ms"] / theirs["p99_ms"], 2),
                "met": ours["p99_ms"] <= theirs["p99_ms"]}
    return {"target": "hybridmon p99 < node_exporter p50", "ratio": round(ours["p99_ms"] / theirs["p50_ms"], 2),
            "met": ours["p99_ms"] < theirs["p50_ms"]}


def print_table(result: dict) -> None:
    load = result["loadavg_1m"]
    print(f"\nscrape_duration_seconds from Prometheus, every {result['scrape_interval']}, {result['minutes']:g} min, "
          f"load {result['load']} ({result['hogs']} hogs); 1-min load average {load['min']}-{load['max']} "
          f"(mean {load['mean']}) on {result['machine']['cpus']} CPUs")
    print(f"{'job':<22}{'scrapes':>8}{'failed':>8}{'p50 ms':>9}{'p90 ms':>9}{'p99 ms':>9}{'max ms':>9}{'samples':>9}{'CPU ms/s':>10}")
    for job, row in result["jobs"].items():
        figures = "".join(f"{row.get(key, float('nan')):>9.2f}" for key in ("p50_ms", "p90_ms", "p99_ms", "max_ms"))
        print(f"{job:<22}{row['scrapes']:>8}{row['failed']:>8}{figures}{row['samples_scraped']:>9}{row['cpu_ms_per_second']:>10.2f}")
    target = result["verdict"]
    print(f"target: {target['target']}: {'met' if target['met'] else 'NOT met'} (ratio {target.get('ratio')})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=3.0, help="measured minutes after the warm-up (default 3)")
    parser.add_argument("--load", choices=("busy", "quiet"), default="busy",
                        help="busy: one busy-loop process per CPU beside the exporters (default); quiet: none")
    parser.add_argument("--hogs", type=int, default=os.cpu_count() or 2,
                        help="busy-loop processes with --load busy (default: one per CPU)")
    parser.add_argument("--gpus", type=int, default=8, help="GPUs of the fake host (default 8)")
    parser.add_argument("--processes", type=int, default=16, help="real watched processes (default 16)")
    parser.add_argument("--frozen-copy", action="store_true",
                        help="also scrape a frozen copy of hybridmon's body: Prometheus's own share (module doc)")
    parser.add_argument("--json-out", metavar="FILE", help="also write the figures as JSON here")
    args = parser.parse_args()
    if args.minutes <= 0 or args.hogs < 0:
        parser.error("--minutes must be positive and --hogs not negative")
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))
    # The run's own bound: nothing it starts outlives it, whatever hangs.
    signal.signal(signal.SIGALRM, lambda _signum, _frame: sys.exit("time limit reached: stopped everything"))
    signal.alarm(int(args.minutes * 60 + WARMUP_SECONDS + TIME_LIMIT_SLACK_SECONDS))
    print(f"Prometheus scraping hybridmon ({args.gpus} GPUs, {args.processes} processes) and node_exporter every "
          f"{SCRAPE_INTERVAL}, load {args.load}: {WARMUP_SECONDS} s warm-up, then {args.minutes:g} min", flush=True)
    with tempfile.TemporaryDirectory(prefix="hybridmon-scrape-load-") as tmp:
        result = measure(args.minutes, args.load, args.hogs, args.gpus, args.processes, Path(tmp), args.frozen_copy)
    signal.alarm(0)
    result["machine"] = machine()
    result["verdict"] = verdict(result)
    print_table(result)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
