"""The fixture host scaled to 8 GPUs and 16 watched inference processes, for measuring what the agent
costs (benchmarks/agent_bench.py, docs/performance.md).

Built in a directory of its own from the synthetic host (scenarios/host.py): the fixture tree
(tests/fixtures/host-2node) with 6 more NVIDIA PCI functions copied from 0000:17:00.0, 3 on each
NUMA node behind root ports of their own, and vLLM's /proc/4242 copied to pids 4243-4257 (the
fixture's llama-server, 5151, is removed so that exactly 16 are watched), written as the synthetic
host writes its files. Beside it: a fake NVML layout (fake_nvml.py) with the same 8 GPUs in PCI bus
order, 2 of the 16 processes on each and a 20 ms wait per PCIe throughput direction as real NVML
has, and a stored `hybridmon bench` run per GPU.
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from hybridmon.agent.bench.store import save_run
from hybridmon.agent.config import AgentConfig, load_config
from hybridmon.exporters.gpu import GPU_UP
from hybridmon.exporters.pcie import DEVICE_PRESENT
from hybridmon.exporters.process import RESIDENT
from tests.support import fake_nvml
from tests.support.scenarios.host import GIB, MIB, REPO, SyntheticHost

# Existing GPUs: 0000:17:00.0 (node 0, Gen4 x16, AER) and 0000:ca:00.0 (node 1, downtrained Gen3 x8).
# Six more, copied from 0000:17:00.0: (address, root port, NUMA node).
NEW_GPUS = (
    ("0000:27:00.0", "0000:26:01.0", 0),
    ("0000:38:00.0", "0000:37:01.0", 0),
    ("0000:4a:00.0", "0000:49:01.0", 0),
    ("0000:98:00.0", "0000:97:01.0", 1),
    ("0000:b1:00.0", "0000:b0:01.0", 1),
    ("0000:da:00.0", "0000:d9:01.0", 1),
)
TEMPLATE_GPU = "0000:17:00.0"
SLOW_LINK_GPU = "0000:ca:00.0"  # keeps the fixture's second model (A10) and its downtrained link
TEMPLATE_PID = 4242
PIDS = tuple([TEMPLATE_PID] + list(range(4243, 4258)))  # 16 watched processes
DROPPED_PIDS = (5151,)  # the fixture's llama-server: not one of the 16
THROUGHPUT_DELAY_SECONDS = 0.02
BENCH_REPORT = REPO / "tests/fixtures/bench/report-gen4-local.json"


@dataclass
class ScaledHost:
    root: str
    procfs: str
    sysfs: str
    layout: str  # fake NVML layout JSON
    pids: tuple[int, ...]
    gpu_bus_ids: tuple[str, ...]  # sysfs form, in NVML index order
    state_dir: str = ""           # a stored `hybridmon bench` run per GPU (hand-written figures)
    inference_url: str = ""       # a fake vLLM /metrics on loopback, scraped every 5 s

    def environment(self) -> dict[str, str]:
        """HYBRIDMON_* variables configuring the agent for this host (the NVML layout is loaded by
        load_fake_nvml in this process, or by HYBRIDMON_FAKE_NVML_LAYOUT in a daemon's)."""
        return {
            "HYBRIDMON_STATE_DIR": self.state_dir,
            "HYBRIDMON_INFERENCE__ENDPOINTS": json.dumps([self.inference_url]),
            "HYBRIDMON_PATHS__PROCFS": self.procfs,
            "HYBRIDMON_PATHS__SYSFS": self.sysfs,
            "HYBRIDMON_GPU__NVML_MODULE": "tests.support.fake_nvml",
            "HYBRIDMON_PCIE__UDEV": "false",
            "HYBRIDMON_PROCESS__PIDS": json.dumps(list(self.pids)),
            "HYBRIDMON_LOG_LEVEL": "warning",
        }

    def agent_config(self) -> AgentConfig:
        return load_config(environ=self.environment())


def build_scaled_host(root: Path) -> ScaledHost:
    host = SyntheticHost.from_fixture(root / "host")
    for address, root_port, node in NEW_GPUS:
        host.add_pci_function_like(TEMPLATE_GPU, address, root_port, node)
    for pid in DROPPED_PIDS:
        host.remove_process(pid)
    for pid in PIDS[1:]:
        host.add_process_like(TEMPLATE_PID, pid)
    host.write()

    # NVML: 8 GPUs in PCI bus order (NVML's), bus ids matching sysfs, 2 processes each.
    sysfs_gpus = sorted([TEMPLATE_GPU, SLOW_LINK_GPU] + [address for address, _, _ in NEW_GPUS])
    template_l40s, template_a10 = fake_nvml.default_gpus()
    gpus = []
    for index, address in enumerate(sysfs_gpus):
        base = template_a10 if address == SLOW_LINK_GPU else template_l40s
        node = int((host.pci[address].directory / "numa_node").read_text())
        processes = [fake_nvml.FakeProcess(pid, "python3", 9 * GIB + (pid % 7) * 256 * MIB)
                     for pid in PIDS[2 * index:2 * index + 2]]
        gpu = fake_nvml.FakeGpu(**{
            **asdict(base),
            "uuid": f"GPU-{index:08x}-b3c4-4d5e-8f60-{0x17a0 + index:012x}",
            "pci_bus_id": "0000" + address.upper(),  # NVML's form: 00000000:17:00.0
            "numa_node": node,
            "memory_used_bytes": sum(p.used_gpu_memory_bytes for p in processes) + 512 * MIB,
            "processes": [],
        })
        gpu.processes = processes
        gpus.append(gpu)
    layout = {
        "driver_version": "550.54.15",
        "gpus": [asdict(gpu) for gpu in gpus],
        "throughput_delay_seconds": THROUGHPUT_DELAY_SECONDS,
    }
    layout_path = root / "fake-nvml-layout.json"
    layout_path.write_text(json.dumps(layout, indent=2))
    state_dir = root / "state"
    store_bench_runs(state_dir, gpus)
    return ScaledHost(str(host.root), str(host.procfs), str(host.sysfs), str(layout_path), PIDS,
                      tuple(sysfs_gpus), str(state_dir))


def store_bench_runs(state_dir: Path, gpus: list[fake_nvml.FakeGpu]) -> None:
    """One stored benchmark run per GPU, so the bench collector reads 8 files as on a measured host
    (the figures are the hand-written test report's, tests/fixtures/bench)."""
    report = json.loads(BENCH_REPORT.read_text())
    for index, gpu in enumerate(gpus):
        bus_id = gpu.pci_bus_id[4:].lower()
        placed = {**report, "device": {**report["device"], "index": index, "pci_bus_id": bus_id}}
        save_run(state_dir, {"format": 1, "finished_at": time.time(), "hybridmon_version": "bench",
                             "gpu": {"index": index, "uuid": gpu.uuid, "name": gpu.name,
                                     "pci_bus_id": bus_id, "numa_node": gpu.numa_node},
                             "link": {"generation": 4, "width": 16, "max_generation": 4, "max_width": 16},
                             "contended": None, "failures": [],
                             "placements": [{"placement": "local", "numa_node": gpu.numa_node,
                                             "report": placed}]})


def load_fake_nvml(host: ScaledHost, throughput_delay_seconds: float) -> fake_nvml.FakeNvml:
    """The fake NVML of this process, answering with the host's layout."""
    fake_nvml.reset()
    fake_nvml.load_layout(host.layout)
    fake_nvml.configure(throughput_delay_seconds=throughput_delay_seconds)
    return fake_nvml.DEFAULT


PROCESS_MEMORY_PATTERNS = ("leak", "flat", "sawtooth")
LEAK_BYTES_PER_HOUR = 512 * MIB


def vary_fake_values(fake: fake_nvml.FakeNvml, tick: int, process_memory: str = "leak") -> None:
    """Changes what NVML answers, so every tick commits new values.

    Each process's GPU memory: "leak" grows LEAK_BYTES_PER_HOUR from 9 GiB, 7 MiB a tick up and
    down within a 64 MiB band on top (so every tick's value is new): from 30 minutes in, every
    process is judged in full (its slope worked out, its load rated) and all 16 alerts fire, the
    detector's worst case. "flat" alternates by 4 KiB around a level, as a vLLM engine's memory
    holds still: the common case (vLLM allocates its KV cache blocks once at start-up, sized by
    the engine argument --gpu-memory-utilization, the share of GPU memory it takes; vLLM's
    engine-arguments documentation). "sawtooth" climbs 7 MiB a tick and drops back 2 GiB about
    every 4.9 minutes: no growth over an hour, though an hour's Theil-Sen slope over points
    crowded into its last 10 minutes read it as growth (memory_growth_trend says why they no
    longer are)."""
    for index, gpu in enumerate(fake.gpus):
        phase = tick * 7 + index * 131
        gpu.pcie_rx_kilobytes_per_second = 200_000 + (phase * 7919) % 20_000_000
        gpu.pcie_tx_kilobytes_per_second = 50_000 + (phase * 104_729) % 5_000_000
        gpu.utilization_percent = (tick + index * 13) % 101
        for number, process in enumerate(gpu.processes):
            if process_memory == "flat":
                process.used_gpu_memory_bytes = 9 * GIB + (index * 2 + number) * MIB + (tick % 2) * 4096
            elif process_memory == "leak":
                process.used_gpu_memory_bytes = (9 * GIB + tick * LEAK_BYTES_PER_HOUR // 3600
                                                 + ((phase + number * 17) % 64) * MIB)
            else:
                process.used_gpu_memory_bytes = 9 * GIB + ((phase + number * 17) % 2048) * MIB
        gpu.memory_used_bytes = sum(p.used_gpu_memory_bytes for p in gpu.processes) + 512 * MIB


def exposition_needles(host: ScaledHost) -> tuple[str, str]:
    """Two lines of the samples exposition that show the whole host is read: the last GPU and the
    last watched process."""
    return (f'{GPU_UP.name}{{gpu="{len(host.gpu_bus_ids) - 1}"',
            f'{RESIDENT.name}{{pid="{host.pids[-1]}",process_name="python3"}}')


def check_agent_sees_the_host(agent, host: ScaledHost) -> None:
    """Raises unless every collector succeeded and every GPU, PCI function and process is exported."""
    problems = []
    for item in agent.sampler.scheduled:
        state = item.state
        if state.runs and (not state.last_success or state.no_data_reason):
            problems.append(f"{item.collector.name}: {state.last_error or state.no_data_reason}")
    text = agent.exposition.samples_text().decode()
    for index, address in enumerate(host.gpu_bus_ids):
        if f'{GPU_UP.name}{{gpu="{index}"' not in text:
            problems.append(f"no GPU {index} in the exposition")
        if f'{DEVICE_PRESENT.name}{{pci_bus_id="{address}"}} 1.0' not in text:
            problems.append(f"no PCI device {address} in the exposition")
    for pid in host.pids:
        if f'{RESIDENT.name}{{pid="{pid}",process_name="python3"}}' not in text:
            problems.append(f"process {pid} not watched")
    process = next(item.collector for item in agent.sampler.scheduled if item.collector.name == "process")
    if sorted(process.watched()) != sorted(host.pids):
        problems.append(f"watched pids {sorted(process.watched())}, expected {sorted(host.pids)}")
    if problems:
        raise RuntimeError("the agent does not see the scaled host as built:\n  " + "\n  ".join(problems))
