"""Where the tests' checked-in trees are."""
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures"
# A 2-node NUMA host: GPU0 (0000:17:00.0, node 0, AER-capable, full Gen4 x16 link) and GPU1
# (0000:ca:00.0, node 1, link downtrained to Gen3 x8); inference processes 4242 (vllm, on GPU0,
# CPUs on node 0 but most memory on node 1) and 5151 (llama-server, on GPU1). See
# tests/fixtures/README.md for every file.
FIXTURE_HOST = FIXTURES / "host-2node"
# Two GPUs behind one PCIe switch (0000:03:00.0 and 0000:04:00.0, the latter trained to x8, under
# upstream port 0000:01:00.0 on root port 0000:00:01.0) and one on a root port of its own
# (0000:41:00.0): sysfs only. See tests/fixtures/README.md.
FIXTURE_SWITCH_HOST = FIXTURES / "host-switch"
