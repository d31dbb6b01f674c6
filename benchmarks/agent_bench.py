"""What the agent costs on a scaled host: tick CPU, scrape latency, history memory, series counts.

Builds, in a temporary directory, the fixture host scaled to 8 NVIDIA GPUs and 16 watched vLLM
processes, with a fake NVML layout of the same 8 GPUs that waits 20 ms per PCIe throughput
direction as real NVML does (tests/support/scaled_host.py), and serves a fake vLLM /metrics on
loopback. Then:

1. tick:    an in-process Agent; every 1 s collector run once per tick in the agent's order,
            process CPU time (all threads) and wall time per tick; process_numa (30 s) apart;
            the cost of rendering the samples exposition after a tick.
2. series:  the series of the samples exposition per GPU, per watched process and host-level.
3. scrape:  the daemon (`python -m hybridmon.agent.cli run`) and node_exporter as subprocesses on
            127.0.0.1, sequential GETs of /metrics over one keep-alive connection each, back to
            back (mostly served from the render cache) and paced 1.37 s apart (every scrape
            renders after a commit, as with Prometheus); node_exporter also with gzip.
4. memory:  a fresh subprocess drives 7,200 ticks (2 h at 1 s) of fake wall time through the
            sampler, NVML values changing every tick, and reports its RSS.

--gpus and --processes size the host (benchmarks/agent_bench_curve.py builds it); --curve instead
runs part 4 alone at 1, 16, 64, 256 processes (8 GPUs) and 1, 8, 32 GPUs (16 processes) and prints
CPU per tick, detector evaluation time and RSS at each.

Everything it starts is stopped and its temporary directory removed, on success, error, Ctrl-C,
SIGTERM, or when --time-limit runs out.

    .venv/bin/python benchmarks/agent_bench.py [--quick] [--gpus N] [--processes N] [--json-out FILE]
    .venv/bin/python benchmarks/agent_bench.py --curve [--history-ticks N] [--json-out FILE]
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import math
import os
import platform
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # `tests` (the fake NVML, the fixture host) is not installed

from hybridmon.exporters.gpu import MEMORY_USED  # noqa: E402
from benchmarks.agent_bench_report import TARGETS, print_report  # noqa: E402
from benchmarks.evaluation_side_by_side import evaluation_side_by_side, keep_history  # noqa: E402
from benchmarks.agent_bench_curve import (DEFAULT_GPUS, DEFAULT_PROCESSES, build_sized_host,  # noqa: E402
                                          print_curve, run_curve)
from tests.support.scaled_host import (PROCESS_MEMORY_PATTERNS, THROUGHPUT_DELAY_SECONDS, ScaledHost,  # noqa: E402
                                       check_agent_sees_the_host, exposition_needles, load_fake_nvml,
                                       vary_fake_values)
from tests.support.scenarios.host import MIB  # noqa: E402

NODE_EXPORTER = "prometheus-node-exporter"
DAEMON_COMMAND = [sys.executable, "-m", "hybridmon.agent.cli", "run"]  # + --listen 127.0.0.1:PORT
# Paced scrapes are further apart than a tick, so each one renders anew after a commit, as a
# Prometheus scrape every 15 s does; 1.37 s, not 1 s, so that they fall at every phase of the tick.
PACE_SECONDS = 1.37

FULL = dict(ticks=300, numa_runs=30, scrapes=1000, gzip_scrapes=300, paced_scrapes=60,
            daemon_idle_seconds=20.0, history_ticks=7200, curve_ticks=600)
QUICK = dict(ticks=50, numa_runs=5, scrapes=100, gzip_scrapes=50, paced_scrapes=3,
             daemon_idle_seconds=3.0, history_ticks=600, curve_ticks=120)

EVALUATION_CHECKPOINTS = (600, 3600, 7200)  # 10 min, 1 h, 2 h of history at 1 s



class TimeLimit(Exception):
    pass


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------

def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty list."""
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


