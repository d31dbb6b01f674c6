import ctypes
import errno
import gc
import logging
import os
import shutil
import socket
import time
import weakref
from pathlib import Path

import pyudev
import pytest

from hybridmon.exporters.sources import LiveSource, RecordingSource, ReplaySource
from hybridmon.exporters import pcie
from hybridmon.exporters.base import NoDataError, ParseError
from hybridmon.exporters.pcie import (
    PcieCollector,
    is_nvidia_gpu_properties,
    is_nvidia_pci_id,
    link_generation,
    list_nvidia_gpus_udev,
    parse_aer_counters,
    parse_hex_id,
    parse_link_speed,
    parse_link_width,
    parse_numa_node,
)
from tests.support.aer_texts import OLD_KERNEL_AER, UNNAMED_BIT_AER
from tests.support.paths import FIXTURE_HOST
from tests.support.parser_properties import ParserRow, read

GPU0, AUDIO0, GPU1, HOST_BRIDGE = "0000:17:00.0", "0000:17:00.1", "0000:ca:00.0", "0000:00:00.0"
DEVICES = FIXTURE_HOST / "sys" / "bus" / "pci" / "devices"

EXPECTED_FIXTURE_SAMPLES = {
    ("hybridmon_pcie_link_speed_transfers_per_second", (GPU0,)): 16e9,
    ("hybridmon_pcie_link_max_speed_transfers_per_second", (GPU0,)): 16e9,
    ("hybridmon_pcie_link_generation", (GPU0,)): 4,
    ("hybridmon_pcie_link_max_generation", (GPU0,)): 4,
    ("hybridmon_pcie_link_width_lanes", (GPU0,)): 16,
    ("hybridmon_pcie_link_max_width_lanes", (GPU0,)): 16,
    ("hybridmon_pcie_device_numa_node", (GPU0,)): 0,
    ("hybridmon_pcie_aer_errors_total", (GPU0, "correctable")): 7,
    ("hybridmon_pcie_aer_errors_total", (GPU0, "nonfatal")): 1,
    ("hybridmon_pcie_aer_errors_total", (GPU0, "fatal")): 0,
    ("hybridmon_pcie_device_present", (GPU0,)): 1,
    ("hybridmon_pcie_link_speed_transfers_per_second", (GPU1,)): 8e9,
    ("hybridmon_pcie_link_max_speed_transfers_per_second", (GPU1,)): 16e9,
    ("hybridmon_pcie_link_generation", (GPU1,)): 3,
    ("hybridmon_pcie_link_max_generation", (GPU1,)): 4,
    ("hybridmon_pcie_link_width_lanes", (GPU1,)): 8,
    ("hybridmon_pcie_link_max_width_lanes", (GPU1,)): 16,
    ("hybridmon_pcie_device_numa_node", (GPU1,)): 1,
    ("hybridmon_pcie_device_present", (GPU1,)): 1,
    # each GPU alone on its root port: its own link is the only one on its path, and no uplink is
    # shared (tests/exporters/test_pcie_topology.py has a switch)
    ("hybridmon_pcie_path_narrowest_link_width_lanes", (GPU0, GPU0)): 16,
    ("hybridmon_pcie_path_narrowest_link_speed_transfers_per_second", (GPU0, GPU0)): 16e9,
    ("hybridmon_pcie_path_narrowest_link_width_lanes", (GPU1, GPU1)): 8,
    ("hybridmon_pcie_path_narrowest_link_speed_transfers_per_second", (GPU1, GPU1)): 8e9,
}



class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class FakeUdevDevice:
    """What pyudev hands the observer callback: an action and the uevent properties."""

    def __init__(self, action, pci_id=None, pci_class="30200"):
        self.action = action
        self.properties = {"SUBSYSTEM": "pci"}
        if pci_id is not None:
            self.properties.update(PCI_ID=pci_id, PCI_CLASS=pci_class)


def as_dict(samples):
    return {(s.spec.name, s.label_values): s.value for s in samples}


def fixture_copy(tmp_path: Path) -> Path:
    sysfs = tmp_path / "sys"
    shutil.copytree(FIXTURE_HOST / "sys", sysfs, symlinks=True)
    return sysfs


def device_dir(sysfs: Path, address: str) -> Path:
    return (sysfs / "bus" / "pci" / "devices" / address).resolve()


def netlink_uevents_permitted() -> bool:
    """The same bind libudev makes for a kernel-source monitor, done independently."""
    try:
        netlink_kobject_uevent = 15
        with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, netlink_kobject_uevent) as sock:
            sock.bind((0, 1))
    except OSError:
        return False
    return True


# -- parsers -------------------------------------------------------------------------------------

