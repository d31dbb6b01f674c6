"""PCIe link state, AER error counters and presence of the NVIDIA GPUs, from sysfs and udev.

A GPU whose link trained down (Gen3 x8 instead of Gen4 x16) halves host<->device bandwidth, which
is what hybrid inference lives on; AER errors precede a GPU falling off the bus; and presence
going to 0 shows that fall even while NVML hangs.

Discovery lists the NVIDIA display-class functions (vendor 0x10de, class 0x03xxxx; the HDMI audio
function of the same card is class 0x04 and is left out) through pyudev on the live host, or by
walking <sysfs>/bus/pci/devices for any other root. It runs on the first collect(), every
REDISCOVERY_SECONDS, and at once when udev reports an NVIDIA event; it also resolves each GPU's
place in the PCIe tree (exporters/pcie_topology.py: the uplink it shares with other GPUs, the
narrowest link on its way to the CPU), which changes only when devices come or go. Every
nondeterministic input (the device list, the rediscovery decision, the udev event counts, the
resolved sysfs paths) goes through source.call, so a replayed trace makes the same reads in the
same order.
"""
from __future__ import annotations

import functools
import logging
import os
import re
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import pyudev

from pydantic import Field

from hybridmon.exporters import pcie_topology as topology
from hybridmon.exporters.base import (CollectorContext, CollectorRegistration, CollectorSettings, LogOnce,
                                      MetricSpec, NoDataError, ParseError, Samples, read_parsed)
from hybridmon.pcie_rates import theoretical_capacity

log = logging.getLogger(__name__)

NVIDIA_VENDOR_ID = 0x10DE
DISPLAY_CLASS = 0x03  # base class byte of "0x030200" (3D controller) and "0x030000" (VGA)
REDISCOVERY_SECONDS = 10.0
ALWAYS_EXPORTED_ACTIONS = ("add", "remove")

LINK_SPEED = MetricSpec(
    "hybridmon_pcie_link_speed_transfers_per_second",
    "Negotiated PCIe link speed per lane in transfers per second (sysfs current_link_speed, "
    "e.g. '16.0 GT/s PCIe' = 16e9); absent when the kernel reports it unknown.",
    "gauge", ("pci_bus_id",))
LINK_MAX_SPEED = MetricSpec(
    "hybridmon_pcie_link_max_speed_transfers_per_second",
    "Highest PCIe link speed the device supports, in transfers per second (sysfs max_link_speed).",
    "gauge", ("pci_bus_id",))
LINK_WIDTH = MetricSpec(
    "hybridmon_pcie_link_width_lanes",
    "Negotiated PCIe link width in lanes (sysfs current_link_width); absent when 0 (link down) "
    "or beyond x32.",
    "gauge", ("pci_bus_id",))
LINK_MAX_WIDTH = MetricSpec(
    "hybridmon_pcie_link_max_width_lanes",
    "Widest PCIe link the device supports, in lanes (sysfs max_link_width).",
    "gauge", ("pci_bus_id",))
LINK_GENERATION = MetricSpec(
    "hybridmon_pcie_link_generation",
    "PCIe generation of the negotiated link speed (2.5 GT/s = 1 ... 64 GT/s = 6), derived from "
    "sysfs current_link_speed.",
    "gauge", ("pci_bus_id",))
LINK_MAX_GENERATION = MetricSpec(
    "hybridmon_pcie_link_max_generation",
    "PCIe generation of the highest supported link speed, derived from sysfs max_link_speed.",
    "gauge", ("pci_bus_id",))
AER_ERRORS = MetricSpec(
    "hybridmon_pcie_aer_errors_total",
    "PCIe AER error messages sent by the device since boot, by severity (correctable|nonfatal|"
    "fatal), from the TOTAL_ERR_* line of sysfs aer_dev_correctable / aer_dev_nonfatal / "
    "aer_dev_fatal; absent when the kernel or device has no AER statistics.",
    "counter", ("pci_bus_id", "severity"))
DEVICE_NUMA_NODE = MetricSpec(
    "hybridmon_pcie_device_numa_node",
    "NUMA node the device is attached to (sysfs numa_node); absent when the kernel reports -1.",
    "gauge", ("pci_bus_id",))
