"""The verdict of `scripts/validate-gpu`: each figure it measures on a GPU host against an independent
reference, PASS within TOLERANCE, FAIL otherwise, and the exit status that sums them up.

Plain functions over figures, so the tests drive them with canned numbers; the script measures.
Two kinds of check (docs/offload-bench.md, "Validating on a GPU host"):

- the bench against a reference copy (PyTorch or CuPy) made the same way, at the same transfer
  size, pinned and NUMA-local: each direction alone, and each direction while the opposite one
  copies twice the bytes (nvbandwidth's bidirectional method, which the bench follows since
  issue 29);
- the agent's PCIe reading against a copy of known size in each direction: the byte counters'
  delta (where the GPU has them) and the throughput gauge's mean, both read through the agent's
  own NVML gate (exporters/nvml.py, already in bytes), against bytes moved over the seconds taken.

A figure missing on either side fails: a validation that could not compare has not passed.
"""
from __future__ import annotations

from dataclasses import dataclass

TOLERANCE = 0.05
"""The goal the bench was written to (docs/offload-bench.md: within 5 % of nvbandwidth). Run to
run, copy-engine bandwidth on an idle link varies by about 1 % (nvbandwidth's README table: 25.94
to 26.19 GB/s over eight GPUs of one host), so 5 % leaves room for noise and none for a method
that differs, such as a bidirectional stream running its tail alone (+32 % in issue 29)."""
EXIT_PASSED, EXIT_FAILED = 0, 1
BENCH_FIGURES = ("h2d", "d2h", "h2d_bidirectional", "d2h_bidirectional")
DIRECTIONS = ("host_to_device", "device_to_host")
GIGA = 1e9


@dataclass(frozen=True)
class Check:
    """One figure against its reference; `measured` and `reference` in the unit `unit` names."""

    name: str
    measured: float | None
    reference: float | None
    unit: str = "GB/s"
    tolerance: float = TOLERANCE
    note: str = ""

    @property
    def difference(self) -> float | None:
        """(measured - reference) / reference; None when either is missing or the reference is 0."""
        if self.measured is None or not self.reference:
            return None
        return (self.measured - self.reference) / self.reference

    @property
    def passed(self) -> bool:
        return self.difference is not None and abs(self.difference) <= self.tolerance

    def line(self) -> str:
        verdict = "PASS" if self.passed else "FAIL"
        if self.difference is None:
            missing = "measured" if self.measured is None else "reference"
            return f"{verdict}  {self.name}: no {missing} figure{f' ({self.note})' if self.note else ''}"
        return (f"{verdict}  {self.name}: {self.measured:.2f} against {self.reference:.2f} {self.unit} "
                f"({self.difference:+.1%}, tolerance {self.tolerance:.0%})"
                + (f"; {self.note}" if self.note else ""))


def bench_checks(bench: dict[str, float], reference: dict[str, float] | None, library: str,
                 transfer_bytes: int) -> list[Check]:
    """The bench's GB/s per figure (BENCH_FIGURES, its largest pinned queued copies) against the
    reference's at the same transfer size; `reference` None when no reference library ran."""
    note = "" if reference is not None else "neither PyTorch nor CuPy imports: install one to validate"
    return [Check(f"bench {figure} vs {library or 'reference'} ({transfer_bytes:,} B)", bench.get(figure),
                  (reference or {}).get(figure), note=note)
            for figure in BENCH_FIGURES]


@dataclass(frozen=True)
class PcieSampling:
    """What the agent's NVML gate read while a copy of known size ran one way.

    bytes_moved over seconds is the truth. counter_bytes: the byte counter of that direction after
    minus before (None where the GPU has no usable counters: the agent then uses the throughput
    gauge). throughput: the gauge's readings of that direction taken during the copy, bytes/s."""

    direction: str  # one of DIRECTIONS
    bytes_moved: int
    seconds: float
    counter_bytes: int | None
    throughput: tuple[float, ...]


def inner_mean(readings: tuple[float, ...]) -> float | None:
    """Mean of the readings without the first and the last: NVML's 20 ms window at either edge
    spans idle time (with three or fewer readings, all of them)."""
    kept = readings[1:-1] if len(readings) > 3 else readings
    return sum(kept) / len(kept) if kept else None


def nvml_checks(samplings: list[PcieSampling]) -> list[Check]:
    """Per direction: the counter's bytes against the bytes moved (where the GPU counts), and the
    throughput gauge's mean against the copy's rate, both GB/s over the copy's seconds."""
    checks = []
    for sampling in samplings:
        rate = sampling.bytes_moved / sampling.seconds / GIGA
        where = f"{sampling.bytes_moved:,} B in {sampling.seconds:.2f} s"
        if sampling.counter_bytes is not None:
            checks.append(Check(f"agent PCIe byte counter, {sampling.direction}",
                                sampling.counter_bytes / sampling.seconds / GIGA, rate, note=where))
        mean = inner_mean(sampling.throughput)
        checks.append(Check(f"agent PCIe throughput gauge, {sampling.direction}",
                            None if mean is None else mean / GIGA, rate,
                            note=f"{where}, {len(sampling.throughput)} readings"))
    return checks


def exit_status(checks: list[Check]) -> int:
    """EXIT_FAILED when any check failed or there was none to make, else EXIT_PASSED."""
    return EXIT_PASSED if checks and all(check.passed for check in checks) else EXIT_FAILED


def report(checks: list[Check]) -> str:
    failed = sum(not check.passed for check in checks)
    summary = (f"verdict: FAIL ({failed} of {len(checks)} checks)" if failed or not checks
               else f"verdict: PASS ({len(checks)} checks within {TOLERANCE:.0%})")
    return "\n".join([check.line() for check in checks] + [summary])
