"""PCIe link facts every layer shares: bytes per lane at each generation, raw line rates, a link's
theoretical capacity and its name. The collectors, the detectors, the PromQL rules, the status page
and the test host all read these tables, so a link means the same number everywhere.

Bytes/s per lane per direction after line encoding: 8b/10b for Gen1-2, 128b/130b for Gen3-5, 242B/256B
FLIT for Gen6 (PCI-SIG base specifications; e.g. Gen4 16 GT/s x 128/130 / 8 = 1969.2 MB/s, so a Gen4
x16 link carries 31.5 GB/s per direction). The raw line rate (GT/s = Gbit/s per lane) is what DCGM's
PCIe replay bound scales with.

No copy reaches the theoretical rate: TLP headers, flow control and the copy engines' own limits
leave 76-87 % of it. What a link achievably carries is what `hybridmon bench` measured on this
host, else the theoretical rate x the share copy engines are published to reach at its generation
(ACHIEVABLE_SHARE below, one direction; BIDIRECTIONAL_SHARE, each direction while both run).
GpuPcieStarvation and InferenceKvOffloadPressure judge traffic against that, not the theoretical rate,
which a saturated link never shows.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

# Generation -> (bytes/s per lane per direction as a PromQL-ready literal, the encoding behind it).
LANE_BYTES_PER_SECOND_TEXT = {
    1: ("250e6", "2.5 GT/s, 8b/10b"),
    2: ("500e6", "5 GT/s, 8b/10b"),
    3: ("984.6e6", "8 GT/s, 128b/130b"),
    4: ("1969.2e6", "16 GT/s, 128b/130b"),
    5: ("3938.5e6", "32 GT/s, 128b/130b"),
    6: ("7563e6", "64 GT/s, 242B/256B FLIT"),
}
# Generation -> (raw line rate per lane in bits/s as a literal, the generation's name).
LANE_LINE_RATE_BITS_PER_SECOND_TEXT = {
    1: ("2.5e9", "Gen1"),
    2: ("5e9", "Gen2"),
    3: ("8e9", "Gen3"),
    4: ("16e9", "Gen4"),
    5: ("32e9", "Gen5"),
    6: ("64e9", "Gen6"),
}
# Generation -> (share of the theoretical rate one direction's copies achieve as a PromQL-ready
# literal, where it comes from). Each is the LOW end of what is published for a healthy link, so a
# saturated copy engine (Gen4: 0.82 x theoretical) is at or above it: a link that carries more
# than we assume only makes a full link look fuller.
ACHIEVABLE_SHARE_TEXT = {
    1: ("0.76", "extrapolated from Gen3: no published copy figure; theoretical already nets out 8b/10b"),
    2: ("0.76", "extrapolated from Gen3: no published copy figure; theoretical already nets out 8b/10b"),
    3: ("0.76", "Gen3 x16 copies reach 12-13 of 15.75 GB/s (issue 13): 12 / 15.75"),
    4: ("0.81", "nvbandwidth CE copies on Gen4 x16: 25.5-26.3 GB/s H2D (RTX 4090), 25.9-26.2 "
                "(README) of 31.5: 25.5 / 31.5"),
    5: ("0.825", "Azure NHC check_cuda_bw floor for H100 Gen5 x16, 52 of 63 GB/s (nvbandwidth on "
                 "H800: ~55, 0.87)"),
    6: ("0.825", "extrapolated from Gen5: no published copy figure; theoretical already nets out FLIT"),
}
# Generation -> (share of the theoretical rate EACH direction achieves while both copy at once,
# where it comes from): bidirectional copies do not add up to twice one direction. nvbandwidth
# measures each direction while the other copies twice the bytes, as `hybridmon bench` does since
# issue 29, so its figure and a measured one mean the same thing.
BIDIRECTIONAL_SHARE_TEXT = {
    **{generation: ("0.58", "extrapolated from Gen4: no published bidirectional figure")
       for generation in (1, 2, 3, 5, 6)},
    4: ("0.58", "nvbandwidth README: 18.5 GB/s per direction bidirectional on Gen4 x16, 18.5 / "
                "31.5 (issue 13: 18-20; nvbandwidth issue #15 saw 11-16 on some hosts)"),
}
LANE_BYTES_PER_SECOND = {generation: float(text) for generation, (text, _) in LANE_BYTES_PER_SECOND_TEXT.items()}
LANE_LINE_RATE_BITS_PER_SECOND = {
    generation: float(text) for generation, (text, _) in LANE_LINE_RATE_BITS_PER_SECOND_TEXT.items()}
ACHIEVABLE_SHARE = {generation: float(text) for generation, (text, _) in ACHIEVABLE_SHARE_TEXT.items()}
BIDIRECTIONAL_SHARE = {generation: float(text) for generation, (text, _) in BIDIRECTIONAL_SHARE_TEXT.items()}
# Per-lane achievable bytes/s, one direction and both together, as the PromQL rules write them
# (lane rate x share, then x lanes), so the detectors multiply in the same order and agree exactly.
LANE_ACHIEVABLE_TEXT = {
    generation: (f"{LANE_BYTES_PER_SECOND_TEXT[generation][0]} * {share}", f"{share} of theoretical")
    for generation, (share, _) in ACHIEVABLE_SHARE_TEXT.items()}
LANE_BIDIRECTIONAL_TEXT = {
    generation: (f"{LANE_BYTES_PER_SECOND_TEXT[generation][0]} * 2 * {share}",
                 f"{share} of theoretical each way")
    for generation, (share, _) in BIDIRECTIONAL_SHARE_TEXT.items()}


def theoretical_capacity(generation: float, lanes: float) -> float | None:
    """Bytes/s per direction of a link at this generation and width; None for an unknown one."""
    per_lane = LANE_BYTES_PER_SECOND.get(int(round(generation)))
    if per_lane is None or lanes <= 0:
        return None
    return per_lane * lanes


def link_name(generation: float, lanes: float) -> str:
    return f"Gen{int(round(generation))} x{int(round(lanes))}"


def replay_bound_per_minute(bit_error_rate: float, generation: int, lanes: int) -> int:
    """DCGM's PCIe health bound: ceil(bit error rate x 60 s x lanes x line rate) replays per minute,
    multiplied in the order the PromQL rule multiplies (the same float result)."""
    return math.ceil(bit_error_rate * 60 * lanes * LANE_LINE_RATE_BITS_PER_SECOND[generation])


def achievable_capacity(generation: float, lanes: float) -> float | None:
    """Bytes/s one direction of a link at this generation and width carries in practice:
    theoretical x ACHIEVABLE_SHARE; None for an unknown link."""
    share = ACHIEVABLE_SHARE.get(int(round(generation)))
    if share is None or lanes <= 0:
        return None
    return lanes * (LANE_BYTES_PER_SECOND[int(round(generation))] * share)


def bidirectional_capacity(generation: float, lanes: float) -> float | None:
    """Bytes/s both directions of a link together carry while both copy at once: 2 x theoretical
    x BIDIRECTIONAL_SHARE; None for an unknown link."""
    share = BIDIRECTIONAL_SHARE.get(int(round(generation)))
    if share is None or lanes <= 0:
        return None
    return lanes * (LANE_BYTES_PER_SECOND[int(round(generation))] * 2 * share)


@dataclass(frozen=True)
class LinkCapacity:
    """What one direction of a link carries, bytes/s, and where that figure comes from."""

    bytes_per_second: float
    source: str                # "measured" (by `hybridmon bench` on this host) or "achievable"
    link: str | None = None    # the link it was worked out for ("Gen4 x16"); None when measured

    @property
    def described(self) -> str:
        """"measured", or "achievable on Gen4 x16": how a finding or the status page names it."""
        return f"{self.source} on {self.link}" if self.link else self.source


def effective_capacity(measured: float | None, generation: float | None,
                       lanes: float | None) -> LinkCapacity | None:
    """One direction of a link: what `hybridmon bench` measured on this host where it has run,
    else achievable_capacity of the generation x width given (the detectors pass the best seen
    over their traffic window; the rules' effective-capacity recording says the same); None when
    neither is known. GpuPcieStarvation, InferenceKvOffloadPressure and the status page all size a
    link by this one function."""
    if measured is not None and measured > 0:
        return LinkCapacity(measured, "measured")
    if generation is None or lanes is None:
        return None
    achievable = achievable_capacity(generation, lanes)
    return LinkCapacity(achievable, "achievable", link_name(generation, lanes)) if achievable else None


# --- NVLink-C2C (GH200, GB200; issue 29) ---------------------------------------------------------
# On a GPU in C2C mode host<->device copies cross NVLink-C2C, not PCIe. NVML states each C2C link's
# maximum bandwidth (field 172); what copies reach of the up links' sum, per direction, as a
# PromQL-ready literal and where it comes from. GH200's C2C is 450 GB/s each way (900 GB/s both
# ways together, NVIDIA's GH200 figures quoted in nvbandwidth issues 23 and 41).
C2C_ACHIEVABLE_SHARE_TEXT = {
    "host_to_device": ("0.77", "nvbandwidth issue 23, GH200: host_to_device_memcpy_ce 346 GB/s of "
                               "450: 346 / 450"),
    "device_to_host": ("0.67", "nvbandwidth issue 23, GH200: host to device ~15 % faster than "
                               "device to host, ~301 GB/s of 450: 301 / 450"),
}
C2C_ACHIEVABLE_SHARE = {direction: float(text) for direction, (text, _) in C2C_ACHIEVABLE_SHARE_TEXT.items()}
C2C_LINK_NAME = "NVLink-C2C"


def c2c_capacity(measured: float | None, direction: str, up_links_bytes_per_second: float | None) -> LinkCapacity | None:
    """One direction of a GPU's NVLink-C2C link: what `hybridmon bench` measured over C2C on this
    host where it has run, else the up links' maximum bandwidth (NVML) x C2C_ACHIEVABLE_SHARE of
    the direction; None when neither is known. As the rules' C2C capacity recording computes it."""
    if measured is not None and measured > 0:
        return LinkCapacity(measured, "measured")
    if not up_links_bytes_per_second or direction not in C2C_ACHIEVABLE_SHARE:
        return None
    return LinkCapacity(up_links_bytes_per_second * C2C_ACHIEVABLE_SHARE[direction], "achievable", C2C_LINK_NAME)
