"""Run the offload benchmark on a GPU the way `hybridmon bench` and the HTTP endpoint do.

Per GPU: refuse when the GPU is in use (unless forced) or in MIG mode (unless the caller accepts a
per-instance figure), run the binary with the host buffers on the GPU's NUMA node and its copying
thread on the GPU's local CPUs (placement.py), then once more with the buffers on a remote node
when the host has one, watch the PCIe link meanwhile (it trains up under load; the fastest state
seen is the link the copies ran on), and store the run atomically in the state directory.

CUDA numbers devices fastest-first by default and honours CUDA_VISIBLE_DEVICES, NVML numbers them
by PCI bus id. The binary runs with CUDA_DEVICE_ORDER=PCI_BUS_ID and without CUDA_VISIBLE_DEVICES,
so CUDA device N is NVML GPU N; the PCI bus id the binary reports is checked against NVML's.
"""
from __future__ import annotations

import glob
import json
import os
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from hybridmon import __version__
from hybridmon.agent.bench import placement as placing
from hybridmon.agent.bench.build import EXIT_DRIVER_TOO_OLD, EXIT_NO_DEVICE, EXIT_OK
from hybridmon.agent.bench.store import save_run
from hybridmon.exporters.base import CollectorError, NoDataError, ParseError
from hybridmon.exporters.bench_report import Progress, ReportError, parse_error, parse_progress, parse_report
from hybridmon.exporters.bench_runs import C2C_PATH, PCIE_PATH
from hybridmon.exporters.nvml import GpuLostError, Nvml, normalize_pci_bus_id
from hybridmon.exporters.procfs import parse_cpu_list
from hybridmon.exporters.sources import LiveSource

LINK_POLL_SECONDS = 0.2
# Beyond --max-seconds: one sample may still be running when the limit passes, plus start-up.
GRACE_SECONDS = 60.0

UNCHECKED = object()  # run_gpu's `busy` when the caller has not looked at the GPU's activity
ProgressCallback = Callable[[str, str, Progress], None]  # (gpu, placement, progress)


class BenchError(Exception):
    """The benchmark could not run or failed; `exit_code` is what `hybridmon bench` returns."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class GpuBusy(BenchError):
    def __init__(self, message: str) -> None:
        super().__init__(message, exit_code=4)


class NoCudaDevice(BenchError):
    def __init__(self, message: str) -> None:
        super().__init__(message, exit_code=3)


class MigEnabled(BenchError):
    """The GPU is in MIG mode: CUDA enumerates MIG instances under the parent's PCI bus id, so a
    run would measure one instance's copy engines and store it as the whole GPU's link."""

    def __init__(self, message: str) -> None:
        super().__init__(message, exit_code=5)


MIG_NOTE = ("MIG mode is on: CUDA enumerates MIG instances with the parent GPU's PCI bus id, so this "
            "run measured one instance's copy engines, not the GPU's link; kept in the run history "
            "only, never used as the link's capacity")


# Display servers and compositors (their comm, or the last part of nvmlSystemGetProcessName's
# path). A judgement, not a measurement: on a workstation GPU that drives a screen, one of these
# holds a graphics context for as long as the desktop runs, so counting it as "in use" would make
# every bench there forced and never used as capacity. What it moves over PCIe is a framebuffer's
# worth of updates (a 4K 60 Hz screen redrawn whole is 3840 x 2160 x 4 B x 60 = 2 GB/s at the very
# most, mostly far less, since compositors keep the framebuffer in VRAM and scan out from it),
# small beside a copy engine's 25+ GB/s; the utilization threshold still counts a busy desktop.
DISPLAY_SERVERS = frozenset({"Xorg", "X", "Xwayland", "gnome-shell", "kwin_wayland", "kwin_x11",
                             "mutter", "sway", "weston"})


def is_display_server(name: str, kinds: frozenset[str]) -> bool:
    """A process in NVML's graphics list only (no compute or MPS context) named as a display server:
    one with a compute context copies like any CUDA program, whatever it is called."""
    return kinds == {"graphics"} and name.rsplit("/", 1)[-1] in DISPLAY_SERVERS


@dataclass(frozen=True)
class GpuActivity:
    """What else is using a GPU: its processes, compute, graphics and MPS clients where NVML lists
    them (pid, name, bytes or None; None when they could not be read) and utilization (None when
    unknown). `display_servers` are graphics-only display servers (is_display_server), kept out of
    `processes`: they do not make the GPU busy for the bench."""

    processes: tuple[tuple[int, str, int | None], ...] | None
    utilization: float | None
    display_servers: tuple[tuple[int, str, int | None], ...] = ()


def busy_reason(activity: GpuActivity, utilization_at_least: float) -> str | None:
    """Why the GPU counts as in use, or None when it is idle enough to benchmark. When its
    processes cannot be read (NVML refuses or does not support the query, e.g. under MIG or
    without permission) it counts as in use: another process's copies over the link show in no
    utilization figure (copy engines are not SM time), and a run stored as uncontended beside them
    would understate the link's capacity, so starvation would fire early."""
    if activity.processes is None:
        return ("whether other processes use it cannot be told: NVML gives no process list "
                "(not supported or not permitted)")
    reasons = []
    if activity.processes:
        listed = ", ".join(
            f"pid {pid} ({name}{', ' + _gib(used) if used else ''})"
            for pid, name, used in activity.processes[:5])
        more = len(activity.processes) - 5
        reasons.append(f"processes {listed}{f' and {more} more' if more > 0 else ''}")
    if activity.utilization is not None and activity.utilization >= utilization_at_least:
        reasons.append(f"{activity.utilization:.0%} utilization")
    return "; ".join(reasons) or None


