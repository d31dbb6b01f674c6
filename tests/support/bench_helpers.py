"""A stand-in for the offload benchmark binary: prints a fixture report, as the real one would on a
GPU host, with its progress lines on stderr. It reports the source hash of the .cu in this tree,
so `locate_binary` accepts it like a binary built from this version."""
from __future__ import annotations

import json
import stat
import sys
from pathlib import Path

from hybridmon.agent.bench.build import source_hash

BENCH_FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "bench"

_SCRIPT = '''#!{python}
import json, sys
args = sys.argv[1:]
if args == ["--version"]:
    print(json.dumps({{"version": 1, "source_sha256": {sha!r}}}))
    sys.exit(0)
numa = args[args.index("--numa-node") + 1] if "--numa-node" in args else "auto"
with open({calls!r}, "a") as log:
    log.write(json.dumps(args) + "\\n")
outputs = {outputs!r}
local = numa in ("auto", "none", {local_node!r})
status, path = outputs["auto"] if local else outputs.get("*", outputs["auto"])
text = open(path).read()
try:  # where the real binary was told to put its thread and buffers (offload_bench.cu, main)
    report = json.loads(text)
    cpus = args[args.index("--cpus") + 1] if "--cpus" in args else "auto"
    if report.get("version", 1) >= 2 and status == 0 and cpus != "auto":
        report["cpu_affinity"] = ({{"bound": False, "cpus": "0-63", "note": "not bound (--cpus none)"}}
                                  if cpus == "none" else {{"bound": True, "cpus": cpus, "note": None}})
    if report.get("version", 1) >= 2 and status == 0 and numa == "none":
        report.update(numa_node=None, numa_policy="default", numa_note="not bound (--numa-node none)")
    if report.get("version", 1) >= 2 and status == 0:
        text = json.dumps(report)
except (ValueError, TypeError, AttributeError):
    pass
try:  # progress lines for a well-formed report; a garbage one is printed as it is
    # As offload_bench.cu (version 3) prints them: one per test, each test one result.
    measured = json.loads(text)["results"]
    for step, result in enumerate(measured, 1):
        print(json.dumps({{"progress": {{"step": step, "steps": len(measured), "direction": result["direction"],
                                         "memory": result["memory"], "issue": result.get("issue", ""),
                                         "bytes": result["bytes"]}}}}),
              file=sys.stderr)
except (KeyError, TypeError, ValueError):
    pass
print("a driver warning that is not progress", file=sys.stderr)
sys.stdout.write(text)
sys.exit(status)
'''


def fake_binary(directory: Path, local: str = "report-gen4-local.json",
                remote: str | None = "report-gen4-remote.json", status: int = 0,
                remote_status: int = 0, local_node: str = "0") -> Path:
    """An executable at directory/offload_bench. `local` answers --numa-node auto, none or
    `local_node` (the fixture GPU 0's node, which the runner names explicitly since issue 13) with
    exit `status`, `remote` any other node with `remote_status`; names are files of
    tests/fixtures/bench or absolute paths. Each call's arguments
    are appended to directory/calls.jsonl."""
    outputs = {"auto": (status, str(BENCH_FIXTURES / local))}  # "*": any explicit node
    if remote is not None:
        outputs["*"] = (remote_status, str(BENCH_FIXTURES / remote))
    script = _SCRIPT.format(python=sys.executable, sha=source_hash(), calls=str(directory / "calls.jsonl"),
                            outputs=outputs, local_node=local_node)
    path = directory / "offload_bench"
    path.write_text(script)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def calls(directory: Path) -> list[list[str]]:
    path = directory / "calls.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def stored_run_text() -> str:
    """A stored benchmark run (exporters/bench_runs.py's format) around the fixture report."""
    report = json.loads((BENCH_FIXTURES / "report-gen4-local.json").read_text())
    return json.dumps({"format": 1, "finished_at": 1.7e9, "hybridmon_version": "0",
                       "gpu": {"index": 0, "uuid": "GPU-0", "name": "x", "pci_bus_id": "0000:17:00.0",
                               "numa_node": 0},
                       "link": {"generation": 4, "width": 16, "max_generation": 4, "max_width": 16},
                       "contended": None,
                       "placements": [{"placement": "local", "numa_node": 0, "report": report}],
                       "failures": []})
