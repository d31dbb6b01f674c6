"""Where `hybridmon bench` puts the benchmark's buffers and copying thread (agent/bench/placement.py)
on sysfs and /proc/self/status trees written per test, and what it does on a GPU in MIG mode.
The binary is the stand-in of tests/support/bench_helpers.py; NVML is the fake."""
from __future__ import annotations

from pathlib import Path

import pytest

from hybridmon.agent.bench import placement
from hybridmon.agent.bench.runner import BenchRunner, MigEnabled, busy_reason
from hybridmon.exporters.bench import BenchCollector
from hybridmon.exporters.bench_runs import load_latest, measured_capacity, parse_stored_run
from hybridmon.exporters.base import NoDataError
from hybridmon.exporters.sources import LiveSource
from tests.support.bench_helpers import calls, fake_binary
from tests.support.fake_nvml import GIB, MIB, FakeNvml, FakeProcess, default_gpus, mig_gpu

BUS_ID = "0000:17:00.0"  # the fake NVML's GPU 0


def sysfs_tree(root: Path, numa_node: str = "1", local_cpulist: str | None = "16-31",
               has_memory: str = "0-1") -> str:
    """A sysfs with the GPU's PCI device and two memory nodes at SLIT distance 21."""
    device = root / "sys" / "bus" / "pci" / "devices" / BUS_ID
    device.mkdir(parents=True)
    (device / "numa_node").write_text(numa_node + "\n")
    if local_cpulist is not None:
        (device / "local_cpulist").write_text(local_cpulist + "\n")
    nodes = root / "sys" / "devices" / "system" / "node"
    nodes.mkdir(parents=True)
    (nodes / "has_memory").write_text(has_memory + "\n")
    for node, distances in (("0", "10 21"), ("1", "21 10")):
        (nodes / f"node{node}").mkdir()
        (nodes / f"node{node}" / "distance").write_text(distances + "\n")
    return str(root / "sys")


def procfs_tree(root: Path, cpus: str = "0-63", mems: str = "0-1") -> str:
    (root / "proc" / "self").mkdir(parents=True)
    (root / "proc" / "self" / "status").write_text(
        f"Name:\tpython3\nCpus_allowed:\tffffffff\nCpus_allowed_list:\t{cpus}\nMems_allowed_list:\t{mems}\n")
    return str(root / "proc")


def idle_nvml(gpus=None) -> FakeNvml:
    nvml = FakeNvml()
    gpus = gpus or default_gpus()
    for gpu in gpus:
        gpu.processes, gpu.utilization_percent = [], 0
    nvml.configure(gpus=gpus)
    return nvml


def run(tmp_path: Path, sysfs: str, procfs: str, nvml=None, **options) -> dict:
    binary = fake_binary(tmp_path, local_node=options.pop("local_node", "1"))
    force = options.pop("force", False)
    return BenchRunner(binary, tmp_path / "state", nvml_module=nvml or idle_nvml(), sysfs=sysfs,
                       procfs=procfs, **options).run_gpu(0, force=force)


def placement_args(call: list[str]) -> tuple[str, str]:
    return call[call.index("--numa-node") + 1], call[call.index("--cpus") + 1]


# --- the plan, from the files ------------------------------------------------------------------

def test_the_gpu_node_and_its_local_cpus_are_bound_within_the_allowed_ones(tmp_path):
    node, cpus = placement.gpu_locality(sysfs_tree(tmp_path), BUS_ID)
    permitted = placement.allowed(procfs_tree(tmp_path, cpus="0-23") + "/self/status")
    plan = placement.plan(node, cpus, permitted)
    assert plan.arguments() == ["--numa-node", "1", "--cpus", "16-23"]
    assert plan.notes == ("CPUs bound to 16-23: the GPU's local CPUs 16-31 narrowed to the allowed ones",)


def test_numa_node_minus_one_binds_the_local_cpus_and_leaves_memory_unbound(tmp_path):
    node, cpus = placement.gpu_locality(sysfs_tree(tmp_path, numa_node="-1", local_cpulist="0-7"), BUS_ID)
    plan = placement.plan(node, cpus, placement.allowed(procfs_tree(tmp_path) + "/self/status"))
    assert plan.arguments() == ["--numa-node", "none", "--cpus", "0-7"]
    assert plan.notes == ("no locality known (sysfs numa_node is -1 or unreadable): host memory not bound",)


def test_no_locality_at_all_is_said_not_guessed(tmp_path):
    node, cpus = placement.gpu_locality(sysfs_tree(tmp_path, numa_node="-1", local_cpulist=None), BUS_ID)
    plan = placement.plan(node, cpus, placement.Allowed(None, None))
    assert plan.arguments() == ["--numa-node", "none", "--cpus", "none"]
    assert [note.split(" (")[0] for note in plan.notes] == ["no locality known"] * 2


def test_a_node_and_cpus_outside_the_containers_cpuset_are_not_bound(tmp_path):
    node, cpus = placement.gpu_locality(sysfs_tree(tmp_path), BUS_ID)
    plan = placement.plan(node, cpus, placement.allowed(procfs_tree(tmp_path, cpus="0-15", mems="0") + "/self/status"))
    assert plan.arguments() == ["--numa-node", "none", "--cpus", "none"]
    assert "NUMA node 1 is outside this process's allowed memory nodes 0" in plan.notes[0]
    assert "local CPUs 16-31 are outside this process's allowed CPUs 0-15" in plan.notes[1]


