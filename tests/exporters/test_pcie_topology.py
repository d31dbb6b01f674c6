"""The PCIe topology the pcie collector reads (exporters/pcie_topology.py): each GPU's place in the
tree from its resolved sysfs path, the uplink GPUs share behind a switch, and the narrowest link on
each GPU's path, on the checked-in tree tests/fixtures/host-switch (two GPUs behind one switch,
one on a root port of its own)."""
from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest

from hybridmon.exporters.base import ParseError
from hybridmon.exporters.pcie import PcieCollector
from hybridmon.exporters.pcie_topology import SharedUplink, link_ends, parse_device_path, shared_uplinks
from hybridmon.exporters.sources import LiveSource
from tests.exporters.test_pcie import as_dict, record_and_replay
from tests.support.parser_properties import ParserRow
from tests.support.paths import FIXTURE_SWITCH_HOST

ROOT_PORT, SWITCH_UP, DOWN_A, DOWN_B = "0000:00:01.0", "0000:01:00.0", "0000:02:08.0", "0000:02:10.0"
GPU_A, GPU_B = "0000:03:00.0", "0000:04:00.0"          # behind the switch; GPU_B trained to x8
LONE_ROOT_PORT, GPU_C = "0000:40:01.0", "0000:41:00.0"  # on a root port of its own
DEVICES = FIXTURE_SWITCH_HOST / "sys" / "bus" / "pci" / "devices"

EXPECTED_TOPOLOGY = {
    ("hybridmon_pcie_uplink_info", (GPU_A, SWITCH_UP, ROOT_PORT)): 1,
    ("hybridmon_pcie_uplink_info", (GPU_B, SWITCH_UP, ROOT_PORT)): 1,
    ("hybridmon_pcie_uplink_gpus", (SWITCH_UP,)): 2,
    ("hybridmon_pcie_uplink_speed_transfers_per_second", (SWITCH_UP,)): 16e9,
    ("hybridmon_pcie_uplink_generation", (SWITCH_UP,)): 4,
    ("hybridmon_pcie_uplink_width_lanes", (SWITCH_UP,)): 16,
    ("hybridmon_pcie_uplink_max_speed_transfers_per_second", (SWITCH_UP,)): 16e9,
    ("hybridmon_pcie_uplink_max_width_lanes", (SWITCH_UP,)): 16,
    # GPU A: the uplink and its own link are both Gen4 x16; the one nearer the CPU is named
    ("hybridmon_pcie_path_narrowest_link_width_lanes", (GPU_A, SWITCH_UP)): 16,
    ("hybridmon_pcie_path_narrowest_link_speed_transfers_per_second", (GPU_A, SWITCH_UP)): 16e9,
    # GPU B: its own link trained to x8 is narrower than the uplink
    ("hybridmon_pcie_path_narrowest_link_width_lanes", (GPU_B, GPU_B)): 8,
    ("hybridmon_pcie_path_narrowest_link_speed_transfers_per_second", (GPU_B, GPU_B)): 16e9,
    ("hybridmon_pcie_path_narrowest_link_width_lanes", (GPU_C, GPU_C)): 16,
    ("hybridmon_pcie_path_narrowest_link_speed_transfers_per_second", (GPU_C, GPU_C)): 16e9,
}
TOPOLOGY_METRICS = ("hybridmon_pcie_uplink_", "hybridmon_pcie_path_")


def topology_of(samples) -> dict:
    return {key: value for key, value in as_dict(samples).items() if key[0].startswith(TOPOLOGY_METRICS)}


def fixture_copy(tmp_path: Path) -> Path:
    sysfs = tmp_path / "sys"
    shutil.copytree(FIXTURE_SWITCH_HOST / "sys", sysfs, symlinks=True)
    return sysfs


# -- parse_device_path -----------------------------------------------------------------------------