def summary_ms(seconds: list[float]) -> dict[str, float]:
    ms = [s * 1000 for s in seconds]
    return {
        "n": len(ms),
        "min_ms": round(min(ms), 3),
        "median_ms": round(statistics.median(ms), 3),
        "p50_ms": round(percentile(ms, 50), 3),
        "mean_ms": round(statistics.fmean(ms), 3),
        "p95_ms": round(percentile(ms, 95), 3),
        "p99_ms": round(percentile(ms, 99), 3),
        "max_ms": round(max(ms), 3),
    }


def rss_bytes(pid: int | str = "self") -> int:
    with open(f"/proc/{pid}/status", encoding="ascii") as handle:
        for line in handle:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS in /proc/{pid}/status")


def process_cpu_seconds(pid: int | str, thread: int | str | None = None) -> float:
    """utime + stime of a child process (all its threads), from /proc/<pid>/stat; of one of its
    threads with `thread`, from /proc/<pid>/task/<thread>/stat."""
    path = f"/proc/{pid}/stat" if thread is None else f"/proc/{pid}/task/{thread}/stat"
    with open(path, encoding="ascii") as handle:
        fields = handle.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _die_with_parent() -> None:
    """preexec_fn: the child gets SIGTERM if the benchmark dies without cleaning up (SIGKILL)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


@contextlib.contextmanager
def managed_process(command: list[str], log_path: Path, env: dict[str, str] | None = None):
    """A subprocess that is always stopped on exit: SIGTERM, then SIGKILL after 5 s."""
    log = open(log_path, "wb")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                               env=env, cwd=str(REPO), preexec_fn=_die_with_parent)
    try:
        yield process
    finally:
        stop_process(process)
        log.close()


def stop_process(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=5)


def tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine() -> dict:
    """The machine a benchmark ran on, as every benchmark's JSON records it."""
    return {"cpus": os.cpu_count(), "cpu_model": cpu_model(), "python": platform.python_version(),
            "kernel": f"{platform.system()} {platform.release()}"}


# --------------------------------------------------------------------------------------------
# 2. tick CPU time, render cost, process_numa; 5. series counts
# --------------------------------------------------------------------------------------------

