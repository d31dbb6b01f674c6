"""The recording rules of the inference group: per-request generation rates over the recent and
baseline windows, KV-cache usage, preemptions and offload loads, and the host->device capacity of
each server's GPUs. The alerts that read them are agent/alerts/throughput_decay.py,
kv_offload_pressure.py and inference_scrape.py, which judge the same series the same
way: rates as PromQL's rate(), gauges as averages over the window, and the alerts carry server,
endpoint and model but not the pid, which changes on every restart of the server.
"""
from __future__ import annotations

from textwrap import dedent

from hybridmon.exporters.gpu import PROCESS_MEMORY_USED
from hybridmon.exporters.inference_names import BY_FIELD, OFFLOAD_BYTES
from hybridmon.rules import pcie
from hybridmon.rules.model import Recording, Thresholds
from hybridmon.rules.promql import duration, number, rate_name

TOKENS = BY_FIELD["generated_tokens"].name
RUNNING = BY_FIELD["requests_running"].name
SERVER = ("server", "endpoint", "model")
KV_USAGE = f"server:{BY_FIELD['kv_cache_usage_ratio'].name}:avg1m"
PREEMPTIONS = f"server:{rate_name(BY_FIELD['preemptions'].name)}:rate1m"
# The share of requests preempted (issue 31: the seeds' H10, 17.5 % single-tier, 8.5 % tiered):
# preemptions over requests finished, over 5 min so that a few requests a minute still give a share.
PREEMPTED_SHARE = "server:hybridmon_inference_requests_preempted:ratio_rate5m"
OFFLOAD_LOADS = "server:hybridmon_inference_kv_offload_load_bytes:rate1m"
# Per GPU, the host->device capacity of the link its offloaded KV crosses.
OFFLOAD_CAPACITY = "gpu:hybridmon_gpu_host_to_device_offload_capacity_bytes_per_second:effective"
PROCESS_CAPACITY = "process:hybridmon_gpu_pcie_host_to_device_capacity_bytes_per_second:sum"
INSTANCE_CAPACITY = "instance:hybridmon_gpu_pcie_host_to_device_capacity_bytes_per_second:sum"
SERVER_CAPACITY = "server:hybridmon_gpu_pcie_host_to_device_capacity_bytes_per_second:sum"
SERVER_NAME = "<server><if model> (model <model>)<else><end> at <endpoint>"


def _suffix(seconds: float, offset: float = 0) -> str:
    return duration(seconds) + (f"_offset{duration(offset)}" if offset else "")


def per_request(seconds: float, offset: float = 0) -> str:
    return f"server:hybridmon_inference_generated_tokens_per_running_request:rate{_suffix(seconds, offset)}"


def running(seconds: float, offset: float = 0) -> str:
    return f"server:{RUNNING}:avg{_suffix(seconds, offset)}"


def _range(seconds: float, offset: float = 0) -> str:
    return f"[{duration(seconds)}]" + (f" offset {duration(offset)}" if offset else "")


def recordings(t: Thresholds) -> tuple[Recording, ...]:
    d = t.throughput_decay
    windows = ((d.recent_seconds, 0.0), (d.baseline_seconds, d.baseline_offset_seconds))
    rules = []
    for seconds, offset in windows:
        rules.append(Recording(running(seconds, offset), f"avg_over_time({RUNNING}{_range(seconds, offset)})"))
        rules.append(Recording(
            per_request(seconds, offset),
            "# generation tokens/s per running request, servers running at least min_requests_running\n"
            f"rate({TOKENS}{_range(seconds, offset)})\n"
            f"/ ({running(seconds, offset)} >= {number(d.min_requests_running)})"))
    capacity = OFFLOAD_CAPACITY
    rules += [
        Recording(KV_USAGE, f"avg_over_time({BY_FIELD['kv_cache_usage_ratio'].name}[1m])"),
        Recording(PREEMPTIONS, f"rate({BY_FIELD['preemptions'].name}[1m])"),
        Recording(PREEMPTED_SHARE, f"rate({BY_FIELD['preemptions'].name}[5m])\n"
                                   f"/ (rate({BY_FIELD['requests_finished'].name}[5m]) > 0)"),
        Recording(OFFLOAD_LOADS,
                  f'sum without (direction) (rate({OFFLOAD_BYTES.name}{{direction="load"}}[1m]))'),
        Recording(OFFLOAD_CAPACITY,
                  "# NVLink-C2C's host->device capacity for a GPU in C2C mode (GH200, GB200; issue 29)...\n"
                  f'{pcie.C2C_CAPACITY}{{direction="host_to_device"}}\nand on (job, instance, gpu, uuid)\n'
                  f"{pcie.C2C_ON}\n# ...else its PCIe link's\nor\n"
                  f'{pcie.CAPACITY}{{direction="host_to_device"}}\nunless on (job, instance, gpu, uuid)\n'
                  f"{pcie.C2C_ON}"),
        Recording(PROCESS_CAPACITY,
                  "# host->device bytes/s of the GPUs each process holds memory on\n"
                  "sum by (job, instance, pid) (\n"
                  f"    {capacity}\n"
                  "  * on (job, instance, gpu, uuid) group_right ()\n"
                  f"    max without (process_name) ({PROCESS_MEMORY_USED.name} * 0 + 1)\n"
                  ")"),
        Recording(INSTANCE_CAPACITY, f"sum by (job, instance) ({capacity})"),
        Recording(SERVER_CAPACITY, dedent(f"""\
            # the GPUs the server's process holds memory on...
            {OFFLOAD_LOADS} * 0 + on (job, instance, pid) group_left () {PROCESS_CAPACITY}
            # ...else, tied to no process or its process on no GPU, every GPU of the host
            or
            {OFFLOAD_LOADS} * 0 + on (job, instance) group_left () {INSTANCE_CAPACITY}""")),
    ]
    return tuple(rules)


