"""The daemon's cost of record: `hybridmon run`, every thread, its own CPU and RSS, on both driver paths.

The figure is the daemon process's own CPU (utime + stime of all its threads, /proc/<pid>/stat)
over `--minutes` measured after a `--warmup-seconds` warm-up, as a percentage of one core:
`cpu_percent_of_core` in the JSON. `--pcie-path` sets the fake NVML's driver:
- counters: every GPU answers NVML_FI_DEV_PCIE_COUNT_RX/TX_BYTES (R555 and later): no sampler
  threads, one non-blocking call per GPU a tick;
- samplers: a driver without them (the layout's 550.54.15): one PCIe sampler thread per GPU,
  each sample two nvmlDeviceGetPcieThroughput calls that the fake makes block 20 ms in
  time.sleep, which releases the GIL and burns no CPU, as the real ctypes call does for the
  window nvml.h documents ("querying a byte counter over a 20ms interval").
`--history-minutes` (default 120) fills the daemon's history before its threads start, through
its own collectors, History and detectors at back-dated times (benchmarks/daemon_with_history.py
says how and why that stands for 2 h of running); 0 starts it empty, as a fresh daemon.
`--nvml stub` runs the daemon on the real binding (nvidia-ml-py) over the stub libnvidia-ml of
tests/support/stub_nvml, same host, its throughput call blocking 20 ms in nanosleep: the figure
without the fake's own Python per call, on either path (its byte counters advance at the
layout's rates: pcie_counters_advance).
`--quick` is a smoke run: 1 minute after a 15 s warm-up, 10 minutes of history.

It grew from issue 17's long run (RSS and CPU every minute, scraped as Prometheus would):

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

    .venv/bin/python benchmarks/daemon_long_run.py --minutes 10 --pcie-path samplers --json-out samplers.json
    .venv/bin/python benchmarks/daemon_long_run.py --minutes 10 --pcie-path counters --json-out counters.json

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

from benchmarks.agent_bench import (MIB, _die_with_parent, machine,  # noqa: E402
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


PCIE_PATHS = ("counters", "samplers")
WITH_HISTORY = [sys.executable, str(REPO / "benchmarks/daemon_with_history.py")]


def set_pcie_path(layout_path: Path, pcie_path: str) -> None:
    """The fake NVML's driver: byte counters on every GPU (R555+), or none (its 550.54.15, so one
    sampler thread per GPU); either way the throughput call blocks 20 ms (scaled_host)."""
    layout = json.loads(layout_path.read_text())
    for gpu in layout["gpus"]:
        gpu["pcie_byte_counters"] = pcie_path == "counters"
    layout_path.write_text(json.dumps(layout, indent=2))


NVML_LIBRARIES = ("fake", "stub")


def stub_nvml_environment(fake_layout_path: Path, workdir: Path) -> dict[str, str]:
    """The daemon on the REAL binding (nvidia-ml-py, the newest tested) over the stub
    libnvidia-ml (tests/support/stub_nvml), describing the same host as the fake's layout, its
    throughput call blocking 20 ms in nanosleep (as the fake's in time.sleep). The fake's Python
    per call is then gone: what is left is the binding's and the daemon's own (docs/nvml-cost.md)."""
    from tests.support.stub_nvml import build

    stub_layout = workdir / "stub-nvml.layout"
    build.write_layout(stub_layout, build.layout_from_fake(json.loads(fake_layout_path.read_text())))
    return {"LD_LIBRARY_PATH": str(build.build_stub("current")),
            "HYBRIDMON_STUB_NVML_LAYOUT": str(stub_layout),
            "HYBRIDMON_GPU__NVML_MODULE": "pynvml",
            "PYTHONPATH": os.pathsep.join([str(build.pynvml_dir(build.NEWEST_NVIDIA_ML_PY)), str(REPO)])}


@contextlib.contextmanager
def daemon_on_scaled_host(workdir: Path, gpus: int, processes: int, pcie_path: str = "samplers",
                          history_minutes: float = 0.0, nvml: str = "fake"):
    """`hybridmon run` on the scaled host with `processes` real watched children and the fake vLLM
    server, on a free loopback port, its fake NVML on `pcie_path` and its history filled with
    `history_minutes` first (benchmarks/daemon_with_history.py), on the fake NVML or (`nvml`
    "stub") the real binding over the stub library; yields (daemon, its /metrics URL,
    its log path) once /metrics serves the whole host. Everything is stopped on exit
    (benchmarks/scrape_under_load.py runs it too)."""
    import httpx
    from tests.support.fake_inference_server import FakeInferenceServer

    host = build_sized_host(workdir, gpus, processes)
    set_pcie_path(Path(host.layout), pcie_path)
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
            if nvml == "stub":
                env.pop("HYBRIDMON_FAKE_NVML_LAYOUT")
                env.update(stub_nvml_environment(Path(host.layout), workdir))
            port = free_port()
            url = f"http://127.0.0.1:{port}/metrics"
            log_path = workdir / "hybridmon.log"
            host.pids = tuple(real_pids)
            # agent_bench.DAEMON_COMMAND's `hybridmon run`, through the wrapper that fills the history first
            command = WITH_HISTORY + ["--history-seconds", str(history_minutes * 60), "run"]
            with managed_process(command + ["--listen", f"127.0.0.1:{port}"], log_path, env) as daemon:
                with httpx.Client(timeout=10.0) as client:
                    # Filling 2 h of history takes minutes on two busy cores before /metrics answers.
                    wait_for_metrics(client, url, exposition_needles(host), daemon, 60.0 + 6 * history_minutes,
                                     log_path)
                yield daemon, url, log_path
    finally:
        for child in children:
            stop_process(child)


def long_run(minutes: float, gpus: int, processes: int, scrape_seconds: float, workdir: Path,
             pcie_path: str = "samplers", warmup_seconds: float = 0.0, history_minutes: float = 0.0,
             nvml: str = "fake") -> dict:
    import httpx

    waiting_since = time.monotonic()  # the host's setup (a second or two) and the history's filling
    with daemon_on_scaled_host(workdir, gpus, processes, pcie_path, history_minutes, nvml) as (daemon, url, log_path), \
            httpx.Client(timeout=10.0, headers={"Accept-Encoding": "gzip"}) as client:
        filling_seconds = time.monotonic() - waiting_since
        warm_up(client, url, daemon, warmup_seconds, scrape_seconds, log_path)
        return sample_minutes(client, url, daemon, minutes, scrape_seconds, log_path) | {
            "gpus": gpus, "watched_processes": processes, "scrape_seconds": scrape_seconds,
            "pcie_path": pcie_path, "nvml": nvml, "warmup_seconds": warmup_seconds,
            "history_minutes_filled": history_minutes,
            "seconds_to_first_metrics_with_filling": round(filling_seconds, 1),
            "pcie_sampler_threads": sum(1 for name in thread_names(daemon.pid) if name.startswith("pcie-"))}


def warm_up(client, url: str, daemon: subprocess.Popen, seconds: float, scrape_seconds: float,
            log_path: Path) -> None:
    """The first `seconds` after /metrics answers, scraped as the run is, not measured: the first
    ticks start the sampler threads, read first windows and warm the caches."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if daemon.poll() is not None:
            raise RuntimeError(f"the daemon exited with {daemon.returncode} during the warm-up; see {log_path}")
        if client.get(url).status_code != 200:
            raise RuntimeError(f"{url} failed during the warm-up")
        time.sleep(max(0.0, min(scrape_seconds, end - time.monotonic())))


def thread_names(pid: int) -> list[str]:
    names = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm", encoding="utf-8", errors="replace") as handle:
                names.append(handle.read().strip())
        except OSError:
            continue
    return names


def thread_group(name: str) -> str:
    """A thread's kernel name with its trailing index dropped: "pcie-gpu3" is "pcie-gpu"."""
    return name.rstrip("0123456789").rstrip("_-") or name


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
        group = thread_group(name)
        groups[group] = groups.get(group, 0.0) + seconds
    return groups


def wakeups_by_thread_group(pid: int) -> dict[str, int]:
    """Voluntary context switches (a thread blocking: a wait, a sleep, a lock) of the process's
    threads, grouped as cpu_by_thread_group groups them: each is a wake-up later."""
    groups: dict[str, int] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm", encoding="utf-8", errors="replace") as handle:
                name = handle.read().strip()
            with open(f"/proc/{pid}/task/{tid}/status", encoding="utf-8") as handle:
                switches = next(int(line.split()[1]) for line in handle
                                if line.startswith("voluntary_ctxt_switches:"))
        except (OSError, StopIteration):
            continue
        group = thread_group(name)
        groups[group] = groups.get(group, 0) + switches
    return groups


def sample_minutes(client, url: str, daemon: subprocess.Popen, minutes: float, scrape_seconds: float,
                   log_path: Path) -> dict:
    started = time.monotonic()
    cpu_start = process_cpu_seconds(daemon.pid)
    groups_start = cpu_by_thread_group(daemon.pid)
    wakeups_start = wakeups_by_thread_group(daemon.pid)
    load_start = os.getloadavg()
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
                         "cpu_ms_per_second": round(cpu / max(now - started, 1e-9) * 1000, 2),
                         "load_average_1m": os.getloadavg()[0]})
            print(f"  {rows[-1]['minute']:5.1f} min  RSS {rows[-1]['rss_mb']:6.1f} MB  "
                  f"CPU {rows[-1]['cpu_ms_per_second']:6.2f} ms/s (since the warm-up)  "
                  f"load {rows[-1]['load_average_1m']:.2f}", flush=True)
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
    cpu_seconds = process_cpu_seconds(daemon.pid) - cpu_start
    rss_end = rss_bytes(daemon.pid)
    groups_end = cpu_by_thread_group(daemon.pid)
    wakeups_end = wakeups_by_thread_group(daemon.pid)
    by_group = {group: round((seconds - groups_start.get(group, 0.0)) / elapsed * 1000, 2)
                for group, seconds in sorted(groups_end.items(), key=lambda item: -item[1])}
    return {
        # The figure of record: the daemon's own utime + stime over the measured time, % of a core
        "cpu_percent_of_core": round(cpu_seconds / elapsed * 100, 3),
        "measured_seconds": round(elapsed, 1),
        "rss_bytes": rss_end,
        "load_average": {"at_start": list(load_start), "at_end": list(os.getloadavg())},
        # CPU ms per second of each group of threads over the run (threads that ended are missing)
        "cpu_ms_per_second_by_thread_group": by_group,
        # voluntary context switches a second of each group over the run: its wake-ups
        "wakeups_per_second_by_thread_group": {
            group: round((count - wakeups_start.get(group, 0)) / elapsed, 1)
            for group, count in sorted(wakeups_end.items(), key=lambda item: -item[1])},
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


def parse_arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, help="minutes measured after the warm-up (default 10)")
    parser.add_argument("--gpus", type=int, default=8, help="GPUs of the scaled host (default 8)")
    parser.add_argument("--processes", type=int, default=16, help="real watched processes (default 16)")
    parser.add_argument("--pcie-path", choices=PCIE_PATHS, default="samplers",
                        help="the fake driver: PCIe byte counters, or samplers (no counters; default)")
    parser.add_argument("--nvml", choices=NVML_LIBRARIES, default="fake",
                        help="the fake NVML (default), or the real nvidia-ml-py over the stub "
                             "libnvidia-ml (tests/support/stub_nvml), on either path")
    parser.add_argument("--warmup-seconds", type=float, help="not measured, after /metrics answers (default 60)")
    parser.add_argument("--history-minutes", type=float,
                        help="history filled before the daemon's threads start (default 120; 0: none)")
    parser.add_argument("--scrape-seconds", type=float, default=15.0,
                        help="seconds between scrapes of /metrics (default 15, Prometheus's)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 1 minute after a 15 s warm-up, 10 minutes of history")
    parser.add_argument("--json-out", metavar="FILE", help="also write the figures as JSON here")
    args = parser.parse_args(argv)
    # --quick sets the defaults only: a flag given beside it wins
    quick = {"minutes": 1.0, "warmup_seconds": 15.0, "history_minutes": 10.0}
    full = {"minutes": 10.0, "warmup_seconds": 60.0, "history_minutes": 120.0}
    for name, value in (quick if args.quick else full).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def print_table(result: dict) -> None:
    print(f"\n{'pcie path':<12s}{'GPUs':>5s}{'procs':>6s}{'history':>9s}{'warm-up':>9s}{'measured':>10s}"
          f"{'CPU % core':>11s}{'RSS MB':>8s}{'load 1m':>14s}")
    load = result["load_average"]
    print(f"{result['pcie_path']:<12s}{result['gpus']:5d}{result['watched_processes']:6d}"
          f"{result['history_minutes_filled']:7g} m{result['warmup_seconds']:7g} s"
          f"{result['measured_seconds'] / 60:8.1f} m{result['cpu_percent_of_core']:11.2f}"
          f"{result['rss_bytes'] / MIB:8.1f}{load['at_start'][0]:7.2f}-{load['at_end'][0]:.2f}")
    print(f"  {result['scrapes']} scrapes (median {result['scrape_ms_median']} ms), {result['daemon_threads']} "
          f"threads ({result['pcie_sampler_threads']} PCIe samplers)")
    print("  CPU ms/s by thread group: " + ", ".join(f"{group} {ms}" for group, ms
                                                   in result["cpu_ms_per_second_by_thread_group"].items()))
    print("  wake-ups a second by thread group: " + ", ".join(
        f"{group} {count}" for group, count in result["wakeups_per_second_by_thread_group"].items()))


def main(argv: list[str] | None = None) -> int:
    args = parse_arguments(argv)
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))
    print(f"the daemon ({args.pcie_path} path, {args.nvml} NVML) for {args.minutes:g} min after a {args.warmup_seconds:g} s "
          f"warm-up, {args.history_minutes:g} min of history filled: {args.gpus} GPUs ({args.nvml} NVML), "
          f"{args.processes} real watched processes, a scrape every {args.scrape_seconds:g} s", flush=True)
    with tempfile.TemporaryDirectory(prefix="hybridmon-long-run-") as tmp:
        result = long_run(args.minutes, args.gpus, args.processes, args.scrape_seconds, Path(tmp),
                          args.pcie_path, args.warmup_seconds, args.history_minutes, args.nvml)
    result["command"] = " ".join([Path(sys.executable).name, *sys.argv]) if argv is None else " ".join(argv)
    result["machine"] = machine()
    print_table(result)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