def bench_ticks(host: ScaledHost, ticks: int, numa_runs: int) -> tuple[dict, dict]:
    from hybridmon.agent.daemon import Agent

    fake = load_fake_nvml(host, THROUGHPUT_DELAY_SECONDS)
    config = host.agent_config()
    agent = Agent(config)
    try:
        scheduled = agent.sampler.scheduled
        due = [item for item in scheduled if item.interval_seconds <= config.interval_seconds]
        slow = [item for item in scheduled if item.interval_seconds > config.interval_seconds]
        t0 = 1_800_000_000.0

        # First tick: every collector, NVML initialisation, first PCI discovery, process scan.
        cpu0, wall0 = time.process_time(), time.perf_counter()
        for item in scheduled:
            agent.sampler.run_collector(item, at=t0)
        first = {"cpu_ms": (time.process_time() - cpu0) * 1000,
                 "wall_ms": (time.perf_counter() - wall0) * 1000}
        check_agent_sees_the_host(agent, host)
        series = count_series(agent, host)

        cpu, wall, render_cpu, render_wall, render_bytes = [], [], [], [], 0
        per_collector_cpu = {item.collector.name: [] for item in due}
        per_collector_wall = {item.collector.name: [] for item in due}
        for tick in range(1, ticks + 1):
            vary_fake_values(fake, tick)
            at = t0 + tick
            tick_cpu, tick_wall = time.process_time(), time.perf_counter()
            for item in due:
                c, w = time.process_time(), time.perf_counter()
                agent.sampler.run_collector(item, at=at)
                per_collector_cpu[item.collector.name].append(time.process_time() - c)
                per_collector_wall[item.collector.name].append(time.perf_counter() - w)
            cpu.append(time.process_time() - tick_cpu)
            wall.append(time.perf_counter() - tick_wall)
            # The first render after the tick's commits (what a scrape after a tick pays).
            c, w = time.process_time(), time.perf_counter()
            text = agent.exposition.samples_text()
            render_cpu.append(time.process_time() - c)
            render_wall.append(time.perf_counter() - w)
            render_bytes = len(text)
        failed = {i.collector.name: i.state.last_error for i in due if not i.state.last_success}
        if failed:
            raise RuntimeError(f"collectors failed during the tick benchmark: {failed}")

        # A cached render (no commit since the last one) and the health part, for comparison.
        c = time.perf_counter()
        agent.exposition.samples_text()
        cached_ms = (time.perf_counter() - c) * 1000
        c = time.perf_counter()
        full = agent.exposition.render()
        full_render_ms = (time.perf_counter() - c) * 1000

        numa = {}
        for item in slow:
            runs_cpu, runs_wall = [], []
            for run in range(numa_runs):
                c, w = time.process_time(), time.perf_counter()
                agent.sampler.run_collector(item, at=t0 + ticks + 1 + run)
                runs_cpu.append(time.process_time() - c)
                runs_wall.append(time.perf_counter() - w)
            numa[item.collector.name] = {
                "interval_seconds": item.interval_seconds,
                "cpu": summary_ms(runs_cpu), "wall": summary_ms(runs_wall),
                "success": bool(item.state.last_success),
            }

        result = {
            "collectors_per_tick": [item.collector.name for item in due],
            "collectors_excluded": {item.collector.name: item.interval_seconds for item in slow},
            "first_tick_all_collectors": {k: round(v, 3) for k, v in first.items()},
            "cpu": summary_ms(cpu),
            "wall": summary_ms(wall),
            "per_collector_cpu_median_ms": {
                name: round(statistics.median(v) * 1000, 3) for name, v in per_collector_cpu.items()},
            "per_collector_wall_median_ms": {
                name: round(statistics.median(v) * 1000, 3) for name, v in per_collector_wall.items()},
            "render_after_commit_cpu": summary_ms(render_cpu),
            "render_after_commit_wall": summary_ms(render_wall),
            "render_cached_ms": round(cached_ms, 4),
            "render_full_incl_health_ms": round(full_render_ms, 3),
            "samples_exposition_bytes": render_bytes,
            "full_exposition_bytes": len(full),
            "slow_collectors": numa,
            "gc_enabled": gc.isenabled(),
        }
        return result, series
    finally:
        agent.stop()
        load_fake_nvml(host, 0.0)


def count_series(agent, host: ScaledHost) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    gpu0_bus = host.gpu_bus_ids[0]
    pid = str(host.pids[0])
    total, gpu0, pid0, host_level, per_gpu_total, per_pid_total = 0, 0, 0, 0, 0, 0
    gpu0_families, pid_families, host_families = {}, {}, {}
    for family in text_string_to_metric_families(agent.exposition.samples_text().decode()):
        for sample in family.samples:
            labels = sample.labels
            total += 1
            if labels.get("gpu") == "0" or labels.get("pci_bus_id") == gpu0_bus:
                gpu0 += 1
                gpu0_families[sample.name] = gpu0_families.get(sample.name, 0) + 1
            if labels.get("pid") == pid:
                pid0 += 1
                pid_families[sample.name] = pid_families.get(sample.name, 0) + 1
            if "gpu" in labels or "pci_bus_id" in labels:
                per_gpu_total += 1
            if "pid" in labels:
                per_pid_total += 1
            if not {"gpu", "pci_bus_id", "pid"} & labels.keys():
                host_level += 1
                host_families[sample.name] = host_families.get(sample.name, 0) + 1
    health = sum(len(f.samples) for f in text_string_to_metric_families(
        agent.exposition.render()[len(agent.exposition.samples_text()):].decode()))
    return {
        "gpus": len(host.gpu_bus_ids),
        "watched_processes": len(host.pids),
        "samples_exposition_series": total,
        "per_gpu_series (gpu=\"0\" or pci_bus_id of GPU0)": gpu0,
        "per_process_series (pid=\"%s\")" % pid: pid0,
        "host_level_series": host_level,
        "series_with_gpu_or_pci_bus_id_label": per_gpu_total,
        "series_with_pid_label": per_pid_total,
        "gpu_and_pid_label_overlap": per_gpu_total + per_pid_total + host_level - total,
        "health_series": health,
        "history_series": agent.history.series_count(),
        "gpu0_by_family": dict(sorted(gpu0_families.items())),
        "process_by_family": dict(sorted(pid_families.items())),
        "host_by_family": dict(sorted(host_families.items())),
    }


