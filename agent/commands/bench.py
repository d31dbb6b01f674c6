"""`hybridmon bench`: build or find the benchmark, run it per GPU with a progress line, store and
summarise the results.

Exit statuses: 0 measured, 1 failed (build, CUDA error, verification, storage), 2 usage,
3 no CUDA device (found before anything is compiled), 4 a GPU is in use and --force was not
given, 5 a GPU is in MIG mode and --mig-instance was not given.
"""
from __future__ import annotations

import json
import sys
from typing import TextIO

from hybridmon.agent.bench.build import BenchBuildError, locate_binary
from hybridmon.agent.bench.runner import BenchError, BenchRunner, busy_reason, no_gpu_reason
from hybridmon.agent.config import AgentConfig
from hybridmon.agent.commands.progress import LiveLine, Ticker
from hybridmon.exporters.bench_report import LOOP, Progress, ReportError
from hybridmon.exporters.bench_runs import C2C_PATH, bidirectional_capacity, measured_capacity, parse_stored_run
from hybridmon.exporters.nvml import GpuLostError
from hybridmon.pcie_rates import link_name, theoretical_capacity


COLUMNS = {"host_to_device": "host->device", "device_to_host": "device->host",
           "host_to_device_bidirectional": "h->d (both ways)",
           "device_to_host_bidirectional": "d->h (both ways)",
           "bidirectional_summed": "both (summed)"}


class ProgressLine:
    """The benchmark's step, rewritten in place on a terminal; nothing on a pipe (agent/commands/progress.py)."""

    def __init__(self, stream: TextIO) -> None:
        self.line = LiveLine(stream)

    def __call__(self, gpu: str, placement: str, step: Progress) -> None:
        size = _size(step.transfer_bytes)
        self.line.show(f"GPU {gpu} {placement}: [{step.step:>2}/{step.steps}] "
                       f"{step.direction.replace('_', ' ')} {step.memory}"
                       f"{' loop' if step.issue == LOOP and step.memory == 'pinned' else ''} {size}")

    def done(self) -> None:
        self.line.clear()