@pytest.mark.parametrize("text, chain", [
    ("/sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:08.0/0000:03:00.0",
     (ROOT_PORT, SWITCH_UP, DOWN_A, GPU_A)),
    ("/sys/devices/pci0000:40/0000:40:01.0/0000:41:00.0\n", (LONE_ROOT_PORT, GPU_C)),
    # a test root or a container's bind mount before /devices is not part of the tree
    ("/tmp/x/sys/devices/pci0000:16/0000:16:01.0/0000:17:00.0", ("0000:16:01.0", "0000:17:00.0")),
    # QEMU's i440fx puts a passed-through GPU straight on the host bridge: no root port
    ("/sys/devices/pci0000:00/0000:00:05.0", ("0000:00:05.0",)),
    # Hyper-V (Azure NC/ND): the host bridge sits under VMBus, its domain runs to 8 hex digits
    ("/sys/devices/LNXSYSTM:00/LNXSYBUS:00/ACPI0004:00/VMBUS:00/47505500-0001-0000-3130-444531303244/"
     "pci47505500:00/47505500:00:00.0", ("47505500:00:00.0",)),
])
def test_parse_device_path(text, chain):
    assert parse_device_path(text) == chain


@pytest.mark.parametrize("text", [
    "", "/sys/bus/pci/devices/0000:03:00.0",              # not resolved: no host bridge
    "/sys/devices/pci0000:00", "/sys/devices/pci0000:00/",  # the bridge alone
    "/sys/devices/pci0000:00/0000:00:01.0/drm",            # not a function below the bridge
    "/sys/devices/pci0000:00/0000:00:01.0/0000:01:00.8",   # function numbers end at 7
])
def test_parse_device_path_refuses_what_is_not_a_chain_of_functions(text):
    with pytest.raises(ParseError):
        parse_device_path(text)


# -- shared_uplinks --------------------------------------------------------------------------------

def test_two_gpus_behind_one_switch_share_its_uplink_and_a_lone_gpu_shares_nothing():
    paths = {GPU_A: (ROOT_PORT, SWITCH_UP, DOWN_A, GPU_A), GPU_B: (ROOT_PORT, SWITCH_UP, DOWN_B, GPU_B),
             GPU_C: (LONE_ROOT_PORT, GPU_C)}
    shared = SharedUplink(SWITCH_UP, ROOT_PORT, (GPU_A, GPU_B))
    assert shared_uplinks(paths) == {GPU_A: shared, GPU_B: shared}


def test_the_highest_shared_link_counts_under_two_levels_of_switches():
    # root port -> switch 1 (up 0000:01:00.0) -> downstream 02:00.0 -> switch 2 (up 03:00.0) -> two
    # GPUs; switch 1's other downstream port 02:01.0 -> a third GPU. All three share switch 1's
    # uplink; switch 2's link, shared by two of them, lies below it.
    two = ("0000:00:01.0", "0000:01:00.0", "0000:02:00.0", "0000:03:00.0")
    paths = {"0000:05:00.0": two + ("0000:04:00.0", "0000:05:00.0"),
             "0000:06:00.0": two + ("0000:04:01.0", "0000:06:00.0"),
             "0000:07:00.0": ("0000:00:01.0", "0000:01:00.0", "0000:02:01.0", "0000:07:00.0")}
    found = shared_uplinks(paths)
    assert {uplink.port for uplink in found.values()} == {"0000:01:00.0"}
    assert found["0000:07:00.0"].gpus == ("0000:05:00.0", "0000:06:00.0", "0000:07:00.0")


def test_one_gpu_behind_a_switch_shares_nothing():
    assert shared_uplinks({GPU_A: (ROOT_PORT, SWITCH_UP, DOWN_A, GPU_A), GPU_C: (LONE_ROOT_PORT, GPU_C)}) == {}


def test_link_ends_skip_the_downstream_ports_whose_link_status_is_the_link_below():
    assert link_ends((ROOT_PORT, SWITCH_UP, DOWN_A, GPU_A)) == (SWITCH_UP, GPU_A)
    assert link_ends((LONE_ROOT_PORT, GPU_C)) == (GPU_C,)
    assert link_ends(("0000:00:05.0",)) == ()


# -- the collector on the checked-in tree ----------------------------------------------------------

