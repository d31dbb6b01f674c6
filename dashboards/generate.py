"""Generate the Grafana dashboards from Python, with thresholds from the agent's thresholds file.

    python -m hybridmon.dashboards.generate                 # rewrite dashboards/json/*.json
    python -m hybridmon.dashboards.generate --check         # exit 1 with a diff if the committed JSON differs
    python -m hybridmon.dashboards.generate --thresholds my.toml --runbook-base-url https://runbooks.example/hybridmon

The thresholds come from agent/alerts/thresholds.toml through the loader the agent and
rules.generate use, so a line on a panel is where the alert fires. Import the JSON into Grafana
(Dashboards > New > Import) or provision it; pick the Prometheus that scrapes the agent and loads
rules/hybridmon.rules.yml as the data source.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

try:
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
except ModuleNotFoundError as missing:  # a test extra: an agent installed with `pip install .` lacks it
    raise SystemExit(f"python -m hybridmon.dashboards.generate needs grafana-foundation-sdk ({missing}): "
                     ".venv/bin/pip install -e '.[test]' (what ./scripts/test does). "
                     "The generated dashboards ship with the agent: "
                     "`hybridmon dashboards --output DIR`") from None

from hybridmon.agent.alerts.catalogue import Thresholds
from hybridmon.dashboards import JSON_DIR, gpu, host
from hybridmon.dashboards.common import DEFAULT_RUNBOOK_BASE_URL
from hybridmon import generated
from hybridmon.rules import generate as rules_generate

BUILDERS = {host.UID: host.build, gpu.UID: gpu.build}


def render(thresholds: Thresholds, runbook_base_url: str = DEFAULT_RUNBOOK_BASE_URL) -> dict[str, str]:
    """Every dashboard's file name with its JSON text."""
    encoder = JSONEncoder(sort_keys=True, indent=2)
    return {f"{uid}.json": encoder.encode(build(thresholds, runbook_base_url)) + "\n"
            for uid, build in BUILDERS.items()}


def check(output_dir: Path, files: dict[str, str]) -> list[str]:
    """Unified diffs of every file that differs from what is on disk, and stale extra files."""
    extra = sorted(p.name for p in output_dir.glob("*.json") if p.name not in files) if output_dir.is_dir() else []
    return generated.check(output_dir, files) + [f"{name}: not generated any more (delete it)\n" for name in extra]


def write(output_dir: Path, files: dict[str, str]) -> None:
    output_dir.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        json.loads(text)  # never write what Grafana could not import
        (output_dir / name).write_text(text)


def main(argv: list[str] | None = None) -> int:
    return rules_generate.run_generator(
        argv, "hybridmon.dashboards.generate", __doc__.split("\n\n")[0], JSON_DIR, "the JSON files",
        "runbook links are BASE/<AlertName>; by default the agent chosen in the dashboard serves "
        "its runbooks", render, check, write, DEFAULT_RUNBOOK_BASE_URL)


if __name__ == "__main__":
    sys.exit(main())