def test_parse_link_speed_fixture_files():
    assert parse_link_speed((DEVICES / GPU0 / "current_link_speed").read_text()) == 16e9
    assert parse_link_speed((DEVICES / GPU1 / "current_link_speed").read_text()) == 8e9
    assert parse_link_speed((DEVICES / GPU1 / "max_link_speed").read_text()) == 16e9


@pytest.mark.parametrize("text, transfers", [
    ("2.5 GT/s PCIe\n", 2.5e9), ("5.0 GT/s PCIe\n", 5e9), ("8.0 GT/s PCIe\n", 8e9),
    ("16.0 GT/s PCIe\n", 16e9), ("32.0 GT/s PCIe\n", 32e9), ("64.0 GT/s PCIe\n", 64e9),
    ("2.5 GT/s\n", 2.5e9), ("5 GT/s\n", 5e9), ("8 GT/s\n", 8e9), ("16 GT/s\n", 16e9),
    ("Unknown speed\n", None), ("Unknown\n", None),
])
def test_parse_link_speed_every_kernel_spelling(text, transfers):
    assert parse_link_speed(text) == transfers


@pytest.mark.parametrize("text", ["", "fast\n", "16.0 GB/s\n", "16,0 GT/s PCIe", "GT/s",
                                  "١٦ GT/s"])
def test_parse_link_speed_rejects_garbage(text):
    with pytest.raises(ParseError):
        parse_link_speed(text)


@pytest.mark.parametrize("text, lanes", [("16\n", 16), ("8\n", 8), ("1", 1), ("32", 32),
                                         ("0\n", None), ("255\n", None), ("63", None)])
def test_parse_link_width(text, lanes):
    assert parse_link_width(text) == lanes


@pytest.mark.parametrize("text", ["", "x16", "16 lanes", "1_6", "-"])
def test_parse_link_width_rejects_garbage(text):
    with pytest.raises(ParseError):
        parse_link_width(text)


def test_parse_hex_id_fixture_files():
    assert parse_hex_id((DEVICES / GPU0 / "vendor").read_text()) == 0x10DE
    assert parse_hex_id((DEVICES / GPU0 / "device").read_text()) == 0x26B9
    assert parse_hex_id((DEVICES / GPU0 / "class").read_text()) == 0x030200
    assert parse_hex_id((DEVICES / AUDIO0 / "class").read_text()) == 0x040300
    assert parse_hex_id((DEVICES / HOST_BRIDGE / "vendor").read_text()) == 0x8086
    for text in ("", "10de", "0x", "0xzz", "0x10de 0x10de"):
        with pytest.raises(ParseError):
            parse_hex_id(text)


def test_parse_numa_node():
    assert parse_numa_node((DEVICES / GPU1 / "numa_node").read_text()) == 1
    assert parse_numa_node("0\n") == 0
    assert parse_numa_node("-1\n") is None
    with pytest.raises(ParseError):
        parse_numa_node("node1")


def test_parse_aer_counters_fixture_files():
    assert parse_aer_counters((DEVICES / GPU0 / "aer_dev_correctable").read_text()) == {
        "RxErr": 3, "BadTLP": 2, "BadDLLP": 2, "Rollover": 0, "Timeout": 0, "NonFatalErr": 0,
        "CorrIntErr": 0, "HeaderOF": 0, "TOTAL_ERR_COR": 7,
    }
    nonfatal = parse_aer_counters((DEVICES / GPU0 / "aer_dev_nonfatal").read_text())
    assert len(nonfatal) == 19
    assert nonfatal["UnsupReq"] == 1 and nonfatal["TOTAL_ERR_NONFATAL"] == 1
    assert sum(nonfatal.values()) == 2
    fatal = parse_aer_counters((DEVICES / GPU0 / "aer_dev_fatal").read_text())
    assert fatal["TOTAL_ERR_FATAL"] == 0 and set(fatal.values()) == {0}


def test_parse_aer_counters_other_kernels():
    old = parse_aer_counters(OLD_KERNEL_AER)
    assert old["Receiver Error"] == 2 and old["RELAY_NUM Rollover"] == 0
    assert old["TOTAL_ERR_COR"] == 2 and len(old) == 9
    assert parse_aer_counters(UNNAMED_BIT_AER) == {
        "Undefined": 0, "DLP": 0, "dev_fatal_errs_bit[27]": 1, "TOTAL_ERR_FATAL": 1}


@pytest.mark.parametrize("text", ["", "\n\n", "RxErr\n", "RxErr three\n", "7\n", "RxErr -1\n"])
def test_parse_aer_counters_rejects_garbage(text):
    with pytest.raises(ParseError):
        parse_aer_counters(text)


def test_link_generation():
    assert [link_generation(g * 1e9) for g in (2.5, 5, 8, 16, 32, 64)] == [1, 2, 3, 4, 5, 6]
    assert link_generation(None) is None
    assert link_generation(10e9) is None