def _gib(value: int) -> str:
    return f"{value / 2**30:.1f} GiB"


@dataclass(frozen=True)
class GpuIdentity:
    index: int
    uuid: str
    name: str
    pci_bus_id: str
    numa_node: int | None


class LinkWatcher:
    """Polls the link while the benchmark runs and keeps the fastest state seen."""

    def __init__(self, nvml: Nvml | None, gpu: int) -> None:
        self._nvml, self._gpu = nvml, gpu
        self._best: tuple[int, int] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name=f"bench-link-{gpu}", daemon=True)

    def _poll(self) -> None:
        while True:
            self._sample()
            if self._stop.wait(LINK_POLL_SECONDS):
                self._sample()
                return

    def _sample(self) -> None:
        try:
            state = (self._nvml.pcie_link_generation(self._gpu),
                     self._nvml.pcie_link_width_lanes(self._gpu))
        except (NoDataError, CollectorError, GpuLostError):
            return
        if None not in state and (self._best is None or state[0] * state[1] > self._best[0] * self._best[1]):
            self._best = state

    def __enter__(self) -> "LinkWatcher":
        if self._nvml is not None:
            self._thread.start()
        return self

    def __exit__(self, *_exc: Any) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def link(self) -> dict | None:
        if self._best is None:
            return None
        return {"generation": int(self._best[0]), "width": int(self._best[1]),
                "max_generation": self._nvml.pcie_link_max_generation(self._gpu),
                "max_width": self._nvml.pcie_link_max_width_lanes(self._gpu)}


