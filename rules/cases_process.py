"""promtool tests for the watched-process rules: memory growth and NUMA placement."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the schema is built from the families, which import these rules
    from hybridmon.agent.alerts.catalogue import Thresholds

from hybridmon.rules import process
from hybridmon.rules.cases_host import HOST2, LLAMA, SGLANG, VLLM, process_label
from hybridmon.rules.scenarios import BUS0, BUS1, GIB, GPU0, GPU1, HOST, Catalog, Test, above, firing, not_yet


TGI = {"pid": "7171", "name": "text-generation"}


def on_gpu(test: Test, gpu: dict, proc: dict, used: float | list[float], instance: str = HOST) -> None:
    labels = {**gpu, "pid": proc["pid"], "process_name": proc["name"]}
    if isinstance(used, list):
        test.values("hybridmon_gpu_process_memory_used_bytes", used, instance, **labels)
    else:
        test.constant("hybridmon_gpu_process_memory_used_bytes", used, instance, **labels)


def numa(t: Thresholds, catalog: Catalog) -> Test:
    n = t.numa_misplacement
    cpus_rule = catalog.find("InferenceProcessNumaMisplaced", reason="cpus")
    memory_rule = catalog.find("InferenceProcessNumaMisplaced", reason="memory")
    at = firing(n.for_seconds)
    off, fine = above(n.share_off_gpu_node), n.share_off_gpu_node / 2
    mapped = 12 * GIB
    test = Test("NUMA: python3 (pid 4242) on GPU 0 (node 0 per NVML) is moved to node 1's CPUs; "
                "llama-server (pid 5151) on GPU 1 (node 1 per sysfs, NVML silent) gets its memory "
                "on node 0; gpu-host-2 has one NUMA node and stays silent", at + 120, catalog)
    for instance, nodes in ((HOST, ("0", "1")), (HOST2, ("0",))):
        for node in nodes:
            test.constant("hybridmon_numa_node_memory_total_bytes", 64 * GIB, instance, node=node)
        test.constant("hybridmon_gpu_numa_node", 0, instance, **GPU0)
        for gpu, bus in ((GPU0, BUS0), (GPU1, BUS1)):
            test.constant("hybridmon_gpu_info", 1, instance, **gpu, name="NVIDIA L40S", pci_bus_id=bus,
                          driver_version="550.54.15")
        # sysfs disagrees for GPU 0 on purpose: NVML's answer wins
        test.constant("hybridmon_pcie_device_numa_node", 1, instance, pci_bus_id=BUS0)
        test.constant("hybridmon_pcie_device_numa_node", 1, instance, pci_bus_id=BUS1)
        on_gpu(test, GPU0, VLLM, 20 * GIB, instance)
        on_gpu(test, GPU1, LLAMA, 8 * GIB, instance)
        # python3: 16 CPUs, all on node 0 until the onset, all on node 1 after; memory stays put
        test.constant("hybridmon_process_allowed_cpus", 16, instance, **VLLM)
        test.gauge("hybridmon_process_allowed_cpus_on_node", 16, 0, instance, **VLLM, node="0")
        test.gauge("hybridmon_process_allowed_cpus_on_node", 0, 16, instance, **VLLM, node="1")
        test.constant("hybridmon_process_numa_resident_bytes", (1 - fine) * mapped, instance, **VLLM, node="0")
        test.constant("hybridmon_process_numa_resident_bytes", fine * mapped, instance, **VLLM, node="1")
        # llama-server: CPUs on node 1 throughout; memory moves to node 0 at the onset
        test.constant("hybridmon_process_allowed_cpus", 8, instance, **LLAMA)
        test.constant("hybridmon_process_allowed_cpus_on_node", 0, instance, **LLAMA, node="0")
        test.constant("hybridmon_process_allowed_cpus_on_node", 8, instance, **LLAMA, node="1")
        test.gauge("hybridmon_process_numa_resident_bytes", fine * mapped, off * mapped, instance,
                   **LLAMA, node="0")
        test.gauge("hybridmon_process_numa_resident_bytes", (1 - fine) * mapped, (1 - off) * mapped,
                   instance, **LLAMA, node="1")
    test.expect_samples(60, process.GPU_NODE, (GPU0, 0), (GPU1, 1),
                        ({**GPU0, "instance": HOST2}, 0), ({**GPU1, "instance": HOST2}, 1))
    test.expect(not_yet(n.for_seconds), "InferenceProcessNumaMisplaced")
    test.expect(at, "InferenceProcessNumaMisplaced",
                test.alert(cpus_rule, {**process_label(VLLM), "gpu": "0"}, value=1, cpus=16, node=0),
                test.alert(memory_rule, {**process_label(LLAMA), "gpu": "1"},
                           value=1 - (1 - off) * mapped / mapped, mapped=mapped, node=1))
    return test


def _exact_enough(*seconds: float) -> bool:
    """humanizeDuration truncates to whole seconds: keep expected values off the boundaries."""
    return all(0.05 < s % 1 < 0.95 for s in seconds)


def memory_growth(t: Thresholds, catalog: Catalog) -> Test:
    """Every minute for min_window + 10 min; the window fills at min_window_seconds."""
    g = t.memory_growth
    rules = {r: catalog.find("InferenceProcessMemoryGrowth", resource=r)
             for r in ("gpu_memory", "resident", "locked")}
    at = int(g.min_window_seconds) + 300
    test = Test("memory growth: python3 (pid 4242) grows in GPU, resident and locked memory on a "
                "flat load; sglang (pid 6161) grows with its load but its faults per CPU second climb; "
                "llama-server (pid 5151) grows with its load and text-generation (pid 7171) jumps "
                "once: both stay silent", at + 300, catalog)
    test.interval = 60
    minutes = range(test.samples)
    per_hour = 2 * g.growth_per_hour_share       # twice the threshold, as a share of the start
    load_growth = 5 * g.load_flat_per_hour_share  # per hour, well past "flat"
    # Faults outgrow the load, so faults per CPU second rise (as the detector judges them).
    fault_growth = load_growth + 4 * g.growth_per_hour_share

    def linear(start: float, share_per_hour: float) -> list[float]:
        return [start * (1 + share_per_hour * m / 60) for m in minutes]

    def accumulated(rate: float, share_per_hour: float) -> list[float]:
        """A counter whose rate grows linearly: the integral of rate x (1 + share x t/h)."""
        return [rate * (m * 60 + share_per_hour * (m * 60) ** 2 / 7200) for m in minutes]

    starts = {"gpu_memory": 16 * GIB, "resident": 8 * GIB, "locked": 1 * GIB}
    extra = next(e for e in range(0, 10 ** 7, 4099) if _exact_enough(*(
        ((total + e) - starts[r] * (1 + per_hour * at / 3600)) / (starts[r] * per_hour / 3600)
        for r, total in (("gpu_memory", 24 * GIB), ("resident", 64 * GIB), ("locked", 64 * GIB)))))
    gpu_total, mem_total = 24 * GIB + extra, 64 * GIB + extra
    test.constant("hybridmon_memory_total_bytes", mem_total)
    test.constant("hybridmon_gpu_memory_total_bytes", gpu_total, **GPU0)
    on_gpu(test, GPU0, VLLM, linear(starts["gpu_memory"], per_hour))
    test.values("hybridmon_process_resident_bytes", linear(starts["resident"], per_hour), **VLLM)
    test.values("hybridmon_process_locked_bytes", linear(starts["locked"], per_hour), **VLLM)
    test.values("hybridmon_process_cpu_seconds_total", [2.0 * 60 * m for m in minutes], **VLLM)
    test.values("hybridmon_process_minor_faults_total", [100.0 * 60 * m for m in minutes], **VLLM)
    for proc, faults in ((SGLANG, fault_growth), (LLAMA, 0.0)):
        test.values("hybridmon_process_resident_bytes", linear(8 * GIB, per_hour), **proc)
        test.constant("hybridmon_process_locked_bytes", 0, **proc)
        test.values("hybridmon_process_cpu_seconds_total", accumulated(1.0, load_growth), **proc)
        test.values("hybridmon_process_minor_faults_total", accumulated(100.0, faults), **proc)
    # text-generation: one jump (an adapter loaded) on a flat load, then flat: not growth
    jump = int(g.min_window_seconds) // 60 - 5
    test.values("hybridmon_process_resident_bytes",
                [8 * GIB if m < jump else 12 * GIB for m in minutes], **TGI)
    test.constant("hybridmon_process_locked_bytes", 0, **TGI)
    test.values("hybridmon_process_cpu_seconds_total", [2.0 * 60 * m for m in minutes], **TGI)
    test.values("hybridmon_process_minor_faults_total", [100.0 * 60 * m for m in minutes], **TGI)
    for proc in (VLLM, SGLANG, LLAMA, TGI):
        test.constant("hybridmon_process_major_faults_total", 0, **proc)

    def expected(rule_name: str, proc: dict, start: float, total: float) -> dict:
        slope = start * per_hour / 3600
        current = start * (1 + per_hour * at / 3600)
        return test.alert(rules[rule_name], process_label(proc), value=slope, per_hour=slope * 3600,
                          current=current, exhaustion=(total - current) / slope)

    test.expect(int(g.min_window_seconds) - 300, "InferenceProcessMemoryGrowth")
    test.expect(at, "InferenceProcessMemoryGrowth",
                expected("gpu_memory", VLLM, starts["gpu_memory"], gpu_total),
                expected("resident", VLLM, starts["resident"], mem_total),
                expected("locked", VLLM, starts["locked"], mem_total),
                expected("resident", SGLANG, 8 * GIB, mem_total))
    return test


def memory_growth_against_server_load(t: Thresholds, catalog: Catalog) -> Test:
    """Where an inference server is tied to the process, its load is the one judged: python3 (pid
    4242) burns more CPU every hour but its vLLM server's tokens/s and running requests stay flat:
    it fires. llama-server (pid 5151) has a flat CPU but its server's tokens/s rise, and sglang
    (pid 6161) a flat CPU and tokens/s but more running requests: both silent."""
    g = t.memory_growth
    rule = catalog.find("InferenceProcessMemoryGrowth", resource="resident")
    at = int(g.min_window_seconds) + 300
    test = Test("memory growth against the inference server's load: tokens/s and running requests "
                "tied to the process by pid win over its CPU time", at + 300, catalog)
    test.interval = 60
    minutes = range(test.samples)
    per_hour, rising = 2 * g.growth_per_hour_share, 5 * g.load_flat_per_hour_share

    def accumulated(rate: float, share_per_hour: float) -> list[float]:
        return [rate * (m * 60 + share_per_hour * (m * 60) ** 2 / 7200) for m in minutes]

    def linear(start: float, share_per_hour: float) -> list[float]:
        return [start * (1 + share_per_hour * m / 60) for m in minutes]

    slope = 8 * GIB * per_hour / 3600
    current = 8 * GIB * (1 + per_hour * at / 3600)
    total = next(64 * GIB + e for e in range(0, 10 ** 7, 4099)
                 if _exact_enough((64 * GIB + e - current) / slope))
    test.constant("hybridmon_memory_total_bytes", total)
    servers = {VLLM["pid"]: ("vllm", 0.0, 0.0, rising), LLAMA["pid"]: ("llamacpp", rising, 0.0, 0.0),
               SGLANG["pid"]: ("sglang", 0.0, rising, 0.0)}
    for proc in (VLLM, LLAMA, SGLANG):
        server, tokens_growth, running_growth, cpu_growth = servers[proc["pid"]]
        labels = {"server": server, "endpoint": f"http://127.0.0.1:{proc['pid']}/metrics",
                  "model": "", "pid": proc["pid"]}
        test.values("hybridmon_process_resident_bytes", linear(8 * GIB, per_hour), **proc)
        test.values("hybridmon_process_cpu_seconds_total", accumulated(2.0, cpu_growth), **proc)
        # page faults in step with the CPU time: their rate per CPU second stays flat
        test.values("hybridmon_process_minor_faults_total", accumulated(200.0, cpu_growth), **proc)
        test.constant("hybridmon_process_major_faults_total", 0, **proc)
        test.values("hybridmon_inference_generated_tokens_total", accumulated(1000.0, tokens_growth), **labels)
        test.values("hybridmon_inference_requests_running", linear(8, running_growth), **labels)
    test.expect(at, "InferenceProcessMemoryGrowth", test.alert(
        rule, process_label(VLLM), value=slope, per_hour=slope * 3600, current=current,
        exhaustion=(total - current) / slope))
    return test


def files(t: Thresholds, catalog: Catalog) -> dict[str, list[Test]]:
    return {"process": [numa(t, catalog), memory_growth(t, catalog),
                        memory_growth_against_server_load(t, catalog)]}