def test_nvidia_matching_on_udev_properties():
    assert is_nvidia_pci_id("10DE:26B9") and is_nvidia_pci_id("10de:2236")
    assert not any(is_nvidia_pci_id(text) for text in ("1AF4:1041", "", "10DE", "10DE:26B9:0"))
    assert is_nvidia_gpu_properties({"PCI_ID": "10DE:26B9", "PCI_CLASS": "30200"})  # 3D controller
    assert is_nvidia_gpu_properties({"PCI_ID": "10DE:2684", "PCI_CLASS": "30000"})  # VGA
    assert not is_nvidia_gpu_properties({"PCI_ID": "10DE:22BA", "PCI_CLASS": "40300"})  # audio
    assert not is_nvidia_gpu_properties({"PCI_ID": "8086:09A2", "PCI_CLASS": "60000"})
    assert not is_nvidia_gpu_properties({"PCI_ID": "10DE:26B9"})


# -- collector on the fixture tree -----------------------------------------------------------------

def test_collector_on_fixture_tree(fixture_sysfs, live_source):
    collector = PcieCollector(live_source, sysfs=fixture_sysfs)
    samples = collector.collect()
    assert as_dict(samples) == EXPECTED_FIXTURE_SAMPLES
    # the audio function and the Intel host bridge are not GPUs
    assert not samples.find("hybridmon_pcie_device_present", pci_bus_id=AUDIO0)
    assert not samples.find("hybridmon_pcie_device_present", pci_bus_id=HOST_BRIDGE)
    assert as_dict(collector.collect()) == EXPECTED_FIXTURE_SAMPLES
    assert {s.spec for s in samples} <= set(collector.metric_specs)
    assert collector.name == "pcie" and collector.default_interval_seconds == 5.0


def test_collector_without_aer_logs_once_at_info(fixture_sysfs, live_source, caplog):
    collector = PcieCollector(live_source, sysfs=fixture_sysfs)
    with caplog.at_level(logging.INFO, logger="hybridmon.exporters.pcie"):
        collector.collect()
        collector.collect()
    messages = [r.getMessage() for r in caplog.records if "udev" not in r.getMessage()]
    assert messages == [f"{DEVICES / GPU1 / 'aer_dev_correctable'} does not exist (no AER "
                        "statistics: a device without AER, or a kernel without CONFIG_PCIEAER): "
                        "its series are absent"]
    assert {r.levelno for r in caplog.records} == {logging.INFO}


def test_constructor_reads_nothing():
    class Refuses:
        def read_text(self, path):
            raise AssertionError(path)

        list_dir = call = read_text

    collector = PcieCollector(Refuses(), sysfs="/nowhere")
    collector.close()
    assert collector.udev_monitor_running is False


def test_no_nvidia_function_is_no_data(tmp_path, live_source):
    with pytest.raises(NoDataError, match=r"cannot list the PCI devices: .*No such file"):
        PcieCollector(live_source, sysfs=str(tmp_path)).collect()  # no bus/pci at all
    sysfs = fixture_copy(tmp_path)
    for address in (GPU0, GPU1):
        os.unlink(sysfs / "bus" / "pci" / "devices" / address)
    with pytest.raises(NoDataError, match="no NVIDIA GPU function"):
        PcieCollector(live_source, sysfs=str(sysfs)).collect()  # audio function and bridge only


# A link of unknown state is no candidate for the narrowest on the path: GPU0's path has no other.
NARROWEST_OF_GPU0 = [f"path_narrowest_link_width_lanes:{GPU0}",
                     f"path_narrowest_link_speed_transfers_per_second:{GPU0}"]


@pytest.mark.parametrize("name, content, absent", [
    ("current_link_speed", None, ["link_speed_transfers_per_second", "link_generation", *NARROWEST_OF_GPU0]),
    ("current_link_speed", "Unknown\n", ["link_speed_transfers_per_second", "link_generation",
                                         *NARROWEST_OF_GPU0]),
    ("max_link_speed", "garbage\n", ["link_max_speed_transfers_per_second", "link_max_generation"]),
    ("current_link_width", "0\n", ["link_width_lanes", *NARROWEST_OF_GPU0]),
    ("max_link_width", "255\n", ["link_max_width_lanes"]),
    ("numa_node", "-1\n", ["device_numa_node"]),
    ("numa_node", None, ["device_numa_node"]),
    ("aer_dev_fatal", None, ["aer_errors_total:fatal"]),
    ("aer_dev_nonfatal", "TOTAL_ERR_NONFATAL\n", ["aer_errors_total:nonfatal"]),
    ("aer_dev_correctable", "RxErr 3\n", ["aer_errors_total:correctable"]),  # no TOTAL line
])
def test_missing_or_odd_file_leaves_only_its_series_out(tmp_path, live_source, name, content,
                                                        absent):
    sysfs = fixture_copy(tmp_path)
    path = device_dir(sysfs, GPU0) / name
    if content is None:
        path.unlink()
    else:
        path.write_text(content)
    samples = PcieCollector(live_source, sysfs=str(sysfs)).collect()
    expected = dict(EXPECTED_FIXTURE_SAMPLES)
    for key in absent:
        metric, _, second_label = key.partition(":")   # an AER severity, or a narrowest link's port
        del expected[("hybridmon_pcie_" + metric, (GPU0, second_label) if second_label else (GPU0,))]
    assert as_dict(samples) == expected