@pytest.mark.parametrize("cpus, text", [({0, 1, 2, 5}, "0-2,5"), ({7}, "7"), ({0, 2, 3, 4, 9, 10}, "0,2-4,9-10")])
def test_cpu_lists_are_written_in_the_kernels_form(cpus, text):
    assert placement.format_cpu_list(frozenset(cpus)) == text


# --- the runner, with those files ----------------------------------------------------------------

@pytest.mark.slow
def test_a_gpu_node_outside_cpuset_mems_no_longer_fails_the_local_run(tmp_path):
    """Issue 13: binding to a node outside the container's cpuset.mems failed the local run
    (set_mempolicy EINVAL, exit 6). Now the memory is left unbound with a note in the stored run,
    and the remote run, on a node the process may not use either, is not attempted."""
    record = run(tmp_path, sysfs_tree(tmp_path), procfs_tree(tmp_path, cpus="0-63", mems="0"))
    # The remote run (node 0, allowed) still runs, with the thread on the GPU's CPUs.
    assert [placement_args(call) for call in calls(tmp_path)] == [("none", "16-31"), ("0", "16-31")]
    local = record["placements"][0]
    assert local["placement"] == "unbound" and local["numa_node"] is None
    assert any("NUMA node 1 is outside" in note for note in local["notes"])
    assert record["failures"] == []
    # A GPU on the allowed node 0: its remote node 1 is refused, so that run is skipped with why.
    record = run(tmp_path / "b", sysfs_tree(tmp_path / "b", numa_node="0"),
                 procfs_tree(tmp_path / "b", mems="0"), local_node="0")
    assert [f["placement"] for f in record["failures"]] == ["remote"]
    assert "NUMA node 1 is outside this process's allowed memory nodes 0" in record["failures"][0]["error"]


@pytest.mark.slow
def test_the_remote_run_moves_only_the_buffers(tmp_path):
    run(tmp_path, sysfs_tree(tmp_path), procfs_tree(tmp_path))
    assert [placement_args(call) for call in calls(tmp_path)] == [("1", "16-31"), ("0", "16-31")]


@pytest.mark.slow
def test_without_nvml_the_binary_places_itself(tmp_path):
    run(tmp_path, sysfs_tree(tmp_path), procfs_tree(tmp_path), nvml="hybridmon_no_such_nvml_module")
    assert placement_args(calls(tmp_path)[0]) == ("auto", "auto")


# --- MIG ---------------------------------------------------------------------------------------------

def mig_nvml() -> FakeNvml:
    gpu = mig_gpu(bus_id="00000000:17:00.0")
    gpu.utilization_percent = 0
    return idle_nvml([gpu])


def test_a_gpu_in_mig_mode_is_refused_before_anything_runs(tmp_path):
    with pytest.raises(MigEnabled, match="--mig-instance") as raised:
        run(tmp_path, sysfs_tree(tmp_path), procfs_tree(tmp_path), nvml=mig_nvml())
    assert raised.value.exit_code == 5
    assert calls(tmp_path) == [] and not (tmp_path / "state").exists()


@pytest.mark.slow
def test_a_mig_instance_run_is_history_only_and_never_the_gpus_capacity(tmp_path):
    """CUDA enumerates MIG instances with the parent's bus id: one slice's figure stored as the
    GPU's latest run would become the link capacity GpuPcieStarvation divides by."""
    record = run(tmp_path, sysfs_tree(tmp_path), procfs_tree(tmp_path), nvml=mig_nvml(),
                 allow_mig=True, force=True)
    assert "one instance's copy engines" in record["mig"]
    (stored,) = (tmp_path / "state" / "bench" / "runs").iterdir()
    assert stored.name.endswith(f"-{BUS_ID}-mig.json")
    assert measured_capacity(parse_stored_run(stored.read_text())) == {}
    assert load_latest(tmp_path / "state") == ([], [])
    with pytest.raises(NoDataError):
        BenchCollector(LiveSource(), tmp_path / "state").collect()


def test_the_busy_check_sees_graphics_clients_too_but_not_a_display_server(tmp_path):
    """Nvml.processes (compute, graphics and MPS lists): a Vulkan or OpenGL client's copies use the
    link like a compute process's; a display server in the graphics list only does not make the GPU
    busy (runner.DISPLAY_SERVERS: a judgement), while the same name with a compute context does."""
    gpus = default_gpus()
    nvml = FakeNvml()
    nvml.configure(gpus=gpus)
    for gpu in gpus:
        gpu.processes = [p for p in gpu.processes if "graphics" in p.kinds]
        gpu.utilization_percent = 0
    gpus[0].processes.append(FakeProcess(7001, "llama-server", 2 * GIB, ("graphics",)))  # Vulkan backend
    gpus[1].processes.append(FakeProcess(7002, "Xwayland", 64 * MIB, ("graphics", "compute")))
    bench = BenchRunner(fake_binary(tmp_path), tmp_path / "state", nvml_module=nvml,
                        sysfs=sysfs_tree(tmp_path), procfs=procfs_tree(tmp_path))
    first, second = bench.activity(0), bench.activity(1)
    assert [name for _pid, name, _used in first.processes] == ["llama-server"]
    assert [name for _pid, name, _used in first.display_servers] == ["Xorg"]
    assert [name for _pid, name, _used in second.processes] == ["Xwayland"]
    assert [name for _pid, name, _used in second.display_servers] == ["Xorg"]
    gpus[0].processes = [p for p in gpus[0].processes if p.pid != 7001]
    assert busy_reason(bench.activity(0), 0.05) is None
