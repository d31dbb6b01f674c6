"""Inference-server rules: throughput decay, KV offload pressure, a failing scrape.

The agent's detectors (agent/detectors/throughput.py, inference.py) judge the same series the same
way: rates as PromQL's rate(), gauges as averages over the window, and the alerts carry server,
endpoint and model but not the pid, which changes on every restart of the server.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the schema is built from the families, which import these rules
    from hybridmon.agent.alerts.catalogue import Thresholds

from textwrap import dedent

from hybridmon.rules import pcie
from hybridmon.rules.model import Alert, Group, Recording
from hybridmon.rules.promql import duration, number, query
from hybridmon.rules.templates import humanize, humanize_percentage

TOKENS = "hybridmon_inference_generated_tokens_total"
RUNNING = "hybridmon_inference_requests_running"
SERVER = ("server", "endpoint", "model")
KV_USAGE = "server:hybridmon_inference_kv_cache_usage_ratio:avg1m"
PREEMPTIONS = "server:hybridmon_inference_preemptions:rate1m"
OFFLOAD_LOADS = "server:hybridmon_inference_kv_offload_load_bytes:rate1m"
PROCESS_CAPACITY = "process:hybridmon_gpu_pcie_host_to_device_capacity_bytes_per_second:sum"
INSTANCE_CAPACITY = "instance:hybridmon_gpu_pcie_host_to_device_capacity_bytes_per_second:sum"
SERVER_CAPACITY = "server:hybridmon_gpu_pcie_host_to_device_capacity_bytes_per_second:sum"
SERVER_NAME = "<server><if model> (model <model>)<else><end> at <endpoint>"


def _suffix(seconds: float, offset: float = 0) -> str:
    return duration(seconds) + (f"_offset{duration(offset)}" if offset else "")


def per_request(seconds: float, offset: float = 0) -> str:
    return f"server:hybridmon_inference_generated_tokens_per_running_request:rate{_suffix(seconds, offset)}"


def running(seconds: float, offset: float = 0) -> str:
    return f"server:hybridmon_inference_requests_running:avg{_suffix(seconds, offset)}"


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
    capacity = f'{pcie.CAPACITY}{{direction="host_to_device"}}'
    rules += [
        Recording(KV_USAGE, "avg_over_time(hybridmon_inference_kv_cache_usage_ratio[1m])"),
        Recording(PREEMPTIONS, "rate(hybridmon_inference_preemptions_total[1m])"),
        Recording(OFFLOAD_LOADS, 'sum without (direction) (rate(hybridmon_inference_kv_offload_bytes_total{direction="load"}[1m]))'),
        Recording(PROCESS_CAPACITY,
                  "# host->device bytes/s of the GPUs each process holds memory on\n"
                  "sum by (job, instance, pid) (\n"
                  f"    {capacity}\n"
                  "  * on (job, instance, gpu, uuid) group_right ()\n"
                  "    max without (process_name) (hybridmon_gpu_process_memory_used_bytes * 0 + 1)\n"
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


def _server(template: str, metric: str) -> tuple[str, tuple[str, ...]]:
    return query(template, metric, *SERVER)


def throughput_decay(t: Thresholds) -> Alert:
    d = t.throughput_decay
    offset = d.baseline_offset_seconds
    recent, baseline = per_request(d.recent_seconds), per_request(d.baseline_seconds, offset)
    since = f"{duration(d.window_seconds)} to {duration(offset)} ago"
    return Alert(
        "InferenceThroughputDecay",
        dedent(f"""\
            max without (pid) (
              # the share generation per running request lost against the baseline...
                1 - {recent} / {baseline} >= {number(d.decay_share)}
              # ...while the load did not fall
              and
                {running(d.recent_seconds)} >= {number(d.load_kept_share)} * {running(d.baseline_seconds, offset)}
            )"""),
        d.for_seconds, "warning",
        f"{SERVER_NAME} on <instance>: generation per running request fell <value|humanizePercentage>",
        f"{SERVER_NAME} generated <after|humanize> tokens/s per running request over the last "
        f"{duration(d.recent_seconds)} against <before|humanize> over {duration(d.baseline_seconds)} "
        f"from {since}: <value|humanizePercentage> slower (threshold {humanize_percentage(d.decay_share)}), "
        f"while it ran <running_now|humanize> requests on average (<running_then|humanize> then; its "
        f"load must not have fallen below {humanize_percentage(d.load_kept_share)} of that). Users wait "
        "longer for every answer without any error. A host that decays over hours is usually paging "
        "(KV cache or weights pushed to swap), leaking memory or moving more over PCIe for the same "
        f"work: compare process memory and swap, major faults, PCIe traffic, GPU memory and memory "
        f"pressure over the last {duration(d.window_seconds)}; the agent's own finding names the ones "
        "that moved.",
        queries={
            "after": _server("max without (pid) ({})", recent),
            "before": _server("max without (pid) ({})", baseline),
            "running_now": _server("max without (pid) ({})", running(d.recent_seconds)),
            "running_then": _server("max without (pid) ({})", running(d.baseline_seconds, offset)),
        },
    )


def kv_offload_pressure(t: Thresholds) -> list[Alert]:
    k = t.kv_offload_pressure
    return [
        Alert(
            "InferenceKvOffloadPressure",
            dedent(f"""\
                max without (pid) (
                  {KV_USAGE} >= {number(k.kv_cache_usage_at_least)}
                  and
                  {PREEMPTIONS} > {number(k.preemptions_per_second_above)}
                )"""),
            k.for_seconds, "warning",
            f"{SERVER_NAME} on <instance>: KV cache <value|humanizePercentage> full while requests "
            "are preempted",
            f"{SERVER_NAME} has its GPU KV cache <value|humanizePercentage> full (1 min average; "
            f"threshold {humanize_percentage(k.kv_cache_usage_at_least)}) and preempts "
            "<preemptions|humanize> requests per second (threshold: more than "
            f"{humanize(k.preemptions_per_second_above)}). A preempted request loses its KV blocks "
            "and is recomputed or reloaded: its tokens stop and its latency jumps. Lower the "
            "concurrency or context limits, give the KV cache more VRAM or add a host-memory "
            "offload tier.",
            labels={"reason": "kv_cache_full"},
            queries={"preemptions": _server("max without (pid) ({})", PREEMPTIONS)},
        ),
        Alert(
            "InferenceKvOffloadPressure",
            f"max without (pid) (\n  {OFFLOAD_LOADS} / {SERVER_CAPACITY}\n"
            f"    >= {number(k.offload_load_share_of_capacity)}\n)",
            k.for_seconds, "warning",
            f"{SERVER_NAME} on <instance>: KV offload loads fill <value|humanizePercentage> of the "
            "host-to-device link",
            f"{SERVER_NAME} loads <loads|humanize>B/s of offloaded KV cache from host memory into "
            "the GPU (1 min rate): <value|humanizePercentage> of the <capacity|humanize>B/s "
            "host-to-device capacity of the GPUs its process uses (every GPU of the host when the "
            "server is tied to no process; capacity as hybridmon bench measured it, else the "
            f"link's theoretical rate; threshold {humanize_percentage(k.offload_load_share_of_capacity)}). "
            "The loads alone fill the link: requests whose blocks were offloaded wait for the copy. "
            "Keep the hot blocks in VRAM and check the link runs at its full generation and width.",
            labels={"reason": "offload_link"},
            queries={"loads": _server("max without (pid) ({})", OFFLOAD_LOADS),
                     "capacity": _server("max without (pid) ({})", SERVER_CAPACITY)},
        ),
    ]


def scrape_failing(t: Thresholds) -> Alert:
    wait = duration(t.inference_scrape.for_seconds)
    return Alert(
        "InferenceServerScrapeFailing",
        "hybridmon_inference_scrape_error > 0",
        t.inference_scrape.for_seconds, "warning",
        "Inference server at <endpoint> on <instance> cannot be read: <reason>",
        f"Every scrape of the inference server at <endpoint> failed with reason <reason> for {wait} "
        f"(threshold: {wait}): timeout, refused, connection, http_status, too_large, not_prometheus "
        "(an HTML page), not_json, unknown_server or missing_families (its metric names changed). "
        "The server is down or failing, or its metrics are: its tokens/s, latency and KV cache "
        "figures are missing until it answers. The runbook has the first check for each reason.",
    )


def groups(t: Thresholds) -> list[Group]:
    return [Group("hybridmon-inference", (*recordings(t), throughput_decay(t),
                                          *kv_offload_pressure(t), scrape_failing(t)))]