def test_collector_exports_the_shared_uplink_and_each_narrowest_link():
    samples = PcieCollector(LiveSource(), sysfs=str(FIXTURE_SWITCH_HOST / "sys")).collect()
    assert topology_of(samples) == EXPECTED_TOPOLOGY
    # the switch's own ports are no GPUs: only the three display-class functions are
    assert {sample.label_values[0] for sample in samples.find("hybridmon_pcie_device_present")} == {
        GPU_A, GPU_B, GPU_C}


def test_a_gpu_gone_from_the_bus_leaves_the_uplink_unshared_at_the_next_discovery(tmp_path):
    sysfs = fixture_copy(tmp_path)
    clock = [1000.0]
    collector = PcieCollector(LiveSource(), sysfs=str(sysfs), clock=lambda: clock[0])
    assert topology_of(collector.collect()) == EXPECTED_TOPOLOGY
    (sysfs / "bus/pci/devices" / GPU_B).unlink()
    shutil.rmtree((sysfs / "devices/pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:10.0" / GPU_B))
    clock[0] += 1   # before the next discovery: B is gone, the uplink still counts both
    between = topology_of(collector.collect())
    assert ("hybridmon_pcie_uplink_info", (GPU_B, SWITCH_UP, ROOT_PORT)) not in between
    assert between[("hybridmon_pcie_uplink_gpus", (SWITCH_UP,))] == 2
    clock[0] += 10
    after = topology_of(collector.collect())
    assert not any(key[0].startswith("hybridmon_pcie_uplink_") for key in after)
    assert after[("hybridmon_pcie_path_narrowest_link_width_lanes", (GPU_A, SWITCH_UP))] == 16


def test_an_unknown_uplink_speed_leaves_its_speed_out_and_the_narrowest_to_the_known_links(tmp_path):
    sysfs = fixture_copy(tmp_path)
    (sysfs / "bus/pci/devices" / SWITCH_UP / "current_link_speed").write_text("Unknown\n")
    found = topology_of(PcieCollector(LiveSource(), sysfs=str(sysfs)).collect())
    assert ("hybridmon_pcie_uplink_speed_transfers_per_second", (SWITCH_UP,)) not in found
    assert ("hybridmon_pcie_uplink_generation", (SWITCH_UP,)) not in found
    assert found[("hybridmon_pcie_uplink_width_lanes", (SWITCH_UP,))] == 16
    assert found[("hybridmon_pcie_path_narrowest_link_width_lanes", (GPU_A, GPU_A))] == 16


def test_a_gpu_that_cannot_be_placed_keeps_its_own_series_and_says_why(tmp_path, caplog):
    # a flat tree (a directory where the kernel has a link): no host bridge on the path
    sysfs = fixture_copy(tmp_path)
    link = sysfs / "bus/pci/devices" / GPU_C
    target = link.resolve()
    link.unlink()
    shutil.copytree(target, link)
    with caplog.at_level(logging.WARNING, logger="hybridmon.exporters.pcie"):
        samples = PcieCollector(LiveSource(), sysfs=str(sysfs)).collect()
    assert samples.value("hybridmon_pcie_link_width_lanes", pci_bus_id=GPU_C) == 16
    assert not samples.find("hybridmon_pcie_path_narrowest_link_width_lanes", pci_bus_id=GPU_C)
    assert topology_of(samples)[("hybridmon_pcie_uplink_gpus", (SWITCH_UP,))] == 2
    assert f"cannot place {GPU_C} in the PCIe tree" in caplog.text and "no PCI host bridge" in caplog.text


def test_record_then_replay_places_the_gpus_alike(tmp_path):
    sysfs = fixture_copy(tmp_path)
    recorded, replayed = record_and_replay(lambda source: PcieCollector(source, sysfs=str(sysfs)),
                                           [lambda: None, lambda: None])
    assert recorded == replayed
    assert {key: value for key, value in recorded[0].items() if key[0].startswith(TOPOLOGY_METRICS)} \
        == EXPECTED_TOPOLOGY


PARSER_ROWS = [
    ParserRow(parse_device_path, tuple(str((DEVICES / gpu).resolve()) for gpu in (GPU_A, GPU_B, GPU_C))),
]
