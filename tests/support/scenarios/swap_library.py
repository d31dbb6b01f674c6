"""The scenarios of issue 28's swap class: swap thrash as the kernel shows it with zswap on.

zswap (Documentation/admin-guide/mm/zswap.rst) compresses pages on their way to swap into a RAM
pool; a page it stores or serves is not counted in pswpout/pswpin (mm/page_io.c returns before
counting), only in zswpout/zswpin. Each page read back is a major fault of the process that
touched it (mm/memory.c do_swap_page returns VM_FAULT_MAJOR when the page was not in the swap
cache), so the host's pgmajfault and the faulting process's majflt carry the thrash too.

Written like library.py's: start from the healthy host, change what the story needs from onset.
Every figure is a simulated input, not a measurement.
"""
from __future__ import annotations

from tests.support.scenarios.host import GIB, MIB, SyntheticHost
from tests.support.scenarios.library import VLLM, ProcessLoad, Step, apply, healthy_host, healthy_load, ramp, scenario

BATCH, BATCH_NAME = 7001, "etl_batch"   # an unwatched batch job: no [process] setting matches it
PAGE = 4096                             # x86-64's page, the unit of zswpin/zswpout and majflt
ZSWAP_THRASH_BYTES_PER_SECOND = 30e6    # issue 28's figure, each way
DEVICE_BYTES_PER_SECOND = 0.4e6         # issue 28: pswpin/pswpout under 0.5 MB/s
# Every page it reads back from zswap or the device is one major fault: (30 + 0.4) MB/s of 4 KiB
# pages is 7,422/s, rounded to 7,400; with ~200/s of file refaults elsewhere the host shows the
# issue's ~7,600 major faults/s.
BATCH_MAJOR_FAULTS_PER_SECOND = 7400.0
OTHER_MAJOR_FAULTS_PER_SECOND = 200.0


def _batch_job(host: SyntheticHost) -> None:
    host.add_unwatched_process(BATCH, BATCH_NAME, "/usr/bin/python3 -m etl_batch --shard 7")


@scenario("zswap_thrash", tick_seconds=5, duration_seconds=360, onset_seconds=60,
          expected=[("HostSwapThrash", {})])
def zswap_thrash(host: SyntheticHost) -> Step:
    """Issue 28's host: zswap on, recommended sysctls (vm.swappiness=10, so no static finding), and
    an unwatched batch job (etl_batch, pid 7001) that from onset works through more memory than is
    free. The kernel compresses its pages into zswap and reads them straight back: zswpin ~30 MB/s
    and zswpout ~30 MB/s, while the swap device sees under 0.5 MB/s each way (pswpin/pswpout 0.4
    MB/s: what zswap writes back as its pool fills). The batch job takes ~7,400 major faults/s (30.4
    MB/s of 4 KiB pages), the host ~7,600/s with others' file refaults; PSI memory some ~30 % (full
    ~12 %); zswap's pool grows to 2 GiB holding 6 GiB (3:1) and MemAvailable falls to ~4 GiB. vLLM
    (pid 4242) loses 512 MiB of cold pages to swap over 4 min but never touches them: its major
    faults stay at 0, so it is not blamed. HostSwapThrash warns for the host and names the batch
    job; no per-process critical."""
    healthy_host(host)
    _batch_job(host)
    onset = 60
    vllm = host.process(VLLM)
    resident_anon = vllm.rss_anon_bytes

    def step(t: float) -> None:
        load = healthy_load()
        load.processes[BATCH] = ProcessLoad(1.0, 3000.0, 0.0)
        if t >= onset:
            load.processes[BATCH] = ProcessLoad(1.0, 3000.0, BATCH_MAJOR_FAULTS_PER_SECOND)
            load.processes[VLLM].major_faults_per_second = 0.0
            load.other_major_faults_per_second = OTHER_MAJOR_FAULTS_PER_SECOND
            load.swap_in_bytes_per_second = load.swap_out_bytes_per_second = DEVICE_BYTES_PER_SECOND
            load.reclaim_pages_per_second = {"kswapd": 30_000.0, "direct": 4_000.0}
            load.pressure = {"memory": (0.30, 0.12), "io": (0.05, 0.02), "cpu": (0.06, 0.0)}
        apply(host, load)
        zswap = ZSWAP_THRASH_BYTES_PER_SECOND if t >= onset else 0.0
        host.set_zswap_traffic(host.jitter(zswap, 0.03), host.jitter(zswap * 1.02, 0.03))
        vllm.swap_out(ramp(t, onset, onset + 240, 0.0, 512 * MIB))
        vllm.rss_anon_bytes = resident_anon - vllm.swap_bytes
        host.set_meminfo(Zswap=ramp(t, onset, onset + 120, 0, 2 * GIB),
                         Zswapped=ramp(t, onset, onset + 120, 0, 6 * GIB),
                         MemAvailable=ramp(t, onset, onset + 60, 260 * GIB, 4 * GIB),
                         MemFree=ramp(t, onset, onset + 60, 150 * GIB, 1 * GIB))
    return step


@scenario("healthy_zswap_light", tick_seconds=5, duration_seconds=300, onset_seconds=None, expected=[])
def healthy_zswap_light(host: SyntheticHost) -> Step:
    """zswap on and lightly used: its pool holds 3 GiB of cold anonymous pages in 1 GiB of RAM,
    and the kernel trickles pages through it at zswpout ~200 KB/s and zswpin ~150 KB/s (a fifth
    of HostSwapThrash's 1 MiB/s), nothing reaches the swap device. The ~37 pages/s read back are
    major faults of the batch job (etl_batch, pid 7001) that owns them, ~37/s, under the host's
    50/s; PSI memory some ~0.2 %. Silent, and the faulting_processes collector never reads a
    process: swap-in stays under its 1 MiB/s gate."""
    healthy_host(host)
    _batch_job(host)
    host.set_meminfo(Zswap=1 * GIB, Zswapped=3 * GIB)

    def step(t: float) -> None:
        load = healthy_load()
        load.processes[BATCH] = ProcessLoad(1.0, 3000.0, 150e3 / PAGE)
        apply(host, load)
        host.set_zswap_traffic(host.jitter(150e3, 0.05), host.jitter(200e3, 0.05))
    return step