def test_unreadable_file_is_logged_once_naming_it(tmp_path, live_source, caplog):
    sysfs = fixture_copy(tmp_path)
    (device_dir(sysfs, GPU1) / "max_link_width").write_text("x16\n")
    collector = PcieCollector(live_source, sysfs=str(sysfs))
    with caplog.at_level(logging.WARNING, logger="hybridmon.exporters.pcie"):
        collector.collect()
        collector.collect()
    assert [r.getMessage() for r in caplog.records] == [
        f"{sysfs / 'bus/pci/devices' / GPU1 / 'max_link_width'} has an unexpected format "
        "(not a PCIe link width: 'x16'): its series are absent"]


# -- presence and rediscovery ----------------------------------------------------------------------

def test_gpu_falling_off_the_bus_stays_exported_with_present_0(tmp_path, live_source, caplog):
    sysfs = fixture_copy(tmp_path)
    clock = FakeClock()
    collector = PcieCollector(live_source, sysfs=str(sysfs), clock=clock)
    assert collector.collect().value("hybridmon_pcie_device_present", pci_bus_id=GPU1) == 1
    home, gone = device_dir(sysfs, GPU1), tmp_path / "gone"
    shutil.move(home, gone)  # the link in bus/pci/devices now dangles
    clock.now += 1
    with caplog.at_level(logging.WARNING, logger="hybridmon.exporters.pcie"):
        samples = collector.collect()
    assert as_dict(samples) == {key: value for key, value in EXPECTED_FIXTURE_SAMPLES.items()
                                if key[1][0] == GPU0} | {
        ("hybridmon_pcie_device_present", (GPU1,)): 0}
    assert caplog.messages == [
        f"pcie: NVIDIA function {GPU1} disappeared from {sysfs}/bus/pci/devices"]
    clock.now += 10  # rediscovery no longer lists it either
    assert collector.collect().value("hybridmon_pcie_device_present", pci_bus_id=GPU1) == 0
    shutil.move(gone, home)
    clock.now += 1  # back, but not rediscovered yet
    assert collector.collect().value("hybridmon_pcie_device_present", pci_bus_id=GPU1) == 0
    clock.now += 10
    assert as_dict(collector.collect()) == EXPECTED_FIXTURE_SAMPLES


def test_new_gpu_is_found_by_the_rediscovery_10_seconds_later(tmp_path, live_source):
    sysfs = fixture_copy(tmp_path)
    clock = FakeClock()
    collector = PcieCollector(live_source, sysfs=str(sysfs), clock=clock)
    collector.collect()
    new = "0000:e1:00.0"
    shutil.copytree(device_dir(sysfs, GPU1), sysfs / "bus" / "pci" / "devices" / new)
    clock.now += 9.9
    assert collector.collect().value("hybridmon_pcie_device_present", pci_bus_id=new) is None
    clock.now += 0.1
    samples = collector.collect()
    assert samples.value("hybridmon_pcie_device_present", pci_bus_id=new) == 1
    assert samples.value("hybridmon_pcie_link_width_lanes", pci_bus_id=new) == 8


def test_fixed_attributes_are_read_at_discovery_and_the_link_every_tick(tmp_path, live_source):
    """max_link_speed, max_link_width and numa_node are the device's and its firmware's: read
    when the device is discovered (every 10 s), not on every tick like the running link."""
    sysfs = fixture_copy(tmp_path)
    clock = FakeClock()
    recording = RecordingSource(live_source)
    collector = PcieCollector(recording, sysfs=str(sysfs), clock=clock)
    fixed = ("max_link_speed", "max_link_width", "numa_node")

    def read_names():
        return {path.rsplit("/", 1)[1] for kind, path, *_ in recording.take_readings() if kind == "text"}

    collector.collect()
    assert set(fixed) <= read_names()
    (device_dir(sysfs, GPU1) / "current_link_width").write_text("4\n")
    (device_dir(sysfs, GPU1) / "max_link_width").write_text("4\n")
    clock.now += 1
    samples = collector.collect()
    assert not set(fixed) & read_names()
    assert samples.value("hybridmon_pcie_link_width_lanes", pci_bus_id=GPU1) == 4
    assert samples.value("hybridmon_pcie_link_max_width_lanes", pci_bus_id=GPU1) == 16
    clock.now += 10  # the rediscovery reads them again
    assert collector.collect().value("hybridmon_pcie_link_max_width_lanes", pci_bus_id=GPU1) == 4
    assert set(fixed) <= read_names()


