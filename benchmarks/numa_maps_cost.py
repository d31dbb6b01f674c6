"""How long reading and parsing /proc/<pid>/numa_maps takes for a process with a large footprint.

Starts a child Python process that maps and touches anonymous memory in 4 KiB pages (transparent
huge pages refused, so every page is a page-table entry the kernel walks) and creates many small
separate mappings, then times the ProcessNumaCollector's work for that process: the read of
numa_maps through LiveSource and parse_numa_maps. The child is killed when done, on error, and
after --child-timeout seconds whatever happens.

    .venv/bin/python benchmarks/numa_maps_cost.py [--mib 2048] [--mappings 5000] [--repeat 10]
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

from hybridmon.exporters.sources import LiveSource
from hybridmon.exporters.numa import parse_numa_maps

# The child maps `mib` MiB and touches one byte per 4 KiB page, then `mappings` single pages whose
# protections alternate so the kernel cannot merge neighbours into one mapping.
CHILD = r"""
import ctypes, mmap, sys, time
mib, mappings, lifetime = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
page = mmap.PAGESIZE
big = mmap.mmap(-1, mib << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
big.madvise(mmap.MADV_NOHUGEPAGE)
for offset in range(0, mib << 20, page):
    big[offset] = 1
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
region = libc.mmap(None, mappings * page, mmap.PROT_READ | mmap.PROT_WRITE,
                   mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
if region in (None, ctypes.c_void_p(-1).value):
    sys.exit("mmap of the small mappings failed")
for index in range(mappings):
    ctypes.memset(region + index * page, 1, 1)
    if index % 2:
        libc.mprotect(region + index * page, page, mmap.PROT_READ)
print("ready", flush=True)
time.sleep(lifetime)
"""


def measure(pid: int, repeat: int) -> tuple[list[float], list[float], int, dict[int, int]]:
    source = LiveSource()
    path = f"/proc/{pid}/numa_maps"
    read_times, parse_times = [], []
    for _ in range(repeat):
        started = time.perf_counter()
        text = source.read_text(path)
        read_done = time.perf_counter()
        per_node = parse_numa_maps(text)
        parse_times.append(time.perf_counter() - read_done)
        read_times.append(read_done - started)
    return read_times, parse_times, len(text.splitlines()), per_node


def add_child_timeout(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--child-timeout", type=float, default=300.0,
                        help="seconds after which every child exits on its own, whatever happens")


def kernel_has_numa_maps() -> bool:
    """Whether /proc/<pid>/numa_maps exists; says why there is nothing to measure when not."""
    if os.path.exists("/proc/self/numa_maps"):
        return True
    print("this kernel has no /proc/<pid>/numa_maps (no CONFIG_NUMA); nothing to measure")
    return False


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=2048, help="anonymous memory to touch, MiB")
    parser.add_argument("--mappings", type=int, default=5000, help="extra one-page mappings")
    parser.add_argument("--repeat", type=int, default=10, help="timed reads")
    add_child_timeout(parser)
    args = parser.parse_args()
    if not kernel_has_numa_maps():
        return 1
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(args.mib), str(args.mappings), str(args.child_timeout)],
        stdout=subprocess.PIPE, text=True)
    try:
        if child.stdout.readline().strip() != "ready":
            print(f"the child failed to set up its memory (exit status {child.wait(10)})")
            return 1
        read_times, parse_times, lines, per_node = measure(child.pid, args.repeat)
    finally:
        child.kill()
        child.wait(10)
    totals = [r + p for r, p in zip(read_times, parse_times)]
    resident = sum(per_node.values())
    print(f"child: {args.mib} MiB touched in 4 KiB pages, {args.mappings} extra mappings; "
          f"numa_maps has {lines} lines, {resident / 2**30:.2f} GiB resident over nodes "
          f"{sorted(per_node)}")
    print(f"read  median {statistics.median(read_times) * 1e3:8.2f} ms  max {max(read_times) * 1e3:8.2f} ms")
    print(f"parse median {statistics.median(parse_times) * 1e3:8.2f} ms  max {max(parse_times) * 1e3:8.2f} ms")
    print(f"total median {statistics.median(totals) * 1e3:8.2f} ms  max {max(totals) * 1e3:8.2f} ms "
          f"({args.repeat} reads)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