# --------------------------------------------------------------------------------------------
# 3. scrape latency: the daemon and node_exporter
# --------------------------------------------------------------------------------------------

def wait_for_metrics(client, url: str, needles: tuple[str, ...], process: subprocess.Popen,
                     timeout: float, log_path: Path) -> str:
    import httpx

    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{process.args[0]} exited with {process.returncode}:\n{tail(log_path)}")
        try:
            response = client.get(url)
            if response.status_code == 200 and all(n in response.text for n in needles):
                return response.text
            last = f"HTTP {response.status_code}"
        except httpx.HTTPError as error:
            last = error
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not serve {needles} within {timeout:.0f} s (last: {last!r}):\n"
                       f"{tail(log_path)}")


def scrape_series(client, url: str, count: int, pid: int, headers: dict[str, str],
                  pace_seconds: float = 0.0) -> dict:
    latencies, sizes, wire_sizes = [], [], []
    cpu_before, wall_before = process_cpu_seconds(pid), time.perf_counter()
    for _ in range(count):
        if pace_seconds:
            time.sleep(pace_seconds)
        started = time.perf_counter()
        response = client.get(url, headers=headers)
        body = response.content  # read (and decompressed) inside the measurement
        latencies.append(time.perf_counter() - started)
        if response.status_code != 200:
            raise RuntimeError(f"{url} answered HTTP {response.status_code}")
        sizes.append(len(body))
        wire_sizes.append(response.num_bytes_downloaded)
    elapsed = time.perf_counter() - wall_before
    server_cpu = process_cpu_seconds(pid) - cpu_before
    result = summary_ms(latencies)
    result.update({
        "over_10ms": sum(1 for latency in latencies if latency > 0.010),
        "body_bytes_median": int(statistics.median(sizes)),
        "wire_bytes_median": int(statistics.median(wire_sizes)),
        "content_encoding": response.headers.get("content-encoding", "identity"),
        "seconds": round(elapsed, 2),
        "server_cpu_seconds": round(server_cpu, 3),
        "server_cpu_ms_per_scrape_incl_background": round(server_cpu / count * 1000, 3),
    })
    return result


