"""Every alert hybridmon raises, by name: the specification the catalogue (agent/alerts/catalogue.py)
is checked against. It is the one place the tests name every alert; adding an alert means adding
its name here on purpose."""

SPECIFIED_ALERTS = (
    # the brief's table: the link, the bus and the GPU's memory
    "GpuPcieStarvation", "GpuPcieLinkDegraded", "GpuPcieReplayErrors", "PcieAerErrors", "GpuLost",
    "GpuMemoryHeadroomLow", "GpuPcieBandwidthLow",
    # the host's memory and configuration
    "HostSwapThrash", "HostSwappinessHigh", "HostDirtyRatioHigh", "HostTransparentHugepageAlways",
    "HostNumaBalancingEnabled", "HostNoSwapLowHeadroom", "InferenceProcessMemlockLow",
    # the inference processes
    "InferenceProcessMemoryGrowth", "InferenceProcessNumaMisplaced",
    # the inference servers' own view (issue 6)
    "InferenceThroughputDecay", "InferenceKvOffloadPressure", "InferenceServerScrapeFailing",
    # both sides of the bus (issue 15): weights read over PCIe each step, a host KV tier that won't fit
    "InferenceWeightsCrossingBus", "InferenceOffloadHostMemoryShort",
    # the agent itself (issue 11; issue 12's example of adding an alert)
    "HybridmonAlertDeliveryFailing", "HybridmonCollectorFailing",
    # watching the watcher (issue 14): its loop, and its death (a Prometheus rule only)
    "HybridmonSamplingLagging", "HybridmonAgentDown",
)