DEVICE_PRESENT = MetricSpec(
    "hybridmon_pcie_device_present",
    "1 while the NVIDIA GPU function is on the PCI bus (sysfs/udev); 0 once a function seen "
    "earlier has disappeared, e.g. fallen off the bus.",
    "gauge", ("pci_bus_id",))
UDEV_EVENTS = MetricSpec(
    "hybridmon_pcie_udev_events_total",
    "Kernel uevents for NVIDIA PCI functions (PCI_ID 10DE:*) since the agent started, by action "
    "(add, remove, change, bind, unbind); from a pyudev netlink monitor, absent when netlink "
    "uevents cannot be received or the collector reads a sysfs other than the host's /sys.",
    "counter", ("action",))

AER_FILES = (("correctable", "aer_dev_correctable", "TOTAL_ERR_COR"),
             ("nonfatal", "aer_dev_nonfatal", "TOTAL_ERR_NONFATAL"),
             ("fatal", "aer_dev_fatal", "TOTAL_ERR_FATAL"))
# Keyed by tenths of GT/s so that float noise cannot miss a generation.
_GENERATION_BY_DECI_GTS = {25: 1, 50: 2, 80: 3, 160: 4, 320: 5, 640: 6, 1280: 7}
_SPEED = re.compile(r"([0-9]{1,4}(?:\.[0-9]{1,3})?) GT/s(?: PCIe)?")
_UNKNOWN_SPEEDS = frozenset({"Unknown", "Unknown speed", "Unknown Speed"})
_HEX_ID = re.compile(r"0x([0-9a-fA-F]{1,8})")
_INTEGER = re.compile(r"-?[0-9]{1,20}")
_AER_LINE = re.compile(r"(\S.*?)\s+([0-9]{1,20})")
_PCI_ID = re.compile(r"([0-9a-fA-F]{4}):[0-9a-fA-F]{4}")


def parse_link_speed(text: str) -> float | None:
    """current_link_speed / max_link_speed ("16.0 GT/s PCIe", older "8 GT/s") -> transfers/s.

    None for "Unknown" / "Unknown speed" (link down or a speed the kernel cannot name).
    """
    value = text.strip()
    if value in _UNKNOWN_SPEEDS:
        return None
    match = _SPEED.fullmatch(value)
    if not match:
        raise ParseError(f"not a PCIe link speed: {value[:40]!r}")
    transfers = float(match.group(1)) * 1e9
    return transfers if transfers > 0 else None


def parse_link_width(text: str) -> int | None:
    """current_link_width / max_link_width -> lanes; None for 0 (link down) or beyond x32
    (255 and 63 are what all-ones config reads of a dead device decode to)."""
    value = text.strip()
    if not _INTEGER.fullmatch(value):
        raise ParseError(f"not a PCIe link width: {value[:40]!r}")
    lanes = int(value)
    return lanes if 1 <= lanes <= 32 else None


def parse_hex_id(text: str) -> int:
    """sysfs vendor / device / class ("0x10de", "0x030200") -> integer."""
    match = _HEX_ID.fullmatch(text.strip())
    if not match:
        raise ParseError(f"not a 0x-prefixed hex id: {text.strip()[:40]!r}")
    return int(match.group(1), 16)


def parse_numa_node(text: str) -> int | None:
    """sysfs numa_node -> node number; None for -1 (no NUMA affinity known)."""
    value = text.strip()
    if not _INTEGER.fullmatch(value):
        raise ParseError(f"not a NUMA node number: {value[:40]!r}")
    node = int(value)
    return node if node >= 0 else None


def parse_aer_counters(text: str) -> dict[str, int]:
    """aer_dev_correctable / aer_dev_nonfatal / aer_dev_fatal -> {name: count}.

    Lines are "<name> <count>": "RxErr 3" (Linux 5.x+), "Receiver Error 3" (4.19),
    "dev_cor_errs_bit[1] 2" (a bit without a name), and last "TOTAL_ERR_COR 7".
    """
    counters: dict[str, int] = {}
    for line in text.splitlines():
        if not line.strip():
            continue
        match = _AER_LINE.fullmatch(line.strip())
        if not match:
            raise ParseError(f"not an AER counter line: {line[:60]!r}")
        counters[match.group(1)] = int(match.group(2))
    if not counters:
        raise ParseError("no AER counters in the file")
    return counters


