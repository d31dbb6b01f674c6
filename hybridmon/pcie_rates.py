"""PCIe link facts every layer shares: bytes per lane at each generation, raw line rates, a link's
theoretical capacity and its name. The collectors, the detectors, the PromQL rules, the status page
and the test host all read these tables, so a link means the same number everywhere.

Bytes/s per lane per direction after line encoding: 8b/10b for Gen1-2, 128b/130b for Gen3-5, 242B/256B
FLIT for Gen6 (PCI-SIG base specifications; e.g. Gen4 16 GT/s x 128/130 / 8 = 1969.2 MB/s, so a Gen4
x16 link carries 31.5 GB/s per direction). The raw line rate (GT/s = Gbit/s per lane) is what DCGM's
PCIe replay bound scales with.
"""
from __future__ import annotations

import math

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
LANE_BYTES_PER_SECOND = {generation: float(text) for generation, (text, _) in LANE_BYTES_PER_SECOND_TEXT.items()}
LANE_LINE_RATE_BITS_PER_SECOND = {
    generation: float(text) for generation, (text, _) in LANE_LINE_RATE_BITS_PER_SECOND_TEXT.items()}


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


def effective_capacity(measured: float | None, generation: float | None,
                       lanes: float | None) -> tuple[float, str] | None:
    """(bytes/s, "measured" or "theoretical") of one direction of a link: what `hybridmon bench`
    measured on this host where it has run, else the theoretical rate of the current generation x
    width (the rules' effective-capacity recording says the same); None when neither is known."""
    if measured is not None and measured > 0:
        return measured, "measured"
    if generation is None or lanes is None:
        return None
    theoretical = theoretical_capacity(generation, lanes)
    return (theoretical, "theoretical") if theoretical else None
