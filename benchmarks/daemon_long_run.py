"""The real daemon over a long run: RSS and CPU every minute, scraped as Prometheus would.

agent_bench.py's memory part drives the sampler in one thread of one process; the daemon runs its
collectors in threads, and glibc gives threads malloc arenas of their own, which that simulation
never exercises (issue 17: a real daemon reached 110 MB after 45 minutes with default arenas, 87 MB
with MALLOC_ARENA_MAX=1). So this runs `hybridmon run` itself, as the systemd unit does but without
the unit's MALLOC_ARENA_MAX (the daemon caps its arenas on its own: agent/allocator.py), on:

- the scaled host's sysfs (benchmarks/agent_bench_curve.py: `--gpus` NVIDIA functions) and its
  fake NVML layout, with each GPU's two processes renamed to real pids;
- the real /proc, with `--processes` real watched processes: children of this script that each
  hold a listening TCP socket on 127.0.0.1 (so inference discovery maps sockets to pids through
  the real /proc/<pid>/fd and the real net/tcp, as beside a real server) and otherwise sleep;
- a fake vLLM /metrics on loopback, the configured inference endpoint, scraped every 5 s.

At the end it also gives the CPU of each group of the daemon's threads (PCIe samplers, collectors,
the sampling loop, the HTTP server's main thread), by the names the daemon gives them in the kernel.

A client scrapes /metrics every `--scrape-seconds` (15 s, Prometheus's default interval) with
`Accept-Encoding: gzip`, as Prometheus does. Every minute the script records the daemon's RSS and
its CPU time; at the end it prints the table and, with --json-out, writes every figure.

    .venv/bin/python benchmarks/daemon_long_run.py --minutes 45 --processes 64 --json-out run.json

Everything it starts (the daemon, the watched children, the fake server) is stopped on success,
failure, Ctrl-C and SIGTERM; the children also get SIGTERM if this script is killed.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.agent_bench import (DAEMON_COMMAND, MIB, _die_with_parent, cpu_model,  # noqa: E402
                                    free_port, managed_process, process_cpu_seconds, rss_bytes,
                                    stop_process, wait_for_metrics)
from benchmarks.agent_bench_curve import build_sized_host  # noqa: E402
from tests.support.scaled_host import exposition_needles  # noqa: E402

# A watched process: holds a listening socket (so discovery has something to map) and sleeps.
# /usr/bin/python3 rather than this venv's `python`, so its comm reads python3 as the fake NVML's.
WATCHED_CHILD = ("import socket, time\n"
                 "listener = socket.socket()\n"
                 "listener.bind(('127.0.0.1', 0))\n"
                 "listener.listen()\n"
                 "time.sleep(1e6)\n")
CHILD_PYTHON = "/usr/bin/python3"


def start_watched(count: int) -> list[subprocess.Popen]:
    children = []
    for _ in range(count):
        children.append(subprocess.Popen([CHILD_PYTHON, "-c", WATCHED_CHILD], stdin=subprocess.DEVNULL,
                                         preexec_fn=_die_with_parent))
    return children


def layout_with_real_pids(layout_path: Path, synthetic_pids: tuple[int, ...], real_pids: list[int]) -> None:
    """Renames the fake NVML's per-GPU processes from the synthetic host's pids to the real ones."""
    rename = dict(zip(synthetic_pids, real_pids))
    layout = json.loads(layout_path.read_text())
    for gpu in layout["gpus"]:
        for process in gpu["processes"]:
            process["pid"] = rename.get(process["pid"], process["pid"])
    layout_path.write_text(json.dumps(layout, indent=2))


@contextlib.contextmanager
def daemon_on_scaled_host(workdir: Path, gpus: int, processes: int):
    """`hybridmon run` on the scaled host with `processes` real watched children and the fake vLLM
    server, on a free loopback port; yields (daemon, its /metrics URL, its log path) once /metrics
    serves the whole host. Everything is stopped on exit (benchmarks/scrape_under_load.py runs it
    too)."""
    import httpx
    from tests.support.fake_inference_server import FakeInferenceServer

    host = build_sized_host(workdir, gpus, processes)
    fixtures = REPO / "tests/fixtures/inference"
    server = FakeInferenceServer({"/metrics": [(fixtures / "vllm-v1-names.1.prom").read_text()]})
    children = start_watched(processes)
    try:
        with server:
            real_pids = [child.pid for child in children]
            layout_with_real_pids(Path(host.layout), host.pids, real_pids)
            env = {k: v for k, v in os.environ.items() if not k.startswith(("HYBRIDMON_", "MALLOC_"))}
            env.update(host.environment())
            env.update({
                "HYBRIDMON_PATHS__PROCFS": "/proc",
                "HYBRIDMON_PROCESS__PIDS": json.dumps(real_pids),
                "HYBRIDMON_INFERENCE__ENDPOINTS": json.dumps([server.url()]),
                "HYBRIDMON_FAKE_NVML_LAYOUT": host.layout,
                "PYTHONPATH": str(REPO),
            })
            port = free_port()
            url = f"http://127.0.0.1:{port}/metrics"
            log_path = workdir / "hybridmon.log"
            host.pids = tuple(real_pids)
            with managed_process(DAEMON_COMMAND + ["--listen", f"127.0.0.1:{port}"], log_path, env) as daemon:
                with httpx.Client(timeout=10.0) as client:
                    wait_for_metrics(client, url, exposition_needles(host), daemon, 60.0, log_path)
                yield daemon, url, log_path
    finally:
        for child in children:
            stop_process(child)


def long_run(minutes: float, gpus: int, processes: int, scrape_seconds: float, workdir: Path) -> dict:
    import httpx

    with daemon_on_scaled_host(workdir, gpus, processes) as (daemon, url, log_path), \
            httpx.Client(timeout=10.0, headers={"Accept-Encoding": "gzip"}) as client:
        return sample_minutes(client, url, daemon, minutes, scrape_seconds, log_path) | {
            "gpus": gpus, "watched_processes": processes, "scrape_seconds": scrape_seconds}


def cpu_by_thread_group(pid: int) -> dict[str, float]:
    """CPU seconds (utime + stime) of the process's threads, grouped by their kernel name with the
    trailing index dropped ("pcie-gpu3" and "pcie-gpu5" are "pcie-gpu"): the daemon names its
    threads in the kernel (agent/thread_names.py). A thread that ends between the listing and the
    read is left out."""
    groups: dict[str, float] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm", encoding="utf-8", errors="replace") as handle:
                name = handle.read().strip()
            seconds = process_cpu_seconds(pid, tid)
        except OSError:
            continue
        group = name.rstrip("0123456789").rstrip("_-") or name
        groups[group] = groups.get(group, 0.0) + seconds
    return groups


def sample_minutes(client, url: str, daemon: subprocess.Popen, minutes: float, scrape_seconds: float,
                   log_path: Path) -> dict:
    started = time.monotonic()
    cpu_start = process_cpu_seconds(daemon.pid)
    groups_start = cpu_by_thread_group(daemon.pid)
    rows, latencies = [], []
    next_minute, next_scrape = started, started
    end = started + minutes * 60
    while True:
        now = time.monotonic()
        if daemon.poll() is not None:
            raise RuntimeError(f"the daemon exited with {daemon.returncode} after {now - started:.0f} s; "
                               f"see {log_path}")
        if now >= next_minute or now >= end:  # every minute, and once at the end
            cpu = process_cpu_seconds(daemon.pid) - cpu_start
            rows.append({"minute": round((now - started) / 60, 1), "rss_mb": round(rss_bytes(daemon.pid) / MIB, 1),
                         "cpu_ms_per_second": round(cpu / max(now - started, 1e-9) * 1000, 2)})
            print(f"  {rows[-1]['minute']:5.1f} min  RSS {rows[-1]['rss_mb']:6.1f} MB  "
                  f"CPU {rows[-1]['cpu_ms_per_second']:6.2f} ms/s", flush=True)
            next_minute += 60
        if now >= end:
            break
        if now >= next_scrape:
            at = time.perf_counter()
            response = client.get(url)
            latencies.append((time.perf_counter() - at) * 1000)
            if response.status_code != 200:
                raise RuntimeError(f"{url} answered HTTP {response.status_code}")
            next_scrape += scrape_seconds
        time.sleep(max(0.05, min(next_minute, next_scrape, end) - time.monotonic()))
    threads = len(os.listdir(f"/proc/{daemon.pid}/task"))
    elapsed = time.monotonic() - started
    groups_end = cpu_by_thread_group(daemon.pid)
    by_group = {group: round((seconds - groups_start.get(group, 0.0)) / elapsed * 1000, 2)
                for group, seconds in sorted(groups_end.items(), key=lambda item: -item[1])}
    return {
        # CPU ms per second of each group of threads over the run (threads that ended are missing)
        "cpu_ms_per_second_by_thread_group": by_group,
        "minutes": minutes,
        "rss_mb_by_minute": rows,
        "rss_mb_end": rows[-1]["rss_mb"],
        "rss_mb_max": max(row["rss_mb"] for row in rows),
        "cpu_ms_per_second_overall": rows[-1]["cpu_ms_per_second"],
        "scrapes": len(latencies),
        "scrape_ms_median": round(statistics.median(latencies), 2) if latencies else None,
        "scrape_ms_max": round(max(latencies), 2) if latencies else None,
        "daemon_threads": threads,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=45.0, help="how long to run (default 45)")
    parser.add_argument("--gpus", type=int, default=8, help="GPUs of the scaled host (default 8)")
    parser.add_argument("--processes", type=int, default=64, help="real watched processes (default 64)")
    parser.add_argument("--scrape-seconds", type=float, default=15.0,
                        help="seconds between scrapes of /metrics (default 15, Prometheus's)")
    parser.add_argument("--json-out", metavar="FILE", help="also write the figures as JSON here")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))
    print(f"the daemon for {args.minutes:g} min: {args.gpus} GPUs (fake NVML), {args.processes} real "
          f"watched processes, a scrape every {args.scrape_seconds:g} s", flush=True)
    with tempfile.TemporaryDirectory(prefix="hybridmon-long-run-") as tmp:
        result = long_run(args.minutes, args.gpus, args.processes, args.scrape_seconds, Path(tmp))
    result["machine"] = {"cpus": os.cpu_count(), "cpu_model": cpu_model(), "python": sys.version.split()[0]}
    print(f"RSS at the end {result['rss_mb_end']} MB (max {result['rss_mb_max']}), CPU "
          f"{result['cpu_ms_per_second_overall']} ms/s, {result['scrapes']} scrapes "
          f"(median {result['scrape_ms_median']} ms), {result['daemon_threads']} threads")
    print("CPU ms/s by thread: " + ", ".join(f"{group} {ms}" for group, ms
                                            in result["cpu_ms_per_second_by_thread_group"].items()))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