def _total(aer_text: str, total_key: str) -> int:
    counters = parse_aer_counters(aer_text)
    if total_key not in counters:
        raise ParseError(f"no {total_key} line")
    return counters[total_key]


def link_generation(transfers_per_second: float | None) -> int | None:
    """PCIe generation of a per-lane speed: 2.5e9 -> 1, 5e9 -> 2, 8e9 -> 3 ... 64e9 -> 6."""
    if transfers_per_second is None:
        return None
    return _GENERATION_BY_DECI_GTS.get(round(transfers_per_second / 1e8))


def is_nvidia_pci_id(pci_id: str) -> bool:
    """The uevent PCI_ID property ("10DE:26B9") names an NVIDIA function."""
    match = _PCI_ID.fullmatch(pci_id.strip())
    return bool(match) and int(match.group(1), 16) == NVIDIA_VENDOR_ID


def is_nvidia_gpu_properties(properties: Mapping[str, str]) -> bool:
    """udev properties of an NVIDIA display-class function (PCI_CLASS "30200" = 0x030200)."""
    try:
        pci_class = int(properties.get("PCI_CLASS", ""), 16)
    except ValueError:
        return False
    return is_nvidia_pci_id(properties.get("PCI_ID", "")) and pci_class >> 16 == DISPLAY_CLASS


def list_nvidia_gpus_udev() -> list[str]:
    """Sysfs addresses ("0000:17:00.0") of the NVIDIA GPU functions libudev knows, sorted."""
    context = pyudev.Context()
    return sorted(device.sys_name for device in context.list_devices(subsystem="pci")
                  if is_nvidia_gpu_properties(device.properties))


@dataclass(frozen=True)
class _FixedAttributes:
    """A device's max_link_speed (transfers/s), max_link_width (lanes) and numa_node; None where
    unreadable."""

    max_speed: float | None
    max_width: int | None
    numa_node: int | None