class BenchRunner:
    def __init__(self, binary: Path | None, state_dir: Path, *, nvml_module: Any = "pynvml",
                 sysfs: str = "/sys", max_seconds: float = 120.0, repeat: int = 10,
                 busy_utilization_at_least: float = 0.05, remote: bool = True,
                 progress: ProgressCallback | None = None, allow_mig: bool = False,
                 procfs: str = "/proc") -> None:
        self.binary, self.state_dir, self.sysfs = binary, state_dir, sysfs
        # <procfs>/self is this process in the agent's PID namespace (the DaemonSet shares the
        # host's, hostPID), so its status carries the cpuset the binary will inherit.
        self.allow_mig, self.proc_self_status = allow_mig, os.path.join(procfs, "self", "status")
        self.max_seconds, self.repeat, self.remote = max_seconds, repeat, remote
        self.busy_utilization_at_least = busy_utilization_at_least
        self.progress = progress
        self._nvml: Nvml | None = Nvml(LiveSource(), nvml_module)
        self.nvml_problem: str | None = None
        try:
            self._nvml.device_count()
        except (NoDataError, CollectorError) as error:
            # The binary still runs and says why CUDA has no device; identity comes from its report.
            self.nvml_problem, self._nvml = str(error), None

    def gpu_count(self) -> int:
        """GPUs NVML counts; 0 without NVML."""
        try:
            return self._nvml.device_count() if self._nvml is not None else 0
        except (NoDataError, CollectorError):
            return 0

    def gpu_indices(self) -> list[int]:
        return list(range(self._nvml.device_count())) if self._nvml is not None else [0]

    def activity(self, gpu: int) -> GpuActivity:
        if self._nvml is None:
            return GpuActivity(None, None)  # NVML not loaded: nothing is known
        # Compute, graphics and MPS clients: a graphics or MPS client's copies use the link as
        # much as a compute process's.
        processes = self._nvml.processes(gpu)
        if processes is None:
            return GpuActivity(None, self._nvml.utilization_ratio(gpu))
        names = self._nvml.process_names(p.pid for p in processes)
        own = os.getpid()
        others = [(p, (p.pid, names.get(p.pid, str(p.pid)), p.used_memory_bytes))
                  for p in processes if p.pid != own]
        return GpuActivity(
            tuple(entry for p, entry in others if not is_display_server(entry[1], p.kinds)),
            self._nvml.utilization_ratio(gpu),
            tuple(entry for p, entry in others if is_display_server(entry[1], p.kinds)))

    def mig_enabled(self, gpu: int) -> bool:
        """Whether NVML says the GPU's MIG mode is on; False where it has no MIG or cannot say
        (without NVML nothing can be asked; the run is then stored as contended anyway)."""
        return self._nvml is not None and self._nvml.mig_enabled(gpu) is True

    def measured_path(self, gpu: int) -> str:
        """The link the copies cross: "c2c" where NVML says the GPU's NVLink-C2C link is on
        (GH200, GB200: host memory is reached over C2C, and a figure measured there is never the
        PCIe link's capacity), else "pcie" (also without NVML, or where it cannot say)."""
        # Nvml.c2c_mode_enabled comes with the C2C collector (issue 29, branch nvml); until both are
        # in, a gate without it answers as a GPU without C2C does.
        c2c_mode_enabled = getattr(self._nvml, "c2c_mode_enabled", None)
        return C2C_PATH if c2c_mode_enabled is not None and c2c_mode_enabled(gpu) is True else PCIE_PATH

    def identity(self, gpu: int) -> GpuIdentity | None:
        if self._nvml is None:
            return None
        try:
            bus_id = self._nvml.pci_bus_id(gpu)
        except ParseError:
            bus_id = None
        return GpuIdentity(gpu, self._nvml.uuid(gpu) or "", self._nvml.name(gpu) or "",
                           bus_id or "", self._nvml.numa_node(gpu))

    def run_gpu(self, gpu: int, force: bool = False, busy: Any = UNCHECKED) -> dict:
        """Benchmark one GPU and store the run; returns the stored record. `busy` is the caller's
        busy_reason when it already looked (the CLI warns with it before a forced run)."""
        mig = self.mig_enabled(gpu)
        if mig and not self.allow_mig:
            raise MigEnabled(f"GPU {gpu} is in MIG mode: CUDA would run the benchmark on one MIG "
                             "instance (enumerated with the parent's PCI bus id) and its figures "
                             "would be stored as the whole GPU's link capacity; run it with "
                             "--mig-instance to keep a per-instance figure in the run history only, "
                             "or measure with MIG off")
        if busy is UNCHECKED:
            busy = busy_reason(self.activity(gpu), self.busy_utilization_at_least)
        if busy and not force and self._nvml is None:
            # Without NVML nothing can be asked: run (the binary says if there is no device at all)
            # and store the run as contended rather than refuse every host without the library.
            force = True
        if busy and not force:
            raise GpuBusy(f"GPU {gpu} is in use ({busy}): a benchmark would compete with it for the "
                          "PCIe link and GPU memory and disturb its users; run it in a quiet "
                          "moment, or force it (--force) and expect lower figures")
        identity = self.identity(gpu)
        placements, failures = [], []
        permitted = placing.allowed(self.proc_self_status)
        locality = (placing.gpu_locality(self.sysfs, identity.pci_bus_id)
                    if identity is not None and identity.pci_bus_id else None)
        with LinkWatcher(self._nvml, gpu) as watcher:
            # Without NVML's bus id the binary places itself (`auto`: the same sysfs files, the
            # same fallbacks) and says in its report what it did.
            local_plan = placing.plan(*locality, permitted) if locality else None
            local = self._run_binary(gpu, local_plan, "local")
            report = local["report"]
            bus_id = normalize_pci_bus_id(report["device"]["pci_bus_id"])
            if identity is not None and identity.pci_bus_id and identity.pci_bus_id != bus_id:
                raise BenchError(f"CUDA device {gpu} is {bus_id} but NVML GPU {gpu} is "
                                 f"{identity.pci_bus_id}: the two disagree on device order")
            gpu_node = locality[0] if locality else report["device"]["numa_node"]
            nodes = memory_nodes(self.sysfs)
            bound = report.get("numa_node") is not None
            local["placement"] = "local" if bound or len(nodes) <= 1 else "unbound"
            placements.append(local)
            remote = self._remote_node(gpu_node, nodes) if self.remote else None
            if remote is not None and permitted.memory_nodes is not None and remote not in permitted.memory_nodes:
                failures.append({"placement": "remote", "error": (
                    f"not measured: NUMA node {remote} is outside this process's allowed memory "
                    f"nodes {placing.format_cpu_list(permitted.memory_nodes)} (Mems_allowed_list)")})
                remote = None
            if remote is not None:
                # The copying thread stays on the GPU's CPUs: only the buffers move, so the
                # difference from the local run is the cost of misplaced memory alone.
                gpu_cpus = locality[1] if locality else None
                remote_plan = placing.plan(gpu_node, gpu_cpus, permitted, memory_node=remote)
                try:
                    placements.append(self._run_binary(gpu, remote_plan, "remote"))
                except BenchError as error:
                    failures.append({"placement": "remote", "error": str(error)})
        record = {
            "format": 1, "finished_at": time.time(), "hybridmon_version": __version__,
            "gpu": {"index": gpu, "uuid": identity.uuid if identity else "",
                    "name": identity.name if identity else report["device"]["name"],
                    "pci_bus_id": bus_id, "numa_node": report["device"]["numa_node"]},
            "link": watcher.link(), "contended": busy, "mig": MIG_NOTE if mig else None,
            "path": self.measured_path(gpu),
            "placements": placements, "failures": failures,
        }
        save_run(self.state_dir, record)
        return record

    def _remote_node(self, gpu_node: int | None, nodes: list[int]) -> int | None:
        """The memory node farthest from the GPU's (the other socket): the misplacement penalty."""
        others = [node for node in nodes if node != gpu_node]
        if gpu_node is None or not others:
            return None
        distances = node_distances(self.sysfs, gpu_node)
        return max(others, key=lambda node: (distances.get(node, 0), -node))

    def _run_binary(self, gpu: int, plan: placing.Placement | None, placement: str) -> dict:
        env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
        where = plan.arguments() if plan is not None else ["--numa-node", "auto", "--cpus", "auto"]
        command = [str(self.binary), "--device", str(gpu), "--repeat", str(self.repeat),
                   "--max-seconds", f"{self.max_seconds:g}", *where]
        try:
            process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                       text=True, env=env)
        except OSError as error:
            raise BenchError(f"cannot run {self.binary}: {error.strerror}") from None
        stderr_lines: list[str] = []
        stdout_parts: list[str] = []
        readers = [
            threading.Thread(target=self._follow, args=(process, gpu, placement, stderr_lines), daemon=True),
            threading.Thread(target=lambda: stdout_parts.append(process.stdout.read()), daemon=True),
        ]
        for reader in readers:
            reader.start()
        try:
            process.wait(timeout=self.max_seconds + GRACE_SECONDS)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            raise BenchError(f"the benchmark on GPU {gpu} ran past {self.max_seconds + GRACE_SECONDS:g} s "
                             "and was stopped") from None
        finally:
            for reader in readers:
                reader.join(timeout=5)
        stdout = "".join(stdout_parts)
        if process.returncode != EXIT_OK:
            raise self._failure(gpu, process.returncode, stdout, stderr_lines)
        try:
            parse_report(stdout)
        except ReportError as error:
            raise BenchError(f"the benchmark's report for GPU {gpu} is unusable: {error}") from None
        report = json.loads(stdout)
        notes = list(plan.notes) if plan is not None else []
        for extra in (report.get("numa_note"), (report.get("cpu_affinity") or {}).get("note")):
            # The binary's own notes where it placed itself, or where the kernel refused it.
            if isinstance(extra, str) and extra and (plan is None or "--" not in extra):
                notes.append(extra)
        return {"placement": placement, "numa_node": report.get("numa_node"), "notes": notes,
                "report": report}

    def _follow(self, process: subprocess.Popen, gpu: int, placement: str, lines: list[str]) -> None:
        for line in process.stderr:
            step = parse_progress(line)
            if step is None:
                lines.append(line.rstrip())
            elif self.progress is not None:
                self.progress(str(gpu), placement, step)

    @staticmethod
    def _failure(gpu: int, status: int, stdout: str, stderr_lines: list[str]) -> BenchError:
        try:
            error = parse_error(stdout)
            what = f"{error.error}: {error.detail}" if error.detail else error.error
        except ReportError:
            what = "; ".join(stderr_lines[-5:]) or f"no output (exit status {status})"
        if status == EXIT_DRIVER_TOO_OLD:
            # Not "no CUDA device": the GPU is there, the driver is older than the runtime the
            # binary links (its message names both versions and the two ways out).
            return BenchError(f"GPU {gpu}: {what}")
        if status == EXIT_NO_DEVICE:
            return NoCudaDevice(f"{what}; the benchmark needs an NVIDIA GPU with a working driver "
                                "(`nvidia-smi` should list it)")
        return BenchError(f"the benchmark failed on GPU {gpu} (exit status {status}): {what}")


