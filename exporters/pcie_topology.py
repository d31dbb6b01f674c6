"""Where each NVIDIA GPU hangs in the PCIe tree: the link it shares with other GPUs on the way to
the CPU, and the narrowest link on its path (issue 29).

Dense servers put two to four GPUs behind one PCIe switch whose uplink to the CPU's root port is
a single x16 link; every GPU can then be well inside its own link while their sum fills the
uplink (nvbandwidth users report 5-6 GB/s per GPU when all copy at once, nvbandwidth issue 11).
Judging each GPU against its own link alone cannot see that.

The tree is the kernel's: /sys/bus/pci/devices/<bdf> links to the function's place under its host
bridge, /sys/devices/pci<domain>:<bus>/<root port>/<switch upstream port>/<switch downstream port>/
<gpu> (Documentation/ABI/testing/sysfs-bus-pci; every bridge on the way is a directory of its
own). current_link_speed / current_link_width come from the function's Link Status register
(drivers/pci/pci-sysfs.c), which describes the link on the function's own port: for an endpoint or
a switch upstream port the link above it, for a root port or a switch downstream port the link
below it. Below a root port the kinds alternate (upstream port or endpoint, downstream port, ...),
and between a switch's upstream and downstream ports there is only the switch's internal bus, so
the links of a path are those above the functions at odd depths (LINK_ENDS), each read at that
function: "the port below the link". The PcieCollector (exporters/pcie.py) discovers the GPUs, resolves their paths through its source at
each discovery, and emits the series below; this module holds the pure parts.
"""
from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from typing import Mapping

from hybridmon.exporters.base import MetricSpec, ParseError

UPLINK_INFO = MetricSpec(
    "hybridmon_pcie_uplink_info",
    "1 for each NVIDIA GPU function (pci_bus_id) behind a PCIe link it shares with other GPUs on "
    "the way to the CPU: the link above the highest switch port that more than one GPU's sysfs "
    "path goes through (uplink: the address of that port, the switch upstream port below the "
    "shared link; root_port: the CPU's root port above it). Absent for a GPU with a link of its "
    "own up to its root port. Join on pci_bus_id with hybridmon_gpu_info to sum GPU traffic per "
    "uplink.",
    "gauge", ("pci_bus_id", "uplink", "root_port"))
UPLINK_GPUS = MetricSpec(
    "hybridmon_pcie_uplink_gpus",
    "NVIDIA GPU functions behind the shared PCIe link whose lower end is the port `uplink` (2 or "
    "more).",
    "gauge", ("uplink",))
UPLINK_SPEED = MetricSpec(
    "hybridmon_pcie_uplink_speed_transfers_per_second",
    "Negotiated per-lane speed of a shared PCIe uplink in transfers per second (sysfs "
    "current_link_speed of the port below it); absent when the kernel reports it unknown.",
    "gauge", ("uplink",))
UPLINK_GENERATION = MetricSpec(
    "hybridmon_pcie_uplink_generation",
    "PCIe generation of a shared uplink's negotiated speed (2.5 GT/s = 1 ... 64 GT/s = 6).",
    "gauge", ("uplink",))
UPLINK_WIDTH = MetricSpec(
    "hybridmon_pcie_uplink_width_lanes",
    "Negotiated width of a shared PCIe uplink in lanes (sysfs current_link_width of the port "
    "below it); absent when 0 (link down).",
    "gauge", ("uplink",))
UPLINK_MAX_SPEED = MetricSpec(
    "hybridmon_pcie_uplink_max_speed_transfers_per_second",
    "Highest per-lane speed the port below a shared uplink supports, in transfers per second "
    "(sysfs max_link_speed).",
    "gauge", ("uplink",))
UPLINK_MAX_WIDTH = MetricSpec(
    "hybridmon_pcie_uplink_max_width_lanes",
    "Widest link the port below a shared uplink supports, in lanes (sysfs max_link_width).",
    "gauge", ("uplink",))
