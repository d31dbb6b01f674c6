"""agent/thread_names.py: the daemon's threads named in the kernel, checked in a subprocess (the
hook applies to every thread the process starts afterwards, and renames its main thread)."""
import json
import subprocess
import sys

import pytest

from hybridmon.agent.thread_names import kernel_name

CHILD = r"""
import json, os, threading
from concurrent.futures import ThreadPoolExecutor
from hybridmon.agent.thread_names import name_threads_in_kernel

def comm():
    with open(f"/proc/self/task/{threading.get_native_id()}/comm") as handle:
        return handle.read().strip()

before = {}
started = threading.Thread(target=lambda: before.update(early=comm()), name="hybridmon-pcie-gpu0")
started.start(); started.join()
name_threads_in_kernel()
found = {"main": comm(), "early": before["early"]}
for name in ("hybridmon-pcie-gpu7", "sampler", "a-name-longer-than-fifteen-bytes"):
    thread = threading.Thread(target=lambda n=name: found.update({n: comm()}), name=name)
    thread.start(); thread.join()
with ThreadPoolExecutor(1, thread_name_prefix="collector") as pool:
    found["pool"] = pool.submit(comm).result()
print(json.dumps(found))
"""


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl(PR_SET_NAME) is Linux's")
def test_threads_started_after_the_hook_carry_their_names_in_the_kernel():
    result = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=60,
                            check=True)
    found = json.loads(result.stdout)
    assert found["main"] == "hybridmon"
    assert found["hybridmon-pcie-gpu7"] == "pcie-gpu7"
    assert found["sampler"] == "sampler"
    assert found["a-name-longer-than-fifteen-bytes"] == "a-name-longer-t"
    assert found["pool"] == "collector_0"
    # a thread started before the hook keeps the interpreter's name for it
    assert found["early"] != "pcie-gpu0"


def test_kernel_names_are_ascii_and_at_most_fifteen_bytes():
    assert kernel_name("hybridmon-pcie-gpu12") == b"pcie-gpu12"
    assert kernel_name("résolveur") == b"r?solveur"
    assert len(kernel_name("x" * 40)) == 15