def _size(value: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if value >= scale:
            return f"{value / scale:g} {unit}"
    return f"{value:g} B"


def main(config: AgentConfig, gpu: int | None, as_json: bool, force: bool,
         binary: str | None, remote: bool, out: TextIO = sys.stdout, err: TextIO = sys.stderr,
         mig_instance: bool = False) -> int:
    progress = ProgressLine(err)
    with progress.line.apart_from_logs():  # NVML's log lines must not land after the progress text
        return _measure(config, gpu, as_json, force, binary, remote, out, err, mig_instance, progress)


def _measure(config: AgentConfig, gpu: int | None, as_json: bool, force: bool, binary: str | None,
             remote: bool, out: TextIO, err: TextIO, mig_instance: bool, progress: ProgressLine) -> int:
    runner = BenchRunner(None, config.resolved_state_dir(), nvml_module=config.gpu.nvml_module,
                         sysfs=config.paths.sysfs, procfs=config.paths.procfs,
                         max_seconds=config.bench.max_seconds, repeat=config.bench.repeat,
                         busy_utilization_at_least=config.bench.busy_utilization_at_least,
                         remote=remote, progress=progress, allow_mig=mig_instance)
    # Before compiling (about 15 s of nvcc on two cores): a host without a GPU learns so at once.
    absent = no_gpu_reason(runner, config.paths.procfs)
    if absent:
        err.write(f"hybridmon: no NVIDIA GPU to benchmark: {absent}\n")
        return 3
    try:
        # nvcc prints nothing for its ~15 s on first use (a cached binary returns at once).
        with Ticker(progress.line, lambda seconds: f"hybridmon bench: finding or building the benchmark "
                                                   f"(nvcc on first use), {seconds:.0f} s"):
            runner.binary = locate_binary(binary or config.bench.binary)
    except BenchBuildError as error:
        err.write(f"hybridmon: cannot build or find the benchmark: {error}\n")
        return 1
    if runner.nvml_problem:
        err.write(f"hybridmon: warning: {runner.nvml_problem}; running the benchmark without GPU "
                  "identity or link state\n")
    gpus = runner.gpu_indices() if gpu is None else [gpu]
    records, code = [], 0
    for index in gpus:
        try:
            busy = busy_reason(runner.activity(index), config.bench.busy_utilization_at_least)
        except GpuLostError as error:
            err.write(f"hybridmon: {error}\n")
            code = code or 1
            continue
        if busy and force:
            err.write(f"hybridmon: warning: GPU {index} is in use ({busy}); benchmarking anyway "
                      "(--force): its users will see a busier link, and the figures will be low\n")
        try:
            records.append(runner.run_gpu(index, force=force, busy=busy))
        except (BenchError, ReportError, OSError) as error:
            progress.done()
            err.write(f"hybridmon: {error}\n")
            code = code or getattr(error, "exit_code", 1)
        progress.done()
    if as_json:
        out.write(json.dumps({"runs": records, "state_dir": str(config.resolved_state_dir())},
                             indent=2) + "\n")
    else:
        for record in records:
            out.write(render(record) + "\n")
        if records:
            out.write(f"stored in {config.resolved_state_dir() / 'bench'}\n")
    return code


def render(record: dict) -> str:
    """A short table per GPU: pinned/pageable per size and direction, efficiency vs the link."""
    run = parse_stored_run(json.dumps(record))
    link = run.link
    if run.mig:
        lines_before = [f"  {run.mig}"]
    else:
        lines_before = []
    over_c2c = run.path == C2C_PATH
    # Over NVLink-C2C the PCIe link's rate bounds nothing the copies did: no share of it.
    capacity = theoretical_capacity(link.generation, link.width) if link and not over_c2c else None
    lines = [f"GPU {run.gpu_index} {run.name} ({run.pci_bus_id}, NUMA node "
             f"{'?' if run.gpu_numa_node is None else run.gpu_numa_node})"
             + (", copies over NVLink-C2C" if over_c2c
                else f", link {link_name(link.generation, link.width)}" if link else ", link unknown")]
    lines += lines_before
    if run.contended:
        lines.append(f"  measured while the GPU was in use ({run.contended}): figures are low")
    for placement, report in run.reports.items():
        node = "not bound" if report.numa_node is None else f"node {report.numa_node}"
        cpus = report.cpu_affinity
        where = f"; CPUs {cpus['cpus']}" if cpus and cpus["bound"] else ""
        lines.append(f"  host buffers {placement} ({node}{where}), median GB/s"
                     + (" (share of the link)" if capacity else "") + ":")
        for note in (run.notes or {}).get(placement, ()):
            lines.append(f"    note: {note}")
        shown = [d for d in COLUMNS if any(r.direction == d for r in report.results)]
        lines.append(f"    {'':<21}" + "".join(f"{COLUMNS[name]:>18}" for name in shown))
        cells: dict[tuple[str, int], dict[str, str]] = {}
        for result in report.results:
            limit = capacity * (2 if result.direction == "bidirectional_summed" else 1) if capacity else None
            share = f" ({result.median_bytes_per_second / limit:.0%})" if limit else ""
            # A pinned copy loop (KV-block sizes) gets its own row beside the queued copies.
            kind = result.memory + (" loop" if result.memory == "pinned" and result.issue == LOOP else "")
            cells.setdefault((kind, result.transfer_bytes), {})[result.direction] = (
                f"{result.median_bytes_per_second / 1e9:.2f}{share}")
        for (kind, size), row in cells.items():
            lines.append(f"    {kind:<11} {_size(size):>9}"
                         + "".join(f"{row.get(direction, '-'):>18}" for direction in shown))
        for size, reason in report.skipped:
            lines.append(f"    skipped {_size(size)}: {reason}")
    for placement, error in run.failures:
        lines.append(f"  {placement} placement failed: {error}")
    peak = measured_capacity(run)
    if run.mig:
        lines.append("  not used as link capacity (one MIG instance); stored in the run history only")
    elif peak and run.contended:
        lines.append("  not used as link capacity (measured while the GPU was in use)")
    elif peak:
        lines.append(f"  capacity used by {'GpuC2cStarvation' if over_c2c else 'GpuPcieStarvation'}: " + ", ".join(
            f"{direction.replace('_', ' ')} {value / 1e9:.2f} GB/s"
            for direction, (value, _size_bytes) in sorted(peak.items())))
        lines.append("  both ways at once: not judged over NVLink-C2C" if over_c2c else "  " + _both_ways(run))
    return "\n".join(lines)


def _both_ways(run) -> str:
    """What GpuPcieStarvation divides both directions' traffic by, from this run or not (and why)."""
    both = bidirectional_capacity(run)
    if len(both) == 2:
        return ("both ways at once: " + " + ".join(
            f"{direction.replace('_', ' ')} {value / 1e9:.2f}" for direction, (value, _size) in sorted(both.items()))
            + f" = {sum(value for value, _size in both.values()) / 1e9:.2f} GB/s")
    return ("both ways at once: not from this run (a run before issue 29 measured the two "
            "directions with equal bytes, or the other direction stopped first): the bidirectional "
            "factor of the link stands in; run hybridmon bench again")
