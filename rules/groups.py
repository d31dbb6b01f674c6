"""The Prometheus rule groups, in the rule file's order, each with the recording rules its alerts
share. An alert family joins one by naming it here (agent/alerts/family.py: `group=groups.PCIE`),
never by a string: a group that does not exist is an AttributeError at import, not an empty group
in the rule file.

Recording rules are shared vocabulary (a link's capacity, 1 min averages, robust slopes): several
alert families read them, so they live in this package (pcie.py, host.py, process.py,
inference.py) rather than in one family.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from hybridmon.rules import host, inference, pcie, process
from hybridmon.rules.model import Recording, Thresholds


def _none(thresholds: Thresholds) -> tuple[Recording, ...]:
    return ()


@dataclass(frozen=True)
class RuleGroup:
    name: str                                                   # the group's name in the rule file
    title: str                                                  # its heading in runbooks/README.md
    recordings: Callable[[Thresholds], tuple[Recording, ...]] = _none   # before its alerts


PCIE = RuleGroup("hybridmon-pcie", "The PCIe link and the GPU on it", pcie.recordings)
GPU_MEMORY = RuleGroup("hybridmon-gpu-memory", "GPU memory", pcie.memory_recordings)
BENCH = RuleGroup("hybridmon-bench", "What the offload benchmark measured")
HOST_MEMORY = RuleGroup("hybridmon-host-memory", "Host memory", lambda thresholds: host.recordings())
HOST_CONFIG = RuleGroup("hybridmon-host-config", "Host configuration")
PROCESS = RuleGroup("hybridmon-process", "Inference processes", process.recordings)
INFERENCE = RuleGroup("hybridmon-inference", "Inference servers", inference.recordings)
AGENT = RuleGroup("hybridmon-agent", "The agent itself")
# The rule file's order: what the agent sees first (the link, the GPU), then the host, the
# processes and servers on it, and the agent itself last.
GROUPS: tuple[RuleGroup, ...] = (PCIE, GPU_MEMORY, BENCH, HOST_MEMORY, HOST_CONFIG, PROCESS, INFERENCE, AGENT)