class PcieCollector:
    name = "pcie"
    # Every 5 s, not every tick: what it reads changes by events, not by the second. The AER counts
    # are counters (PcieErrors judges 5 min of them); a link's trained speed and width, its
    # topology and its presence are states, judged over minutes (PcieLinkDegraded's 300 s) or at
    # once from the GPU collector's NVML reads every tick (GpuLost, whose bus view this is, fires
    # on the first reading that the function left). A tick's ~50 sysfs reads were 7 % of the
    # daemon's CPU on the 8-GPU host (issue 33, docs/performance.md).
    default_interval_seconds = 5.0
    metric_specs = (LINK_SPEED, LINK_MAX_SPEED, LINK_WIDTH, LINK_MAX_WIDTH, LINK_GENERATION,
                    LINK_MAX_GENERATION, AER_ERRORS, DEVICE_NUMA_NODE, DEVICE_PRESENT,
                    UDEV_EVENTS) + topology.METRIC_SPECS

    def __init__(self, source: Any, sysfs: str = "/sys", use_udev: bool | None = None,
                 monitor_events: bool = True, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._source = source
        self._sysfs = sysfs
        self._devices_dir = os.path.join(sysfs, "bus/pci/devices")
        self._on_host_sysfs = os.path.normpath(sysfs) == "/sys"
        self._use_udev = self._on_host_sysfs if use_udev is None else use_udev
        self._monitor_events = monitor_events
        self._clock = clock
        self._log_once = LogOnce(log)
        self._seen: list[str] = []          # every GPU function seen since start, in order
        self._present: set[str] = set()
        self._fixed_by_address: dict[str, _FixedAttributes] = {}  # until the next discovery
        self._paths: dict[str, tuple[str, ...]] = {}  # GPU -> root port ... GPU, at the last discovery
        self._uplinks: dict[str, topology.SharedUplink] = {}
        self._aer_seen: dict[tuple[str, str], tuple[str, int]] = {}  # (address, file) -> (text, total)
        self._discovered_at: float | None = None
        self._last_event_counts: dict[str, int] | None = None
        self._events_lock = threading.Lock()
        self._event_counts: dict[str, int] = {}
        self._observer: Any = None
        self._monitor_failed = False

    @property
    def udev_monitor_running(self) -> bool:
        return self._observer is not None and self._observer.is_alive()

    def collect(self) -> Samples:
        events = self._read_event_counts()
        due = self._source.call("pcie.rediscovery_due", lambda: self._rediscovery_due(events))
        self._last_event_counts = events
        if due:
            self._discover()
        if not self._seen:
            raise NoDataError(
                f"no NVIDIA GPU function (vendor 0x10de, class 0x03xxxx) under {self._devices_dir}")
        samples = Samples()
        links: dict[str, tuple[float | None, int | None]] = {}  # this collect's link reads, by function
        for address in self._seen:
            if address in self._present and self._still_there(address):
                self._add_device(samples, address, links)
            samples.add(DEVICE_PRESENT, 1 if address in self._present else 0, address)
        self._add_topology(samples, links)
        if events is not None:
            for action, count in sorted(events.items()):
                samples.add(UDEV_EVENTS, count, action)
        return samples

    def close(self) -> None:
        observer, self._observer = self._observer, None
        if observer is not None:
            observer.stop()

    # -- discovery ---------------------------------------------------------------------------

    def _rediscovery_due(self, events: dict[str, int] | None) -> bool:
        now = self._clock()
        due = (self._discovered_at is None or now - self._discovered_at >= REDISCOVERY_SECONDS
               or events != self._last_event_counts)
        if due:
            self._discovered_at = now
        return due

    def _discover(self) -> None:
        fetch = list_nvidia_gpus_udev if self._use_udev else self._list_nvidia_gpus_sysfs
        try:
            addresses = self._source.call("udev.nvidia_pci_functions", fetch)
        except Exception as error:  # pyudev, sysfs and replayed failures alike
            if not self._seen:
                raise NoDataError(f"cannot list the PCI devices: {error}") from error
            self._log_once("discovery", "pcie: cannot list NVIDIA PCI functions (%s: %s); "
                           "keeping the devices found before", type(error).__name__, error)
            return
        for address in sorted(set(self._present) - set(addresses)):
            log.warning("pcie: NVIDIA function %s is no longer on the PCI bus", address)
        self._present = set(addresses)
        self._fixed_by_address.clear()
        self._seen.extend(address for address in addresses if address not in self._seen)
        self._paths = {address: path for address in sorted(self._present)
                       if (path := self._device_path(address)) is not None}
        self._uplinks = topology.shared_uplinks(self._paths)

    def _device_path(self, address: str) -> tuple[str, ...] | None:
        """The function's chain from its root port down (pcie_topology.parse_device_path), or None
        with the reason logged once."""
        try:
            resolved = self._source.call(f"pcie.device_path:{address}",
                                         lambda: os.path.realpath(os.path.join(self._devices_dir, address)))
            return topology.parse_device_path(resolved)
        except Exception as error:  # a ParseError, or a replayed failure
            self._log_once(f"path:{address}", "pcie: cannot place %s in the PCIe tree (%s): its "
                           "uplink and narrowest-link series are absent", address, error)
            return None

    def _list_nvidia_gpus_sysfs(self) -> list[str]:
        found = []
        for address in self._source.list_dir(self._devices_dir):
            try:
                vendor = parse_hex_id(self._read(address, "vendor"))
                pci_class = parse_hex_id(self._read(address, "class"))
            except (OSError, ParseError) as error:
                self._log_once(f"identify:{address}", "pcie: cannot identify PCI device %s, "
                               "skipped: %s", address, error, level=logging.INFO)
                continue
            if vendor == NVIDIA_VENDOR_ID and pci_class >> 16 == DISPLAY_CLASS:
                found.append(address)
        return found

    def _still_there(self, address: str) -> bool:
        """Between discoveries, a vanished vendor file means the function left the bus."""
        try:
            self._read(address, "vendor")
        except FileNotFoundError:
            log.warning("pcie: NVIDIA function %s disappeared from %s", address, self._devices_dir)
            self._present.discard(address)
            return False
        except OSError:
            pass  # unreadable is not gone; the reads below say what is missing
        return True

    # -- per device --------------------------------------------------------------------------

    def _read(self, address: str, name: str) -> str:
        return self._source.read_text(os.path.join(self._devices_dir, address, name))

    def _parsed(self, address: str, name: str, parse: Callable[[str], Any], **options: Any) -> Any:
        return read_parsed(self._source, os.path.join(self._devices_dir, address, name), parse,
                           self._log_once, **options)

    def _fixed(self, address: str) -> "_FixedAttributes":
        """What the device's capabilities and firmware set, read at its discovery only: the
        fastest and widest link it supports and its NUMA node do not change while it is on the
        bus (rediscovery, every REDISCOVERY_SECONDS or on a udev event, reads them again)."""
        fixed = self._fixed_by_address.get(address)
        if fixed is None:
            fixed = self._fixed_by_address[address] = _FixedAttributes(
                self._parsed(address, "max_link_speed", parse_link_speed),
                self._parsed(address, "max_link_width", parse_link_width),
                self._parsed(address, "numa_node", parse_numa_node))
        return fixed

    def _link(self, address: str, links: dict[str, tuple[float | None, int | None]]) -> tuple[float | None, int | None]:
        """(transfers/s, lanes) of the link above the function, read once per collect: a switch
        port above two GPUs is on both their paths."""
        if address not in links:
            links[address] = (self._parsed(address, "current_link_speed", parse_link_speed),
                              self._parsed(address, "current_link_width", parse_link_width))
        return links[address]

    def _add_device(self, samples: Samples, address: str,
                    links: dict[str, tuple[float | None, int | None]]) -> None:
        fixed = self._fixed(address)
        speed, width = self._link(address, links)
        samples.add_many(((LINK_SPEED, speed), (LINK_MAX_SPEED, fixed.max_speed),
                          (LINK_GENERATION, link_generation(speed)),
                          (LINK_MAX_GENERATION, link_generation(fixed.max_speed)),
                          (LINK_WIDTH, width), (LINK_MAX_WIDTH, fixed.max_width),
                          (DEVICE_NUMA_NODE, fixed.numa_node)), address)
        for severity, name, total_key in AER_FILES:
            # One key for the three files: a device without AER lacks all of them.
            total = self._parsed(address, name, functools.partial(self._aer_total, address, name, total_key),
                                 log_key=f"{address}/aer", missing_is_normal=(
                                     "no AER statistics: a device without AER, or a kernel "
                                     "without CONFIG_PCIEAER"))
            samples.add(AER_ERRORS, total, address, severity)

    def _add_topology(self, samples: Samples, links: dict[str, tuple[float | None, int | None]]) -> None:
        """The shared uplinks of the GPUs on the bus and the narrowest link on each one's path."""
        for uplink in sorted({shared.port: shared for shared in self._uplinks.values()}.values(),
                             key=lambda shared: shared.port):
            fixed = self._fixed(uplink.port)
            speed, width = self._link(uplink.port, links)
            samples.add_many(((topology.UPLINK_GPUS, len(uplink.gpus)), (topology.UPLINK_SPEED, speed),
                              (topology.UPLINK_GENERATION, link_generation(speed)),
                              (topology.UPLINK_WIDTH, width), (topology.UPLINK_MAX_SPEED, fixed.max_speed),
                              (topology.UPLINK_MAX_WIDTH, fixed.max_width)), uplink.port)
        for gpu, uplink in sorted(self._uplinks.items()):
            if gpu in self._present:
                samples.add(topology.UPLINK_INFO, 1, gpu, uplink.port, uplink.root_port)
        for gpu, path in sorted(self._paths.items()):
            if gpu not in self._present:
                continue
            narrowest = self._narrowest(path, links)
            if narrowest is not None:
                port, speed, width = narrowest
                samples.add_many(((topology.NARROWEST_WIDTH, width), (topology.NARROWEST_SPEED, speed)), gpu, port)

    def _narrowest(self, path: tuple[str, ...], links: dict[str, tuple[float | None, int | None]]
                   ) -> tuple[str, float, int] | None:
        """(function below it, transfers/s, lanes) of the link with the fewest theoretical bytes/s
        on the path, nearest the CPU among equals; links of unknown state are left out."""
        best: tuple[float, str, float, int] | None = None
        for port in topology.link_ends(path):
            speed, width = self._link(port, links)
            generation = link_generation(speed)
            carries = theoretical_capacity(generation, width) if generation and width else None
            if carries is not None and (best is None or carries < best[0]):
                best = (carries, port, speed, width)
        return best[1:] if best else None

    def _aer_total(self, address: str, name: str, total_key: str, text: str) -> int:
        """_total of an AER file, parsed again only when its text changed: 24 files a tick on 8
        GPUs, each ~10 counter lines checked one by one, and they change only on an error."""
        known = self._aer_seen.get((address, name))
        if known is not None and known[0] == text:
            return known[1]
        total = _total(text, total_key)  # a ParseError is not kept: the next read tries again
        self._aer_seen[(address, name)] = (text, total)
        return total

    # -- udev events -------------------------------------------------------------------------

    def _read_event_counts(self) -> dict[str, int] | None:
        if not self._monitor_events:
            return None
        if not self._use_udev:
            why = ("udev is off for this collector" if self._on_host_sysfs else
                   f"sysfs is {self._sysfs}, and udev only describes the host's own /sys")
            self._log_once("udev_off", "pcie: kernel uevents are not watched (%s): "
                           "%s is absent, and GPUs that appear or "
                           "vanish are found by walking %s every %g s", why, UDEV_EVENTS.name, self._devices_dir,
                           REDISCOVERY_SECONDS, level=logging.INFO)
            return None
        try:
            return self._source.call("udev.event_counts", self._event_counts_live)
        except Exception as error:  # a replayed failure; live, the fetch itself does not raise
            self._log_once("event_counts", "pcie: no udev event counts: %s", error)
            return None

    def _event_counts_live(self) -> dict[str, int] | None:
        """Starts the monitor on first use; the counts, or None when no monitor runs."""
        if self._observer is None and not self._monitor_failed:
            self._start_monitor()
        if self._observer is None:
            return None
        if not self._observer.is_alive():
            self._log_once("observer_died", "pcie: the udev observer thread stopped; "
                           "%s is absent from now on", UDEV_EVENTS.name)
            return None
        with self._events_lock:
            return dict(self._event_counts)

    def _start_monitor(self) -> None:
        monitor = observer = None
        try:
            context = pyudev.Context()
            monitor = pyudev.Monitor.from_netlink(context, source="kernel")
            monitor.filter_by("pci")
            # Binds the netlink socket now, so that a refusal shows here and not in the thread.
            monitor.start()
            observer = pyudev.MonitorObserver(monitor, callback=self.handle_udev_event,
                                              name="hybridmon-pcie-udev")
            with self._events_lock:
                self._event_counts = {action: 0 for action in ALWAYS_EXPORTED_ACTIONS}
            observer.start()
        except Exception as error:
            self._monitor_failed = True
            # pyudev's Monitor has no close(): libudev closes the netlink socket when the monitor
            # is freed (Monitor.__del__ unrefs it). So no reference may outlive this call: not our
            # locals, and not the error, whose traceback holds this frame and those that built the
            # observer; logging the error object would keep them as long as the log record lives.
            monitor = observer = None
            reason = f"{type(error).__name__}: {error}"
            self._log_once("monitor", "pcie: cannot receive kernel uevents over netlink (%s), "
                           "so PCI hotplug events are not counted and "
                           "%s stays absent; in a container, run the "
                           "agent in the host network namespace", reason, UDEV_EVENTS.name)
            return
        self._observer = observer

    def handle_udev_event(self, device: Any) -> None:
        """Observer-thread callback: counts an event of an NVIDIA function by its action.

        Matches the PCI_ID property, since on remove the sysfs attributes are already gone.
        """
        try:
            action = device.action
            pci_id = device.properties.get("PCI_ID") or ""
            if not action or not is_nvidia_pci_id(pci_id):
                return
        except Exception:  # an exception here would end the observer thread
            log.debug("pcie: unreadable udev event ignored", exc_info=True)
            return
        with self._events_lock:
            self._event_counts[action] = self._event_counts.get(action, 0) + 1


class PcieSettings(CollectorSettings):
    """[pcie]: whether udev finds the GPUs' PCI functions and reports their add/remove events."""

    udev: bool = Field(default=True, description="discover devices and watch events through udev")


def _pcie_collector(context: CollectorContext) -> PcieCollector:
    settings: PcieSettings = context.settings
    return PcieCollector(context.source, sysfs=context.sysfs, use_udev=None if settings.udev else False,
                         monitor_events=settings.udev)


REGISTRATION = CollectorRegistration(PcieCollector, _pcie_collector, settings=PcieSettings)