def test_an_aer_count_that_changes_is_seen_on_the_next_tick(tmp_path, live_source):
    """AER files are parsed again only when their text changed: a change is never missed, and a
    file that turns unparseable leaves its series out as on the first read."""
    sysfs = fixture_copy(tmp_path)
    collector = PcieCollector(live_source, sysfs=str(sysfs), clock=FakeClock())
    aer = device_dir(sysfs, GPU0) / "aer_dev_correctable"
    assert collector.collect().value("hybridmon_pcie_aer_errors_total", pci_bus_id=GPU0, severity="correctable") == 7
    aer.write_text(aer.read_text().replace("TOTAL_ERR_COR 7", "TOTAL_ERR_COR 9"))
    assert collector.collect().value("hybridmon_pcie_aer_errors_total", pci_bus_id=GPU0, severity="correctable") == 9
    aer.write_text("RxErr 3\n")
    assert collector.collect().value("hybridmon_pcie_aer_errors_total", pci_bus_id=GPU0, severity="correctable") is None


def test_udev_discovery_path_with_fake_enumeration(fixture_sysfs, live_source, monkeypatch):
    monkeypatch.setattr(pcie, "list_nvidia_gpus_udev", lambda: [GPU0])
    recording = RecordingSource(live_source)
    collector = PcieCollector(recording, sysfs=fixture_sysfs, use_udev=True, monitor_events=False)
    assert as_dict(collector.collect()) == {
        key: value for key, value in EXPECTED_FIXTURE_SAMPLES.items() if key[1][0] == GPU0}
    readings = recording.take_readings()
    assert readings[:2] == [["call", "pcie.rediscovery_due", True, True],
                            ["call", "udev.nvidia_pci_functions", True, [GPU0]]]
    # where the function sits in the PCIe tree, resolved through the source, then only files
    assert readings[2][:3] == ["call", f"pcie.device_path:{GPU0}", True]
    assert readings[2][3].endswith(f"/devices/pci0000:16/0000:16:01.0/{GPU0}")
    assert all(kind == "text" for kind, *_ in readings[3:])


def test_list_nvidia_gpus_udev_filters_display_functions(monkeypatch):
    class Device:
        def __init__(self, sys_name, pci_id, pci_class):
            self.sys_name = sys_name
            self.properties = {"PCI_ID": pci_id, "PCI_CLASS": pci_class}

    class Context:
        def list_devices(self, subsystem):
            assert subsystem == "pci"
            return [Device(GPU1, "10DE:2236", "30200"), Device(HOST_BRIDGE, "8086:09A2", "60000"),
                    Device(AUDIO0, "10DE:22BA", "40300"), Device(GPU0, "10DE:26B9", "30200"),
                    Device("0000:03:00.0", "10DE:1DB6", "30000"),
                    Device("0000:04:00.0", "1AF4:1041", "20000")]

    monkeypatch.setattr(pcie.pyudev, "Context", Context)
    assert list_nvidia_gpus_udev() == ["0000:03:00.0", GPU0, GPU1]


# -- this machine --------------------------------------------------------------------------------

def nvidia_gpus_here() -> list[str]:
    """Read directly, to check the collector by: [] on the development machine (virtio only)."""
    found = []
    for address in sorted(os.listdir("/sys/bus/pci/devices")):
        with open(f"/sys/bus/pci/devices/{address}/vendor") as vendor, \
                open(f"/sys/bus/pci/devices/{address}/class") as pci_class:
            if vendor.read().strip() == "0x10de" and pci_class.read().startswith("0x03"):
                found.append(address)
    return found


@pytest.mark.slow
def test_pyudev_works_here_and_lists_the_nvidia_gpus_of_this_machine():
    ctypes.CDLL("libudev.so.1")
    here = list(pyudev.Context().list_devices(subsystem="pci"))
    assert here, "pyudev lists the PCI devices of this machine"
    assert sorted(d.sys_name for d in here) == sorted(os.listdir("/sys/bus/pci/devices"))
    assert list_nvidia_gpus_udev() == nvidia_gpus_here()


def live_expectation(collector: PcieCollector) -> dict | None:
    """Samples' presence on this machine, or None where it has no NVIDIA GPU (NoDataError)."""
    try:
        samples = collector.collect()
    except NoDataError as error:
        assert str(error) == ("no NVIDIA GPU function (vendor 0x10de, class 0x03xxxx) under "
                              "/sys/bus/pci/devices")
        return None
    return {s.label_values[0]: s.value for s in samples.find("hybridmon_pcie_device_present")}