NARROWEST_WIDTH = MetricSpec(
    "hybridmon_pcie_path_narrowest_link_width_lanes",
    "Width in lanes of the link with the lowest theoretical bytes/s (negotiated speed x width) on "
    "the path from the GPU function (pci_bus_id) to its root port; port: the function below that "
    "link (the GPU itself when its own link is the narrowest). Ties go to the link nearest the CPU.",
    "gauge", ("pci_bus_id", "port"))
NARROWEST_SPEED = MetricSpec(
    "hybridmon_pcie_path_narrowest_link_speed_transfers_per_second",
    "Negotiated per-lane speed in transfers per second of the narrowest link on the GPU's path "
    "to its root port (see hybridmon_pcie_path_narrowest_link_width_lanes).",
    "gauge", ("pci_bus_id", "port"))

METRIC_SPECS = (UPLINK_INFO, UPLINK_GPUS, UPLINK_SPEED, UPLINK_GENERATION, UPLINK_WIDTH, UPLINK_MAX_SPEED,
                UPLINK_MAX_WIDTH, NARROWEST_WIDTH, NARROWEST_SPEED)

# A host bridge's directory: "pci0000:00"; Hyper-V's synthetic PCI domains run to 8 hex digits.
_HOST_BRIDGE = re.compile(r"pci[0-9a-f]{4,8}:[0-9a-f]{2}")
_FUNCTION = re.compile(r"[0-9a-f]{4,8}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]")


def parse_device_path(text: str) -> tuple[str, ...]:
    """A PCI function's resolved sysfs path (".../devices/pci0000:00/0000:00:01.0/0000:01:00.0/
    0000:02:08.0/0000:03:00.0") -> the functions from the one under the host bridge (the root
    port, or the device itself in a VM that puts it on the host bridge) down to it. What comes
    before the host bridge (/sys/devices, a test root, a VMBus device) is dropped; ParseError
    when there is no host bridge or anything after it is not a PCI function address."""
    parts = text.strip().lower().split("/")
    bridges = [position for position, part in enumerate(parts) if _HOST_BRIDGE.fullmatch(part)]
    if not bridges:
        raise ParseError(f"no PCI host bridge (pciDDDD:BB) in {text.strip()[:120]!r}")
    below = tuple(part for part in parts[bridges[-1] + 1:] if part)
    if not below or not all(_FUNCTION.fullmatch(part) for part in below):
        raise ParseError(f"not a chain of PCI function addresses below the host bridge: {text.strip()[:120]!r}")
    return below


@dataclass(frozen=True)
class SharedUplink:
    """A link that several GPUs reach the CPU through: `port` is the function below it (a switch
    upstream port), `root_port` the function above it."""

    port: str
    root_port: str
    gpus: tuple[str, ...]


def shared_uplinks(paths: Mapping[str, tuple[str, ...]]) -> dict[str, SharedUplink]:
    """GPU address -> the link it shares with other GPUs nearest the CPU, for each GPU that has
    one; `paths` are parse_device_path's chains, root port first, the GPU last.

    The link above a function is shared when more than one GPU's path goes through that function.
    Nearer the CPU a function has as many GPUs below it or more, so the first shared link end
    below the root port is the highest one: its link carries the most GPUs' traffic at once. A
    root port itself is never below a link: above it is the CPU's own fabric."""
    behind = Counter(function for path in paths.values() for function in set(link_ends(path)))
    found: dict[str, SharedUplink] = {}
    for gpu, path in paths.items():
        port = next((function for function in link_ends(path) if behind[function] >= 2), None)
        if port is not None:
            gpus = tuple(sorted(other for other, chain in paths.items() if port in link_ends(chain)))
            found[gpu] = SharedUplink(port, path[0], gpus)
    return found


def link_ends(path: tuple[str, ...]) -> tuple[str, ...]:
    """The functions below the physical links of a path (root port first), nearest the CPU
    first: those at odd depths, a switch upstream port or the endpoint. A downstream port's Link
    Status repeats the link below it, so it is not one of them."""
    return path[1::2]
