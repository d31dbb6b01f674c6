"""How the agent's cost grows with the GPUs and the watched processes (agent_bench.py --curve).

The host of agent_bench.py (tests/support/scaled_host.py: the fixture host with 8 NVIDIA GPUs and
16 watched vLLM processes) built at other sizes: `gpus` NVIDIA functions (the fixture's two, the
six of scaled_host.NEW_GPUS, then more copied from 0000:17:00.0 on buses 0x50 upwards, alternating
NUMA nodes; with 1 GPU the fixture's A10 at 0000:ca:00.0 is taken off the bus) and `processes`
copies of vLLM's /proc/4242 (pids 4242, 4243, ...). On the fake NVML, process i runs on GPU i // 2
while there are GPUs for it, as in the 8/16 host; the others are watched processes without a GPU
context (the CPU-side workers, tokenizers and routers of a serving stack).

Each point runs in a fresh interpreter (agent_bench.memory_child): `history_ticks` ticks of fake
wall time, every collector on its own schedule and the detectors every 10 s as the sampler runs
them; then CPU per tick averaged over the run, one detector evaluation over the full history
(median of 5) and RSS. Simulated host, fake NVML: the figures are the agent's own Python cost,
not NVML's on a real GPU.
"""
from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Callable

from tests.support import fake_nvml
from tests.support.scaled_host import (NEW_GPUS, SLOW_LINK_GPU, TEMPLATE_GPU, TEMPLATE_PID, THROUGHPUT_DELAY_SECONDS,
                                       ScaledHost, build_scaled_host, store_bench_runs)
from tests.support.scenarios.host import GIB, MIB, SyntheticHost

DEFAULT_GPUS, DEFAULT_PROCESSES = 8, 16
# Processes at 8 GPUs, then GPUs at 16 processes (the 8/16 point is shared).
CURVE_POINTS = ((8, 1), (8, 16), (8, 64), (8, 256), (1, 16), (32, 16))
MAX_GPUS = len(NEW_GPUS) + 2 + 24          # buses 0x50-0x7f hold 24 more
MAX_PROCESSES = 5151 - TEMPLATE_PID - 1    # pids up to the fixture's llama-server, which is removed


def build_sized_host(root: Path, gpus: int = DEFAULT_GPUS, processes: int = DEFAULT_PROCESSES) -> ScaledHost:
    """The scaled host with `gpus` GPUs and `processes` watched processes; at 8 and 16 exactly
    tests/support/scaled_host.build_scaled_host's."""
    if not 1 <= gpus <= MAX_GPUS:
        raise ValueError(f"--gpus must be between 1 and {MAX_GPUS}, not {gpus}")
    if not 1 <= processes <= MAX_PROCESSES:
        raise ValueError(f"--processes must be between 1 and {MAX_PROCESSES}, not {processes}")
    if (gpus, processes) == (DEFAULT_GPUS, DEFAULT_PROCESSES):
        return build_scaled_host(root)
    host = SyntheticHost.from_fixture(root / "host")
    extra = [(f"0000:{0x51 + 2 * i:02x}:00.0", f"0000:{0x50 + 2 * i:02x}:01.0", i % 2) for i in range(24)]
    added = list(NEW_GPUS + tuple(extra))[:max(0, gpus - 2)]
    for address, root_port, node in added:
        host.add_pci_function_like(TEMPLATE_GPU, address, root_port, node)
    sysfs_gpus = sorted([TEMPLATE_GPU] + ([SLOW_LINK_GPU] if gpus > 1 else []) + [a for a, _, _ in added])
    if gpus == 1:
        host.remove_pci_function(SLOW_LINK_GPU)
    pids = tuple(range(TEMPLATE_PID, TEMPLATE_PID + processes))
    for pid in [pid for pid in host.processes if pid not in pids]:
        host.remove_process(pid)
    for pid in pids[1:]:
        host.add_process_like(TEMPLATE_PID, pid)
    host.write()

    template_l40s, template_a10 = fake_nvml.default_gpus()
    nvml_gpus = []
    for index, address in enumerate(sysfs_gpus):
        base = template_a10 if address == SLOW_LINK_GPU else template_l40s
        node = int((host.pci[address].directory / "numa_node").read_text())
        on_this_gpu = [fake_nvml.FakeProcess(pid, "python3", 9 * GIB + (pid % 7) * 256 * MIB)
                       for pid in pids[2 * index:2 * index + 2]]
        gpu = fake_nvml.FakeGpu(**{
            **asdict(base),
            "uuid": f"GPU-{index:08x}-b3c4-4d5e-8f60-{0x17a0 + index:012x}",
            "pci_bus_id": "0000" + address.upper(),
            "numa_node": node,
            "memory_used_bytes": sum(p.used_gpu_memory_bytes for p in on_this_gpu) + 512 * MIB,
            "processes": [],
        })
        gpu.processes = on_this_gpu
        nvml_gpus.append(gpu)
    layout_path = root / "fake-nvml-layout.json"
    layout_path.write_text(json.dumps({"driver_version": "550.54.15",
                                       "gpus": [asdict(gpu) for gpu in nvml_gpus],
                                       "throughput_delay_seconds": THROUGHPUT_DELAY_SECONDS}, indent=2))
    state_dir = root / "state"
    store_bench_runs(state_dir, nvml_gpus)
    return ScaledHost(str(host.root), str(host.procfs), str(host.sysfs), str(layout_path), pids,
                      tuple(sysfs_gpus), str(state_dir))


def run_curve(workdir: Path, inference_url: str, history_ticks: int,
              measure: Callable[[ScaledHost, int, float], dict], seconds_left: Callable[[], float],
              points: tuple[tuple[int, int], ...] = CURVE_POINTS) -> list[dict]:
    """One fresh-process run per (gpus, processes) point; `measure` is agent_bench.bench_memory."""
    curve = []
    for gpus, processes in points:
        print(f"curve: {gpus} GPUs, {processes} processes, {history_ticks} ticks ...", flush=True)
        host = build_sized_host(workdir / f"g{gpus}-p{processes}", gpus, processes)
        host.inference_url = inference_url
        figures = measure(host, history_ticks, max(10.0, seconds_left()))
        curve.append({"gpus": gpus, "processes": processes, **{key: figures[key] for key in (
            "ticks", "cpu_ms_per_tick", "detector_evaluation_ms_median", "rss_mb_end", "history_series",
            "failed_collectors")}})
    return curve


def print_curve(curve: list[dict]) -> None:
    ticks = curve[0]["ticks"] if curve else 0
    print(f"\nCurve ({ticks} ticks = {ticks / 60:.0f} min of history at 1 s each; fresh process per point)")
    print(f"  {'GPUs':>5s} {'procs':>6s} {'CPU/tick':>10s} {'detectors':>11s} {'RSS':>8s} {'series':>8s}")
    for point in curve:
        failed = f"  failed: {', '.join(point['failed_collectors'])}" if point["failed_collectors"] else ""
        print(f"  {point['gpus']:5d} {point['processes']:6d} {point['cpu_ms_per_tick']:8.2f}ms "
              f"{point['detector_evaluation_ms_median']:9.1f}ms {point['rss_mb_end']:6.1f}MB "
              f"{point['history_series']:8d}{failed}")
    print("  CPU/tick: all collectors on their schedules and the detectors every 10 s, averaged over the"
          " run;\n  detectors: one evaluation over the full history (median of 5).")