@pytest.mark.slow
def test_live_host_via_udev_and_its_monitor(live_source):
    gpus = nvidia_gpus_here()
    recording = RecordingSource(live_source)
    collector = PcieCollector(recording)
    try:
        present = live_expectation(collector)
        assert present == ({gpu: 1 for gpu in gpus} if gpus else None)
        readings = recording.take_readings()
        if netlink_uevents_permitted():  # as on the development machine
            assert collector.udev_monitor_running
            assert readings[0] == ["call", "udev.event_counts", True, {"add": 0, "remove": 0}]
        else:
            assert not collector.udev_monitor_running
            assert readings[0] == ["call", "udev.event_counts", True, None]
        assert readings[1:3] == [["call", "pcie.rediscovery_due", True, True],
                                 ["call", "udev.nvidia_pci_functions", True, gpus]]
    finally:
        collector.close()
    assert not collector.udev_monitor_running


def test_live_host_via_sysfs_walk(live_source):
    gpus = nvidia_gpus_here()
    collector = PcieCollector(live_source, use_udev=False)
    assert live_expectation(collector) == ({gpu: 1 for gpu in gpus} if gpus else None)
    assert not collector.udev_monitor_running  # the monitor belongs to the udev way only


# -- udev events ---------------------------------------------------------------------------------

def test_event_handler_counts_nvidia_functions_by_action(live_source):
    collector = PcieCollector(live_source)
    for device in (FakeUdevDevice("add", "10DE:26B9"), FakeUdevDevice("bind", "10DE:26B9"),
                   FakeUdevDevice("add", "10DE:22BA", "40300"),  # the audio function counts too
                   FakeUdevDevice("remove", "10de:26b9"), FakeUdevDevice("add", "1AF4:1041"),
                   FakeUdevDevice("change"), FakeUdevDevice(None, "10DE:26B9")):
        collector.handle_udev_event(device)

    class Broken:
        action = "add"

        @property
        def properties(self):
            raise RuntimeError("device vanished")

    collector.handle_udev_event(Broken())
    assert collector._event_counts == {"add": 2, "bind": 1, "remove": 1}


class FakeMonitor:
    refused = None

    @classmethod
    def from_netlink(cls, context, source):
        assert source == "kernel"
        if cls.refused:
            raise cls.refused
        return cls()

    def filter_by(self, subsystem):
        assert subsystem == "pci"

    def start(self):
        pass


class FakeObserver:
    def __init__(self, monitor, callback, name):
        self.callback, self.alive = callback, False

    def start(self):
        self.alive = True

    def is_alive(self):
        return self.alive

    def stop(self):
        self.alive = False


@pytest.fixture
def fake_pyudev(monkeypatch):
    monkeypatch.setattr(pcie.pyudev, "Monitor", FakeMonitor)
    monkeypatch.setattr(pcie.pyudev, "MonitorObserver", FakeObserver)
    monkeypatch.setattr(FakeMonitor, "refused", None)
    return FakeMonitor


@pytest.mark.slow
def test_udev_events_are_exported_and_trigger_rediscovery(tmp_path, live_source, fake_pyudev,
                                                          monkeypatch):
    sysfs = fixture_copy(tmp_path)
    collector = PcieCollector(live_source, sysfs=str(sysfs), use_udev=True, clock=FakeClock())
    monkeypatch.setattr(pcie, "list_nvidia_gpus_udev", collector._list_nvidia_gpus_sysfs)
    samples = collector.collect()
    assert samples.value("hybridmon_pcie_udev_events_total", action="add") == 0
    assert samples.value("hybridmon_pcie_udev_events_total", action="remove") == 0
    assert len(samples.find("hybridmon_pcie_udev_events_total")) == 2
    new = "0000:e1:00.0"
    shutil.copytree(device_dir(sysfs, GPU1), sysfs / "bus" / "pci" / "devices" / new)
    collector._observer.callback(FakeUdevDevice("add", "10DE:2236"))
    collector._observer.callback(FakeUdevDevice("bind", "10DE:2236"))
    samples = collector.collect()  # same instant: only the events make it look again
    assert samples.value("hybridmon_pcie_udev_events_total", action="add") == 1
    assert samples.value("hybridmon_pcie_udev_events_total", action="bind") == 1
    assert samples.value("hybridmon_pcie_udev_events_total", action="remove") == 0
    assert samples.value("hybridmon_pcie_device_present", pci_bus_id=new) == 1
    collector.close()
    assert not collector.udev_monitor_running