def no_gpu_reason(runner: BenchRunner, procfs: str = "/proc", dev: str = "/dev") -> str | None:
    """Why this host certainly has no GPU to benchmark, or None when it may have one.

    NVML counting a GPU settles it. Where NVML fails (no library, driver not loaded) the driver's
    own traces decide: <procfs>/driver/nvidia/gpus/<bus id> (one directory per GPU the kernel
    module bound) or a /dev/nvidia<N> node; with either, the binary runs and says what CUDA sees."""
    if runner.nvml_problem is None:
        count = runner.gpu_count()
        if count:
            return None
        nvml_said = "NVML counts 0 GPUs"
    else:
        nvml_said = runner.nvml_problem
    driver_gpus = os.path.join(procfs, "driver", "nvidia", "gpus")
    if glob.glob(os.path.join(driver_gpus, "*")) or glob.glob(os.path.join(dev, "nvidia[0-9]*")):
        return None
    return (f"{nvml_said}; no {driver_gpus}/* and no {dev}/nvidia<N> either. Nothing was compiled "
            "or run: the benchmark needs an NVIDIA GPU with a working driver (`nvidia-smi` should "
            "list it)")


def memory_nodes(sysfs: str) -> list[int]:
    """NUMA nodes that have memory (sysfs has_memory, e.g. "0-1"); [] when unknown."""
    try:
        with open(os.path.join(sysfs, "devices/system/node/has_memory"), encoding="ascii") as handle:
            return sorted(parse_cpu_list(handle.read()))
    except (OSError, ParseError):
        return []


def node_distances(sysfs: str, node: int) -> dict[int, int]:
    """node -> SLIT distance from `node` (sysfs node<N>/distance); {} when unknown."""
    try:
        with open(os.path.join(sysfs, f"devices/system/node/node{node}/distance"), encoding="ascii") as handle:
            values = [int(value) for value in handle.read().split()]
    except (OSError, ValueError):
        return {}
    return dict(enumerate(values))