def bench_scrapes(host: ScaledHost, workdir: Path, options: dict) -> dict:
    import httpx

    identity = {"Accept-Encoding": "identity"}
    gzip_like_prometheus = {"Accept-Encoding": "gzip"}
    results: dict = {}

    # hybridmon
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("HYBRIDMON_")}
    env.update(host.environment())
    env["HYBRIDMON_FAKE_NVML_LAYOUT"] = host.layout
    env["PYTHONPATH"] = str(REPO)
    command = DAEMON_COMMAND + ["--listen", f"127.0.0.1:{port}"]
    log_path = workdir / "hybridmon.log"
    url = f"http://127.0.0.1:{port}/metrics"
    with managed_process(command, log_path, env) as daemon, \
            httpx.Client(timeout=10.0, headers=identity) as client:
        started = time.monotonic()
        wait_for_metrics(client, url, exposition_needles(host), daemon, 60.0, log_path)
        ready_seconds = time.monotonic() - started
        idle_rss = rss_bytes(daemon.pid)
        # The daemon on its own (1 s ticks, no scrapes): CPU per second of wall time.
        cpu_before = process_cpu_seconds(daemon.pid)
        time.sleep(options["daemon_idle_seconds"])
        idle_cpu = process_cpu_seconds(daemon.pid) - cpu_before
        hybridmon = scrape_series(client, url, options["scrapes"], daemon.pid, identity)
        paced = scrape_series(client, url, options["paced_scrapes"], daemon.pid, identity,
                              pace_seconds=PACE_SECONDS)
        health = client.get(f"http://127.0.0.1:{port}/healthz").json()
        rss_after = rss_bytes(daemon.pid)
        hybridmon.update({
            "ready_after_seconds": round(ready_seconds, 2),
            "rss_mb_idle_after_start": round(idle_rss / MIB, 1),
            "rss_mb_after_scrapes": round(rss_after / MIB, 1),
            "idle_cpu_ms_per_second": round(idle_cpu / options["daemon_idle_seconds"] * 1000, 2),
            "collectors_ok": all(c["success"] and not c["no_data"] for c in health["collectors"].values()),
        })
    if daemon.returncode not in (0, -signal.SIGTERM):
        print(f"  note: the daemon exited with {daemon.returncode}:\n{tail(log_path)}", file=sys.stderr)
    results["hybridmon"] = hybridmon
    results["hybridmon_paced"] = paced

    # node_exporter
    binary = shutil.which(NODE_EXPORTER)
    if binary is None:
        results["node_exporter"] = {"skipped": f"{NODE_EXPORTER} not installed (Debian package "
                                               "prometheus-node-exporter)"}
        return results
    port = free_port()
    log_path = workdir / "node_exporter.log"
    url = f"http://127.0.0.1:{port}/metrics"
    version = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10)
    with managed_process([binary, f"--web.listen-address=127.0.0.1:{port}"], log_path) as exporter, \
            httpx.Client(timeout=10.0, headers=identity) as client:
        wait_for_metrics(client, url, ("node_cpu_seconds_total",), exporter, 30.0, log_path)
        rss = rss_bytes(exporter.pid)
        node = scrape_series(client, url, options["scrapes"], exporter.pid, identity)
        node_gzip = scrape_series(client, url, options["gzip_scrapes"], exporter.pid, gzip_like_prometheus)
        node_paced = scrape_series(client, url, options["paced_scrapes"], exporter.pid, identity,
                                   pace_seconds=PACE_SECONDS)
        node["rss_mb_after_start"] = round(rss / MIB, 1)
        node["rss_mb_after_scrapes"] = round(rss_bytes(exporter.pid) / MIB, 1)
        node["version"] = ((version.stdout or version.stderr).splitlines() or ["?"])[0]
        node["series"] = sum(1 for line in client.get(url).text.splitlines()
                             if line and not line.startswith("#"))
    results["node_exporter"] = node
    results["node_exporter_gzip"] = node_gzip
    results["node_exporter_paced"] = node_paced
    return results


# --------------------------------------------------------------------------------------------
# 4. memory after 2 h of history (in a fresh subprocess)
# --------------------------------------------------------------------------------------------