@pytest.mark.slow
def test_refused_netlink_leaves_the_counter_absent_and_says_why_once(
        fixture_sysfs, live_source, fake_pyudev, monkeypatch, caplog):
    fake_pyudev.refused = PermissionError(errno.EPERM, "Operation not permitted")
    monkeypatch.setattr(pcie, "list_nvidia_gpus_udev", lambda: [GPU0, GPU1])
    collector = PcieCollector(live_source, sysfs=fixture_sysfs, use_udev=True)
    with caplog.at_level(logging.WARNING, logger="hybridmon.exporters.pcie"):
        assert as_dict(collector.collect()) == EXPECTED_FIXTURE_SAMPLES
        assert as_dict(collector.collect()) == EXPECTED_FIXTURE_SAMPLES
    assert caplog.messages == [
        "pcie: cannot receive kernel uevents over netlink (PermissionError: [Errno 1] Operation "
        "not permitted), so PCI hotplug events are not counted and "
        "hybridmon_pcie_udev_events_total stays absent; in a container, run the agent in the host "
        "network namespace"]
    assert not collector.udev_monitor_running


class RefusingObserver:
    """A MonitorObserver that cannot start its thread, as when the process is out of threads."""

    def __init__(self, monitor, callback, name):
        self.monitor = monitor

    def start(self):
        raise RuntimeError("can't start new thread")


@pytest.mark.slow
def test_failed_observer_leaves_no_reference_to_the_monitor(fixture_sysfs, live_source,
                                                            fake_pyudev, monkeypatch, caplog):
    started = []
    monkeypatch.setattr(FakeMonitor, "start", lambda self: started.append(weakref.ref(self)))
    monkeypatch.setattr(pcie.pyudev, "MonitorObserver", RefusingObserver)
    monkeypatch.setattr(pcie, "list_nvidia_gpus_udev", lambda: [GPU0])
    collector = PcieCollector(live_source, sysfs=fixture_sysfs, use_udev=True)
    with caplog.at_level(logging.WARNING, logger="hybridmon.exporters.pcie"):  # log records live on
        assert collector.collect().find("hybridmon_pcie_udev_events_total") == []
    gc.collect()
    assert len(started) == 1
    assert started[0]() is None  # freed: libudev has closed its netlink socket
    assert "RuntimeError: can't start new thread" in caplog.text


@pytest.mark.slow
def test_failed_observer_closes_the_real_netlink_socket(fixture_sysfs, live_source, monkeypatch,
                                                       caplog):
    monkeypatch.setattr(pcie.pyudev, "MonitorObserver", RefusingObserver)
    monkeypatch.setattr(pcie, "list_nvidia_gpus_udev", lambda: [GPU0])
    gc.collect()
    before = len(os.listdir("/proc/self/fd"))
    collector = PcieCollector(live_source, sysfs=fixture_sysfs, use_udev=True)
    with caplog.at_level(logging.WARNING, logger="hybridmon.exporters.pcie"):
        collector.collect()
    gc.collect()
    assert len(os.listdir("/proc/self/fd")) == before
    reason = "can't start new thread" if netlink_uevents_permitted() else "cannot receive"
    assert reason in caplog.text


def test_udev_off_outside_the_hosts_sysfs_says_so_once(fixture_sysfs, live_source, caplog):
    collector = PcieCollector(live_source, sysfs=fixture_sysfs)
    with caplog.at_level(logging.INFO, logger="hybridmon.exporters.pcie"):
        assert collector.collect().find("hybridmon_pcie_udev_events_total") == []
        collector.collect()
    off = [r for r in caplog.records if "uevents are not watched" in r.getMessage()]
    assert len(off) == 1 and off[0].levelno == logging.INFO
    assert f"sysfs is {fixture_sysfs}, and udev only describes the host's own /sys" in \
        off[0].getMessage()
    caplog.clear()
    quiet = PcieCollector(live_source, sysfs=fixture_sysfs, monitor_events=False)
    with caplog.at_level(logging.INFO, logger="hybridmon.exporters.pcie"):
        quiet.collect()
    assert "uevents" not in caplog.text  # events not asked for: nothing to explain


@pytest.mark.slow
def test_dead_observer_thread_drops_the_counter(fixture_sysfs, live_source, fake_pyudev,
                                                monkeypatch, caplog):
    monkeypatch.setattr(pcie, "list_nvidia_gpus_udev", lambda: [GPU0])
    collector = PcieCollector(live_source, sysfs=fixture_sysfs, use_udev=True)
    assert collector.collect().find("hybridmon_pcie_udev_events_total")
    collector._observer.alive = False
    with caplog.at_level(logging.WARNING, logger="hybridmon.exporters.pcie"):
        assert not collector.collect().find("hybridmon_pcie_udev_events_total")
    assert "udev observer thread stopped" in caplog.text


# -- record and replay -----------------------------------------------------------------------------

def record_and_replay(make_collector, steps):
    """Runs `steps` (callables run before each collect) live while recording, then replays."""
    recording = RecordingSource(LiveSource())
    collector = make_collector(recording)
    recorded, traces = [], []
    for step in steps:
        step()
        try:
            recorded.append(as_dict(collector.collect()))
        except NoDataError as error:
            recorded.append(("no data", str(error)))
        traces.append(recording.take_readings())
    collector.close()
    replay = ReplaySource()
    replayed_collector = make_collector(replay)
    replayed = []
    for readings in traces:
        replay.load(readings)
        try:
            replayed.append(as_dict(replayed_collector.collect()))
        except NoDataError as error:
            replayed.append(("no data", str(error)))
    return recorded, replayed