def memory_child(host_json: str, ticks: int, process_memory: str = "leak") -> None:
    """Runs in the subprocess: prints one JSON line with the figures."""
    host = ScaledHost(**json.loads(host_json))
    rss_start = rss_bytes()
    from hybridmon.agent.daemon import Agent  # imports counted separately from the agent
    from hybridmon.agent.api.server import create_app  # the daemon's HTTP stack (FastAPI, uvicorn), as it runs

    fake = load_fake_nvml(host, 0.0)
    rss_imported = rss_bytes()
    config = host.agent_config()
    agent = Agent(config)
    app = create_app(agent)  # noqa: F841 (kept alive, as in the daemon)
    rss_built = rss_bytes()
    scheduled = agent.sampler.scheduled
    numa_every = {item.collector.name: max(1, round(item.interval_seconds / config.interval_seconds))
                  for item in scheduled}
    t0 = 1_800_000_000.0
    checkpoints = []
    evaluation_at_history: dict[int, float] = {}
    detectors_at_history: dict[int, dict[str, float]] = {}
    reference_at_history: dict[int, float] = {}
    rss_first_tick = None
    aside = 0.0  # CPU of the checkpoint evaluations, left out of the per-tick figure
    kept_history = Path(tempfile.mkdtemp(prefix="hybridmon-bench-history-")) / "history-at-10-min.pickle"
    cpu0, wall0 = time.process_time(), time.perf_counter()
    for tick in range(ticks):
        vary_fake_values(fake, tick, process_memory)
        for item in scheduled:
            if tick % numa_every[item.collector.name] == 0:
                agent.sampler.run_collector(item, at=t0 + tick)
        if tick == 0:
            rss_first_tick = rss_bytes()
        if (tick + 1) % max(1, ticks // 10) == 0:
            checkpoints.append([tick + 1, round(rss_bytes() / MIB, 1)])
        if tick + 1 in EVALUATION_CHECKPOINTS:
            cpu_before = time.process_time()
            if tick + 1 == EVALUATION_CHECKPOINTS[0] and ticks > tick + 1:
                keep_history(agent, kept_history)
            reference_at_history[tick + 1] = reference_ms(3)
            evaluation_at_history[tick + 1] = median_evaluation_ms(agent, t0 + tick, 3)
            detectors_at_history[tick + 1] = detector_ms(agent, t0 + tick, 3)
            aside += time.process_time() - cpu_before
    wall = time.perf_counter() - wall0
    cpu = time.process_time() - cpu0 - aside
    evaluation_ms = median_evaluation_ms(agent, t0 + ticks, 5)
    failed = {i.collector.name: i.state.last_error for i in scheduled if not i.state.last_success}
    rss_end = rss_bytes()
    exposition = agent.exposition.render()
    rss_rendered = rss_bytes()
    gc.collect()
    rss_gc = rss_bytes()
    evaluations_during_ticks = agent.engine.evaluations - 5 - 3 * len(evaluation_at_history)
    max_rss_mb = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    side_by_side = None
    if kept_history.exists():   # after every RSS figure: the kept history is loaded for this alone
        side_by_side = evaluation_side_by_side(agent, kept_history, t0 + EVALUATION_CHECKPOINTS[0] - 1,
                                               t0 + ticks - 1)
    shutil.rmtree(kept_history.parent, ignore_errors=True)
    points = agent.history.series(MEMORY_USED.name, gpu="0")
    values = points[0].values if points else []
    changed = sum(1 for a, b in zip(values, values[1:]) if a != b)
    capacities = dict(agent.history.capacities())
    print(json.dumps({
        "ticks": ticks,
        "process_memory": process_memory,
        "seconds": round(wall, 1),
        "cpu_seconds": round(cpu, 1),
        "cpu_ms_per_tick": round(cpu / ticks * 1000, 3),
        "rss_mb_interpreter": round(rss_start / MIB, 1),
        "rss_mb_after_imports": round(rss_imported / MIB, 1),
        "rss_mb_agent_built": round(rss_built / MIB, 1),
        "rss_mb_after_first_tick": round(rss_first_tick / MIB, 1),
        "rss_mb_end": round(rss_end / MIB, 1),
        "rss_mb_after_render": round(rss_rendered / MIB, 1),
        "rss_mb_after_gc": round(rss_gc / MIB, 1),
        "ru_maxrss_mb": max_rss_mb,   # before the side-by-side rounds load the kept history
        "rss_checkpoints_mb": checkpoints,
        "history_series": agent.history.series_count(),
        "history_capacity": capacities,
        "history_value_bytes": agent.history.value_bytes(),
        "gpu0_memory_points": len(points[0].times) if points else 0,
        "gpu0_memory_changes": changed,
        "exposition_bytes": len(exposition),
        "failed_collectors": failed,
        "detector_evaluations_during_ticks": evaluations_during_ticks,
        "detector_evaluation_ms_median": evaluation_ms,
        # ticks of history -> ms (median of 3): issue 17 wants 2 h within 1.5x of 10 min
        "detector_evaluation_ms_at_history": evaluation_at_history,
        # ticks of history -> ms of CPU of the fixed reference_ms() work just before: how fast the
        # VM ran the same Python at that moment
        "reference_ms_at_history": reference_at_history,
        # ticks of history -> detector -> ms (median of 3, each alone with its own reads)
        "detector_ms_at_history": detectors_at_history,
        "detector_findings_firing": len(agent.engine.firing()),
        # the history at 10 min (kept) and the full one evaluated in alternation at the end: both
        # figures from the same minutes of the machine (benchmarks/evaluation_side_by_side.py)
        "evaluation_side_by_side": side_by_side,
    }), flush=True)
    agent.stop()


def median_evaluation_ms(agent, now: float, times: int) -> float:
    """Median ms of CPU of `times` evaluations of every detector at `now`, as the sampler runs
    them every 10 s. CPU time of this thread, not wall time: an evaluation runs on the calling
    thread, and on a shared 2-vCPU VM wall times of ~30 ms moved 2x from run to run with what
    else ran (the fake GPUs' sampler threads count in process time, not here)."""
    durations = []
    for _ in range(times):
        started = time.thread_time()
        agent.engine.evaluate(now)
        durations.append((time.thread_time() - started) * 1000)
    return round(statistics.median(durations), 1)


def reference_ms(times: int) -> float:
    """Median ms of this thread's CPU of a fixed piece of Python (sorting, a dict and sums over
    40,000 floats: what an evaluation does, without the agent). On a shared 2-vCPU VM the same
    code runs up to 2x slower for minutes at a time (steal shows as slower CPU, not as waiting);
    this, timed next to each checkpoint's evaluations, tells such a phase from a cost that grew."""
    figures = [float((i * 7919) % 10007) for i in range(40_000)]
    durations = []
    for _ in range(times):
        started = time.thread_time()
        ordered = sorted(figures)
        by_rank = {rank: figure for rank, figure in enumerate(ordered)}
        sum(by_rank.values()) + sum(map(abs, figures))
        durations.append((time.thread_time() - started) * 1000)
    return round(statistics.median(durations), 2)


def detector_ms(agent, now: float, times: int) -> dict[str, float]:
    """Median ms of CPU (this thread's, as median_evaluation_ms) of each detector alone at `now`,
    its reads included (an evaluation shares reads between detectors, so these add up to a little
    more than one): which detectors an evaluation's cost at each length of history comes from."""
    engine = agent.engine
    found = {}
    for detector in engine.detectors:
        durations = []
        for _ in range(times):
            view = engine.view_at(now)
            view.reading_back(getattr(detector, "lookback_seconds", None))
            started = time.thread_time()
            detector.evaluate(view, now)
            durations.append((time.thread_time() - started) * 1000)
        found[detector.name] = round(statistics.median(durations), 2)
    return found


def bench_memory(host: ScaledHost, ticks: int, timeout: float, process_memory: str = "leak") -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HYBRIDMON_")}
    env["PYTHONPATH"] = str(REPO)
    command = [sys.executable, str(Path(__file__).resolve()), "--memory-child",
               json.dumps(asdict(host)), "--history-ticks", str(ticks), "--process-memory", process_memory]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env,
                               cwd=str(REPO), preexec_fn=_die_with_parent)
    if completed.returncode != 0:
        raise RuntimeError(f"memory subprocess failed ({completed.returncode}):\n{completed.stderr[-3000:]}")
    return json.loads(completed.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------------------------

def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small counts, for a smoke run")
    parser.add_argument("--json-out", metavar="FILE", help="also write the figures as JSON here")
    parser.add_argument("--time-limit", type=float, default=900.0, metavar="SECONDS",
                        help="stop everything and fail after this long (default 900)")
    parser.add_argument("--skip", action="append", default=[], choices=["scrape", "memory"],
                        help="leave out a part (repeatable)")
    parser.add_argument("--memory-child", metavar="HOST_JSON", help=argparse.SUPPRESS)
    parser.add_argument("--history-ticks", type=int,
                        help="ticks of history for the memory part, and for each point of --curve")
    parser.add_argument("--gpus", type=int, default=DEFAULT_GPUS, help="GPUs of the host (default 8)")
    parser.add_argument("--processes", type=int, default=DEFAULT_PROCESSES,
                        help="watched processes of the host (default 16)")
    parser.add_argument("--curve", action="store_true",
                        help="only the cost at 1/16/64/256 processes and 1/8/32 GPUs, each in a fresh "
                             "process over --history-ticks ticks (default 600; 120 with --quick)")
    parser.add_argument("--process-memory", choices=PROCESS_MEMORY_PATTERNS, default="leak",
                        help="each process's GPU memory in part 4: leak (default; every process judged "
                             "in full and firing from 30 minutes, memory_growth's worst case), flat "
                             "(the common case) or sawtooth (no growth over an hour; the earlier default)")
    args = parser.parse_args()
    options = dict(QUICK if args.quick else FULL)
    if args.history_ticks:
        options["history_ticks"] = options["curve_ticks"] = args.history_ticks

    if args.memory_child:
        memory_child(args.memory_child, options["history_ticks"], args.process_memory)
        return 0

    def on_alarm(_signum, _frame):
        raise TimeLimit(f"--time-limit of {args.time_limit:.0f} s reached")

    def on_term(signum, _frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGALRM, on_alarm)
    signal.signal(signal.SIGTERM, on_term)
    signal.setitimer(signal.ITIMER_REAL, args.time_limit)

    import logging
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    started = time.perf_counter()
    results: dict = {
        "quick": args.quick,
        "options": options,
        "machine": machine(),
        "targets": TARGETS,
    }
    from tests.support.fake_inference_server import FakeInferenceServer

    fixtures = REPO / "tests/fixtures/inference"
    server = FakeInferenceServer({"/metrics": [(fixtures / "vllm-v1-names.1.prom").read_text()]})
    try:
        with tempfile.TemporaryDirectory(prefix="hybridmon-bench-") as tmp, server:
            workdir = Path(tmp)
            if args.curve:
                results["curve"] = run_curve(
                    workdir, server.url(), options["curve_ticks"], bench_memory,
                    lambda: args.time_limit - (time.perf_counter() - started) - 10)
                return finish(results, args, started)
            host = build_sized_host(workdir, args.gpus, args.processes)
            host.inference_url = server.url()
            results["host"] = {"gpus": len(host.gpu_bus_ids), "gpu_bus_ids": list(host.gpu_bus_ids),
                               "watched_processes": len(host.pids), "pids": list(host.pids),
                               "throughput_delay_seconds": THROUGHPUT_DELAY_SECONDS}
            print(f"scaled host in {host.root}: {len(host.gpu_bus_ids)} GPUs, {len(host.pids)} processes",
                  flush=True)

            print(f"tick: {options['ticks']} ticks ...", flush=True)
            results["tick"], results["series"] = bench_ticks(host, options["ticks"], options["numa_runs"])

            if "scrape" not in args.skip:
                print(f"scrape: {options['scrapes']} scrapes of hybridmon and of node_exporter ...", flush=True)
                results["scrape"] = bench_scrapes(host, workdir, options)

            if "memory" not in args.skip:
                print(f"memory: {options['history_ticks']} ticks in a fresh process ...", flush=True)
                remaining = args.time_limit - (time.perf_counter() - started) - 10
                results["memory"] = bench_memory(host, options["history_ticks"], max(10.0, remaining),
                                                 args.process_memory)
    except TimeLimit as error:
        print(f"agent_bench: {error}; everything started was stopped", file=sys.stderr)
        return 1
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    return finish(results, args, started)


def finish(results: dict, args: argparse.Namespace, started: float) -> int:
    results["seconds"] = round(time.perf_counter() - started, 1)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=2) + "\n")
    if "curve" in results:
        m = results["machine"]
        print(f"\nmachine: {m['cpus']} CPUs, {m['cpu_model']}, Python {m['python']}, {m['kernel']}")
        print_curve(results["curve"])
        print(f"\ntotal {results['seconds']:.0f} s")
    else:
        print_report(results)
    if args.json_out:
        print(f"figures written to {args.json_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