def test_record_then_replay_gives_identical_samples(tmp_path):
    sysfs = fixture_copy(tmp_path)
    clock = FakeClock()

    def tick(seconds):
        def step():
            clock.now += seconds
        return step

    def unplug():
        clock.now += 1
        shutil.move(device_dir(sysfs, GPU1), tmp_path / "gone")

    recorded, replayed = record_and_replay(
        lambda source: PcieCollector(source, sysfs=str(sysfs), clock=clock),
        [tick(0), tick(1), unplug, tick(10), tick(1)])
    assert recorded == replayed
    assert recorded[0] == EXPECTED_FIXTURE_SAMPLES
    assert recorded[2][("hybridmon_pcie_device_present", (GPU1,))] == 0
    assert recorded[4][("hybridmon_pcie_device_present", (GPU1,))] == 0


@pytest.mark.slow
def test_record_then_replay_on_this_machine():
    recorded, replayed = record_and_replay(PcieCollector, [lambda: None, lambda: time.sleep(0.01)])
    assert recorded == replayed
    assert (recorded[0][0] == "no data") == (not nvidia_gpus_here())  # no data here


@pytest.mark.slow
def test_replay_of_a_udev_trace_needs_no_monitor(fixture_sysfs, live_source, fake_pyudev,
                                                 monkeypatch):
    monkeypatch.setattr(pcie, "list_nvidia_gpus_udev", lambda: [GPU1])

    def make(source):
        return PcieCollector(source, sysfs=fixture_sysfs, use_udev=True)

    recording = RecordingSource(live_source)
    collector = make(recording)
    collector.collect()
    collector.handle_udev_event(FakeUdevDevice("change", "10DE:2236"))
    recorded = as_dict(collector.collect())
    traces = recording.take_readings()
    fake_pyudev.refused = AssertionError("a replay must not open a monitor")
    monkeypatch.setattr(pcie, "list_nvidia_gpus_udev", lambda: pytest.fail("replay enumerated"))
    replay = ReplaySource()
    replayed_collector = make(replay)
    replay.load(traces)
    replayed_collector.collect()
    assert as_dict(replayed_collector.collect()) == recorded
    assert recorded[("hybridmon_pcie_udev_events_total", ("change",))] == 1
    assert not replayed_collector.udev_monitor_running


def test_failed_rediscovery_keeps_the_known_devices(fixture_sysfs, live_source, monkeypatch,
                                                    caplog):
    clock = FakeClock()
    monkeypatch.setattr(pcie, "list_nvidia_gpus_udev", lambda: [GPU0, GPU1])
    collector = PcieCollector(live_source, sysfs=fixture_sysfs, use_udev=True,
                              monitor_events=False, clock=clock)
    assert as_dict(collector.collect()) == EXPECTED_FIXTURE_SAMPLES

    def refuse():
        raise OSError(errno.EMFILE, "Too many open files")

    monkeypatch.setattr(pcie, "list_nvidia_gpus_udev", refuse)
    with caplog.at_level(logging.WARNING, logger="hybridmon.exporters.pcie"):
        for _ in range(2):
            clock.now += 10
            assert as_dict(collector.collect()) == EXPECTED_FIXTURE_SAMPLES
    assert caplog.messages == ["pcie: cannot list NVIDIA PCI functions (OSError: [Errno 24] Too "
                               "many open files); keeping the devices found before"]


# This module's parsers, each with realistic samples, for tests/exporters/test_parsers_robustness.py
# (which holds every parse_* of exporters/ to its one promised error).
_GPU0 = FIXTURE_HOST / "sys/bus/pci/devices/0000:17:00.0"
_GPU1 = FIXTURE_HOST / "sys/bus/pci/devices/0000:ca:00.0"
PARSER_ROWS = [
    ParserRow(parse_link_speed, read(_GPU0 / "current_link_speed", _GPU1 / "current_link_speed")),
    ParserRow(parse_link_width, read(_GPU0 / "current_link_width", _GPU1 / "current_link_width")),
    ParserRow(parse_hex_id, read(_GPU0 / "vendor", _GPU0 / "device", _GPU0 / "class")),
    ParserRow(parse_numa_node, read(_GPU0 / "numa_node", _GPU1 / "numa_node")),
    ParserRow(parse_aer_counters, read(_GPU0 / "aer_dev_correctable", _GPU0 / "aer_dev_nonfatal",
                                       _GPU0 / "aer_dev_fatal") + (OLD_KERNEL_AER, UNNAMED_BIT_AER)),
]
